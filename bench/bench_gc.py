"""What Python's cyclic garbage collector costs a decode worker, with and without protos.gc_tuning.

    python bench/bench_gc.py [--repeats 5] [--threads 2] [--out bench/results/gc.md]
                             [--up-rounds 3 --before-tree PATH]

Each sample is a fresh process that starts as a `pdserve decode-worker` does, without its servers: it imports the
worker's modules and builds the engine (the default model, EngineConfig defaults, 1 GiB of KV cache), either with
the collector on, as before protos.gc_tuning, or paused from the first line (`pause_collection`, what the server
commands do now), then freezes the heap (`freeze_startup_heap`). Modes alternate, process by process. Per process:

    import s, build s      wall seconds of the imports and of build_engine
    gen-2 during start     full collections while it started, and the milliseconds they took (gc.callbacks)
    freeze ms              freeze_startup_heap: the one collection before gc.freeze
    full walk ms           one gc.collect() of the whole heap, before freezing (what each full collection costs a
                           server that never froze) and after (what it costs now)

The table gives each mode's median over its processes; the machine's CPU model is recorded.

With --before-tree (a checkout of a commit before protos.gc_tuning, e.g. `git worktree add /tmp/before 6c3dcfb`):
the README's first command, `pdserve up --once "What is the capital of France?"` (the whole local cluster started,
one answer, stopped), timed end to end --up-rounds times with that tree's code and this one's, alternating, each
run a fresh `python -m pdserve` with PYTHONPATH at its tree, the answer checked.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdserve.bench.roofline import cpu_model  # noqa: E402

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from protos.gc_tuning import freeze_startup_heap, pause_collection
import gc
paused = sys.argv[1] == "paused"
if paused:
    pause_collection()
pauses, started = [], [0.0]
def probe(phase, info):
    if info["generation"] == 2:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])
gc.callbacks.append(probe)
import decode_worker.server, prefill_worker.server, gateway.server  # noqa: F401  (a worker's imports and more)
from engine.config import EngineConfig
from engine.engine_loop import build_engine
from engine.model_fetch import fetch_default_model
t1 = time.perf_counter()
engine = build_engine(EngineConfig(model=str(fetch_default_model()), num_threads=int(sys.argv[2]),
                                   kv_cache_memory=1 << 30), progress=False)
t2 = time.perf_counter()
during_start = list(pauses)
gc.enable()
objects = len(gc.get_objects())
w0 = time.perf_counter(); gc.collect(); walk_before = time.perf_counter() - w0
gc.disable()
t3 = time.perf_counter(); frozen = freeze_startup_heap(); t4 = time.perf_counter()
w1 = time.perf_counter(); gc.collect(); walk_after = time.perf_counter() - w1
print(json.dumps({"imports_s": t1 - t0, "build_s": t2 - t1, "gen2_during_start": len(during_start),
                  "gen2_ms_during_start": 1e3 * sum(during_start), "objects": objects, "frozen": frozen,
                  "freeze_ms": 1e3 * (t4 - t3), "walk_before_ms": 1e3 * walk_before,
                  "walk_after_ms": 1e3 * walk_after}))
"""

MODES = ("collector on", "paused")
COLUMNS = (("imports_s", "import s", 2), ("build_s", "build s", 2), ("start_s", "import + build s", 2),
           ("gen2_during_start", "gen-2 during start", 0), ("gen2_ms_during_start", "their ms", 0),
           ("freeze_ms", "freeze ms", 0), ("objects", "objects", 0), ("walk_before_ms", "full walk ms, before", 1),
           ("walk_after_ms", "full walk ms, frozen", 2))


def sample(mode: str, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, "paused" if mode == "paused" else "on", str(threads)],
                         cwd=REPO, capture_output=True, text=True, check=True, timeout=600)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["start_s"] = row["imports_s"] + row["build_s"]
    return row


UP_MESSAGE = "What is the capital of France?"


def up_seconds(tree: Path) -> float:
    """Wall seconds of `pdserve up --once UP_MESSAGE` run from `tree`'s code."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pdserve", "up", "--once", UP_MESSAGE, "--port", "0",
                          "--http-port", "0"], cwd="/", env={**os.environ, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True, check=True, timeout=600)
    seconds = time.perf_counter() - start
    if "Paris" not in out.stdout:
        raise RuntimeError(f"unexpected answer from {tree}: {out.stdout!r}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="processes per mode")
    parser.add_argument("--threads", type=int, default=2, help="engine threads of each process")
    parser.add_argument("--out", default="bench/results/gc.md")
    parser.add_argument("--before-tree", type=Path, default=None,
                        help="a checkout of an earlier commit: time `pdserve up --once` with its code and this one's")
    parser.add_argument("--up-rounds", type=int, default=3, help="`pdserve up --once` runs per tree")
    args = parser.parse_args()
    samples: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for i in range(args.repeats):
        for mode in MODES:
            samples[mode].append(sample(mode, args.threads))
            print(f"round {i + 1}/{args.repeats} {mode}: start {samples[mode][-1]['start_s']:.2f} s", flush=True)
    medians = {mode: {key: statistics.median(s[key] for s in rows) for key, _, _ in COLUMNS}
               for mode, rows in samples.items()}
    command = f"python bench/bench_gc.py --repeats {args.repeats} --threads {args.threads}" + (
        f" --before-tree {args.before_tree} --up-rounds {args.up_rounds}" if args.before_tree is not None else "")
    lines = [f"### A decode worker's start and its collector ({datetime.date.today()}, {cpu_model()}, "
             f"{args.threads} engine threads, median of {args.repeats} processes per mode)", "",
             f"Command: `{command}`", "",
             "| collector while starting | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for mode in MODES:
        lines.append(f"| {mode} | " + " | ".join(f"{medians[mode][key]:,.{digits}f}" for key, _, digits in COLUMNS)
                     + " |")
    ratio = medians["paused"]["start_s"] / medians["collector on"]["start_s"]
    lines += ["", f"Start (import + build), paused / collector on: {ratio:.2f}x."]
    up: dict[str, list[float]] = {}
    if args.before_tree is not None:
        trees = {"before": args.before_tree.resolve(), "this tree": REPO}
        up = {name: [] for name in trees}
        for i in range(args.up_rounds):
            for name, tree in trees.items():
                up[name].append(up_seconds(tree))
                print(f"up round {i + 1}/{args.up_rounds} {name}: {up[name][-1]:.1f} s", flush=True)
        before, now = statistics.median(up["before"]), statistics.median(up["this tree"])
        lines += ["", f"`pdserve up --once \"{UP_MESSAGE}\"`, wall seconds (median of {args.up_rounds}, runs "
                  f"alternating): before ({args.before_tree}) {before:.1f} "
                  f"({', '.join(f'{x:.1f}' for x in up['before'])}), this tree {now:.1f} "
                  f"({', '.join(f'{x:.1f}' for x in up['this tree'])}): {now / before:.2f}x."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "cpu": cpu_model(), "samples": samples,
                                                    "medians": medians, "up_seconds": up}, indent=1))


if __name__ == "__main__":
    main()
