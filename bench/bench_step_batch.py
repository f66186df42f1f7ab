"""Where a batch-N step of the engine's default configuration goes on CPU: the serving suite's N-stream scenario
(`pdserve bench --suite cpu`, scenario "streams": N requests of --prompt-len prompt tokens and --output-len output
tokens, all due at once) run by one engine, step by step, with every part of a step timed.

    python bench/bench_step_batch.py [--batch-size 32] [--threads 1,2] [--prompt-len 128] [--output-len 64]
        [--repeats 2] [--cpu-matmul native-bf16|native|torch] [--quantization int8|int4]
        [--out bench/results/step_batch.json]

Per thread count an engine is built as the suite builds pdserve-engine (EngineConfig(model, num_threads,
kv_cache_memory=2 GiB; --cpu-matmul its kernels, the default's unless given; --quantization requantizes the
weights, as pdserve-engine-int8 / -int4 do), on a short-lived thread) and stepped
on one thread, as a worker's loop does. Each repeat runs the whole scenario twice, first without timers (the step
times and the scenario's output tokens/s: what the suite measures, without its HTTP-free backend's bookkeeping)
and then with them; the tables are the median over repeats. Timed, each as exclusive wall time of the step's part
(a part called inside a timed linear or kernel counts for it):

    schedule           Scheduler.schedule
    batch building     ModelRunner.execute's own work: the flat batch, block tables, sampling rows
    step tensors       engine.step_batch.run_step's own work: metadata tensors, the sampled rows' hidden states
    embedding          DecoderModel._embed
    linear layers      every layer's linears (Float/Int8/Int4Linear.forward)
    LM head            the LM head's `logits` (with its exact top-k recompute)
    rms_norm .. silu_mul  the kernels.* calls engine.model makes (native C or torch's, as kernels.dispatch picks)
    model other        DecoderModel.forward's own work (the layer loop, views, reshapes)
    sampling           engine.sampler.sample_rows
    engine bookkeeping LLMEngine.step's own work: scheduler updates, prefix-cache hashing, StepOutputs
    stream fan-out     EngineLoop._dispatch of each step's outputs to one RequestStream per request (timed apart:
                       the loop's queue.put per output)

Rows: the prefill steps (the scenario's first max_num_batched_tokens-sized steps) and the decode steps (every
sequence one token), in ms per step, with the un-timed step beside them; per thread count the un-timed runs'
scenario seconds, output tokens/s and minor page faults (the process's, during the run: with the malloc settings
every pdserve process applies first, kvstore.malloc_tuning, a few thousand at most). The machine's CPU model and
copy bandwidth are recorded. The tables land in the JSON and a Markdown file next to it.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import random
import resource
import statistics
import threading
import time
from pathlib import Path

import torch

import kernels
from engine import model_runner, quant
from engine.config import CPU_MATMULS, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from engine.engine_loop import (
    EngineLoop,
    RequestStream,
    build_engine,
    use_engine_threads,
)
from engine.model_fetch import fetch_default_model
from engine.sampling_params import SamplingParams
from kvstore.malloc_tuning import keep_freed_memory_for_reuse
from pdserve.bench.roofline import copy_bandwidth, cpu_model
from pdserve.cli_args import parse_int_list

KERNELS = ("rms_norm", "rotary_embedding", "write_kv", "paged_attention", "silu_mul")
LEAVES = ("linear layers", "LM head", "embedding", *KERNELS, "sampling")
"""Timed parts whose inner timed calls count for them."""
COLUMNS = ("step", "untimed step", "schedule", "batch building", "step tensors", "embedding", "linear layers",
           "LM head", *KERNELS, "model other", "sampling", "engine bookkeeping", "stream fan-out")


class StepTimers:
    """Exclusive wall seconds by label: a timed call's time minus that of the timed calls inside it; inside a
    leaf (LEAVES) nothing else is timed."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.enabled = False
        self._stack: list[list] = []   # [label, seconds of timed children]
        self._undo: list = []

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.enabled or (self._stack and self._stack[-1][0] in LEAVES):
                return fn(*args, **kwargs)
            frame = [label, 0.0]
            self._stack.append(frame)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self._stack.pop()
                self.seconds[label] += elapsed - frame[1]
                if self._stack:
                    self._stack[-1][1] += elapsed

        self._undo.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, timed)

    def unwrap(self) -> None:
        for owner, name, old in reversed(self._undo):
            if old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._undo.clear()


def instrument(engine, timers: StepTimers) -> None:
    runner, model = engine.runner, engine.runner.model
    timers.wrap(engine, "step", "engine bookkeeping")
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(runner, "execute", "batch building")
    timers.wrap(model_runner, "run_step", "step tensors")
    timers.wrap(model_runner, "sample_rows", "sampling")
    timers.wrap(model, "forward", "model other")
    timers.wrap(model, "_embed", "embedding")
    for name in KERNELS:
        timers.wrap(kernels, name, name)
    for cls in (quant.FloatLinear, quant.Int8Linear, quant.Int4Linear):
        timers.wrap(cls, "forward", "linear layers")
    for cls in (quant.FloatLinear, quant.Int8Linear):
        timers.wrap(cls, "logits", "LM head")


def run_scenario(engine, args, seed: int, timers: StepTimers | None) -> dict:
    """The N-stream scenario once: per step kind ("prefill": it computed prompt tokens, else "decode") the step
    seconds and, with `timers`, each part's; plus output tokens/s of the whole run."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    loop = EngineLoop(engine)  # not started: only its fan-out of outputs to streams is timed, on this thread
    for i in range(args.batch_size):
        request_id = f"s{seed}-{i}"
        engine.add_request(request_id, [rng.randrange(100, engine.model_config.vocab_size)
                                        for _ in range(args.prompt_len)], params)
        loop._streams[request_id] = RequestStream(loop, request_id)
    kinds: dict[str, dict] = {"prefill": collections.defaultdict(list), "decode": collections.defaultdict(list)}
    tokens = 0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    while engine.has_unfinished():
        if timers is not None:
            timers.seconds.clear()
            timers.enabled = True
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        loop._dispatch(outputs)
        fan_out = time.perf_counter() - t1
        if timers is not None:
            timers.enabled = False
        tokens += sum(len(out.new_token_ids) for out in outputs)
        parts = kinds["prefill" if engine.last_step.num_prompt_tokens else "decode"]
        parts["step"].append(t1 - t0)
        parts["stream fan-out"].append(fan_out)
        if timers is not None:
            for label in COLUMNS[2:-1]:
                parts[label].append(timers.seconds[label])
    elapsed = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    engine.kv.pool.clear_cache()  # the next run's prompts find no cached blocks
    return {"kinds": kinds, "output_tokens_per_s": tokens / elapsed, "seconds": elapsed, "page_faults": faults}


def measure(threads: int, args) -> dict:
    config = EngineConfig(model=str(fetch_default_model()), num_threads=threads, kv_cache_memory=2 * 2**30,
                          cpu_matmul=args.cpu_matmul, kv_cache_dtype=args.kv_cache_dtype,
                          quantization=args.quantization)
    engine = build_engine(config, progress=False)
    timers = StepTimers()
    result: dict = {}

    def run() -> None:
        use_engine_threads(engine)
        run_scenario(engine, args, seed=10**6, timers=None)  # warm-up
        plain, timed = [], []
        instrument(engine, timers)
        try:
            for r in range(args.repeats):
                plain.append(run_scenario(engine, args, seed=2 * r, timers=None))
                timed.append(run_scenario(engine, args, seed=2 * r + 1, timers=timers))
        finally:
            timers.unwrap()
        rows = {}
        for kind in ("prefill", "decode"):
            row = {"steps": len(plain[0]["kinds"][kind]["step"])}
            # per run: the mean over its steps of this kind; then the median over runs
            row["untimed step"] = statistics.median(statistics.fmean(p["kinds"][kind]["step"]) for p in plain)
            for label in ("step", *COLUMNS[2:]):
                row[label] = statistics.median(statistics.fmean(t["kinds"][kind][label]) for t in timed)
            row = {k: v * 1e3 if k != "steps" else v for k, v in row.items()}
            row["outside linears and LM head"] = row["step"] - row["linear layers"] - row["LM head"]
            rows[kind] = row
        result.update(threads=threads, rows=rows,
                      output_tokens_per_s=statistics.median(p["output_tokens_per_s"] for p in plain),
                      scenario_seconds=statistics.median(p["seconds"] for p in plain),
                      page_faults=statistics.median(p["page_faults"] for p in plain))

    thread = threading.Thread(target=run, name="bench-step")
    thread.start()
    thread.join()
    engine.close()
    return result


def table(results: list[dict], args, bandwidth: float) -> str:
    cols = [*COLUMNS, "outside linears and LM head"]
    lines = [(f"### Batch-{args.batch_size} steps of the {args.batch_size}-stream scenario, ms per step "
              f"({datetime.date.today()}, {cpu_model()}, copy {bandwidth / 1e9:.1f} GB/s, torch {torch.__version__}, "
              f"SmolLM2-135M Q4_1, EngineConfig defaults, cpu_matmul {args.cpu_matmul}, kv_cache_dtype "
              f"{args.kv_cache_dtype}, quantization {args.quantization})"), "",
             (f"Command: `python bench/bench_step_batch.py --batch-size {args.batch_size} --threads "
              f"{','.join(map(str, args.threads))} --prompt-len {args.prompt_len} --output-len {args.output_len} "
              f"--repeats {args.repeats} --cpu-matmul {args.cpu_matmul} --kv-cache-dtype {args.kv_cache_dtype}"
              + (f" --quantization {args.quantization}" if args.quantization else "") + "`"), "",
             "| threads | steps | " + " | ".join(cols) + " |", "|---|---|" + "---:|" * len(cols)]
    for res in results:
        for kind, row in res["rows"].items():
            lines.append(f"| {res['threads']} | {kind} x{row['steps']} | "
                         + " | ".join(f"{row[c]:.1f}" for c in cols) + " |")
    lines += ["", "| threads | scenario s | output tok/s (untimed runs) | minor page faults per run |",
              "|---|---:|---:|---:|"]
    lines += [f"| {r['threads']} | {r['scenario_seconds']:.2f} | {r['output_tokens_per_s']:.1f} | {r['page_faults']} |"
              for r in results]
    return "\n".join(lines) + "\n"


def main() -> None:
    keep_freed_memory_for_reuse()  # first thing, as every pdserve process does (kvstore.malloc_tuning)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32, help="concurrent streams (the suite's --streams)")
    parser.add_argument("--threads", type=parse_int_list, default=(1, 2), help="engine thread counts, e.g. 1,2")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="scenario runs per thread count (each: untimed, timed)")
    parser.add_argument("--cpu-matmul", choices=CPU_MATMULS, default=EngineConfig.cpu_matmul,
                        help="EngineConfig.cpu_matmul (the default's unless given)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=EngineConfig.kv_cache_dtype,
                        help="EngineConfig.kv_cache_dtype (the default's unless given)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="EngineConfig.quantization (none unless given: the GGUF's codes kept)")
    parser.add_argument("--out", default="bench/results/step_batch.json")
    args = parser.parse_args()
    if args.batch_size < 1 or args.prompt_len < 1 or args.output_len < 2 or args.repeats < 1:
        parser.error("--batch-size, --prompt-len and --repeats must be >= 1, --output-len >= 2")
    bandwidth = copy_bandwidth(2**28)
    results = [measure(t, args) for t in args.threads]
    text = table(results, args, bandwidth)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "copy_bandwidth": bandwidth, "args": vars(args) | {
        "threads": list(args.threads)}, "results": results}, indent=1))
    out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
