"""A prefill worker beside a decode worker on two CPUs: prefill on its own CPU only, on both CPUs at the kernel's idle
priority (SCHED_IDLE), or on its own CPU plus the decode worker's whenever that one is idle, a step at a time
(engine.cpu_share: the prefill side of what `pdserve up --pin-workers --lend-idle-cpus` does; the decode side's
figures come from the suite's pdserve-1p1d-lend and `bench/bench_cluster.py --tpot-vs-engine --lend`).

Two processes stand for the workers, each an engine of the default model (float32 activations on the GGUF's codes,
the workers' default) stepped on a thread of its own as an engine loop does:
    decode   pinned to the second CPU, one thread, holding engine.cpu_share's busy lock while it has work: it
             decodes --decode-batch sequences of --burst-tokens new tokens, then idles --gap-s seconds ("bursts"),
             or starts the next burst at once ("busy"); or it is not started ("none")
    prefill  prefills --rounds prompts of --prompt-len random tokens one after another (one new token each), after
             one warm-up prompt, in each mode:
               own         pinned to the first CPU, one thread
               sched-idle  both CPUs, two threads, every thread SCHED_IDLE (runs only where nothing else wants the CPU)
               borrow      its own CPU, and before each step engine.cpu_share.CpuBorrower widens the step to both CPUs
                           (two threads) while the decode process holds no lock; --max-num-batched-tokens bounds a
                           step; pinned as a borrowing worker is (pdserve.affinity.pin_process `borrowed=`: libgomp
                           loaded on both CPUs, short spinning)
The table: each mode's median prefill seconds, and the decode process's median step while the prefills ran against
before they started (its own pace alone).

    python bench/bench_cpu_lending.py [--prompt-len 1024] [--rounds 4] [--decode-batch 4] [--burst-tokens 50]
                                      [--gap-s 1] [--max-num-batched-tokens 256] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from pdserve.bench.roofline import cpu_model

MODES = ("own", "sched-idle", "borrow")
DECODES = ("none", "busy", "bursts")
WARMUP_S = 20.0
"""The decode process's steps before the prefills start (its pace alone; it loads its model meanwhile too)."""


def _engine(threads: int, max_num_batched_tokens: int):
    from engine.config import EngineConfig
    from engine.engine_loop import build_engine
    from engine.model_fetch import fetch_default_model
    from kvstore.malloc_tuning import keep_freed_memory_for_reuse

    keep_freed_memory_for_reuse()
    return build_engine(EngineConfig(model=str(fetch_default_model()), num_threads=threads, kv_cache_memory=2**30,
                                     max_num_batched_tokens=max_num_batched_tokens), progress=False)


def _sched_idle() -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:
            pass


def _on_thread(fn):
    """fn() on a fresh thread (an engine loop's), its result returned."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()))
    thread.start()
    thread.join()
    return result["value"]


def decode_process(cpu: int, lock: str, pattern: str, batch: int, burst_tokens: int, gap_s: float,
                   stop, ready, out) -> None:
    from engine.cpu_share import BusyLock
    from engine.engine_loop import use_engine_threads
    from engine.sampling_params import SamplingParams
    from pdserve.affinity import pin_process

    pin_process([cpu])
    engine = _engine(1, 2048)
    busy = BusyLock(lock)

    def run() -> list[tuple[float, float]]:
        use_engine_threads(engine)
        rng = random.Random(0)
        params = SamplingParams(max_tokens=burst_tokens, temperature=0.0, ignore_eos=True)
        steps, burst = [], 0
        ready.set()
        while not stop.is_set():
            if not engine.has_unfinished():
                busy.activity(False)
                if burst and pattern == "bursts":
                    time.sleep(gap_s)
                for i in range(batch):
                    engine.add_request(f"{burst}-{i}", [rng.randrange(100, 40000) for _ in range(32)], params)
                burst += 1
            busy.activity(True)
            started = time.perf_counter()
            engine.step()
            steps.append((time.time(), time.perf_counter() - started))
        busy.close()
        return steps

    out.put(_on_thread(run))


def prefill_process(mode: str, cpus: tuple[int, int], lock: str, prompt_len: int, rounds: int,
                    max_num_batched_tokens: int, out) -> None:
    from engine.cpu_share import CpuBorrower
    from engine.engine_loop import use_engine_threads
    from engine.sampling_params import SamplingParams
    from pdserve.affinity import pin_process

    own, lent = cpus
    pin_process([own] if mode != "sched-idle" else [own, lent], borrowed=[lent] if mode == "borrow" else ())
    if mode == "sched-idle":
        _sched_idle()
    engine = _engine(2 if mode == "sched-idle" else 1, max_num_batched_tokens)
    borrower = CpuBorrower(lock, [own], [lent]) if mode == "borrow" else None

    def run() -> list[tuple[float, float, float]]:
        use_engine_threads(engine)
        if mode == "sched-idle":
            _sched_idle()
        rng = random.Random(1)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        times = []
        for r in range(rounds + 1):
            engine.add_request(f"p{r}", [rng.randrange(100, 40000) for _ in range(prompt_len)], params)
            wall, started = time.time(), time.perf_counter()
            while engine.has_unfinished():
                if borrower is not None:
                    borrower.activity(True)
                engine.step()
            if r:  # the first prompt warms up
                times.append((wall, time.time(), time.perf_counter() - started))
        return times

    out.put(_on_thread(run))


def measure(mode: str, pattern: str, args, cpus: tuple[int, int], lock: str) -> dict:
    ctx = mp.get_context("spawn")
    prefill_out, decode_out, stop, ready = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    decoder = None
    if pattern != "none":
        decoder = ctx.Process(target=decode_process, args=(cpus[1], lock, pattern, args.decode_batch,
                                                           args.burst_tokens, args.gap_s, stop, ready, decode_out))
        decoder.start()
        ready.wait(600)
        time.sleep(WARMUP_S)
    prefiller = ctx.Process(target=prefill_process, args=(mode, cpus, lock, args.prompt_len, args.rounds,
                                                          args.max_num_batched_tokens, prefill_out))
    prefiller.start()
    prefills = prefill_out.get()
    prefiller.join()
    row = {"mode": mode, "decode": pattern, "prefill_s": statistics.median(s for _, _, s in prefills)}
    if decoder is not None:
        stop.set()
        steps = decode_out.get()
        decoder.join()
        start, end = prefills[0][0], prefills[-1][1]
        during = [s for t, s in steps if start <= t <= end]
        alone = [s for t, s in steps if t < start - 1.0]
        row["step_ms_during"] = 1000 * statistics.median(during) if during else float("nan")
        row["step_ms_alone"] = 1000 * statistics.median(alone) if alone else float("nan")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--decode-batch", type=int, default=4)
    parser.add_argument("--burst-tokens", type=int, default=50)
    parser.add_argument("--gap-s", type=float, default=1.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        raise SystemExit("needs two CPUs")
    cpus = (allowed[0], allowed[1])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        lock = str(Path(tmp) / "decode.busy")
        for pattern in DECODES:
            for mode in MODES:
                rows.append(measure(mode, pattern, args, cpus, lock))
                print(rows[-1], flush=True)
    own = {r["decode"]: r["prefill_s"] for r in rows if r["mode"] == "own"}
    lines = [f"{cpu_model()}, CPUs {cpus[0]} (prefill) and {cpus[1]} (decode): {args.rounds} prompts of "
             f"{args.prompt_len} tokens, steps of at most {args.max_num_batched_tokens} tokens; decode "
             f"{args.decode_batch} sequences, bursts of {args.burst_tokens} tokens {args.gap_s:g} s apart", "",
             "| decode process | prefill on | prefill s (median) | x its own CPU's | decode step ms during / alone |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        step = (f"{r['step_ms_during']:.2f} / {r['step_ms_alone']:.2f}" if "step_ms_during" in r else "-")
        lines.append(f"| {r['decode']} | {r['mode']} | {r['prefill_s']:.3f} | {r['prefill_s'] / own[r['decode']]:.2f}x"
                     f" | {step} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
