"""Prefill with the last layer run for the sampled rows alone (AttentionMetadata.keep_rows, what the engine does)
against every row through it (engine.step_batch._kept_rows patched to keep none), on one engine of the suite's
`pdserve-engine-native` configuration (EngineConfig(default model, num_threads, kv_cache_memory=1 GiB,
cpu_matmul="native")): --prompts prompts of --prompt-len random tokens, one new token each, all due at once, so that
the scenario is its prefill steps. The two ways alternate, --rounds rounds each; the table has each round's
seconds and the medians' ratio.

    python bench/bench_last_layer_rows.py [--threads 2] [--prompts 32] [--prompt-len 128] [--rounds 6]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

from engine import step_batch
from engine.config import EngineConfig
from engine.engine_loop import build_engine, use_engine_threads
from engine.model_fetch import fetch_default_model
from engine.sampling_params import SamplingParams
from kvstore.malloc_tuning import keep_freed_memory_for_reuse
from pdserve.bench.roofline import cpu_model


def prefill_seconds(engine, prompts: int, prompt_len: int, seed: int) -> float:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(prompts):
        engine.add_request(f"{seed}-{i}", [rng.randrange(100, engine.model_config.vocab_size)
                                           for _ in range(prompt_len)], params)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    keep_freed_memory_for_reuse()
    engine = build_engine(EngineConfig(model=str(fetch_default_model()), num_threads=args.threads,
                                       kv_cache_memory=2**30, cpu_matmul="native"), progress=False)
    kept_rows = step_batch._kept_rows
    times: dict[str, list[float]] = {"sampled rows": [], "every row": []}

    def run() -> None:  # on a thread of its own, as a worker's loop steps its engine
        use_engine_threads(engine)
        prefill_seconds(engine, args.prompts, args.prompt_len, seed=-1)  # warm-up
        for r in range(args.rounds):
            for way in times:
                step_batch._kept_rows = kept_rows if way == "sampled rows" else lambda batch, sampled, device: None
                try:
                    times[way].append(prefill_seconds(engine, args.prompts, args.prompt_len, seed=2 * r + len(way)))
                finally:
                    step_batch._kept_rows = kept_rows

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    print(f"{cpu_model()}, {args.threads} threads: prefill of {args.prompts} prompts of {args.prompt_len} tokens, "
          "seconds\n")
    print("| round | last layer: sampled rows | every row |\n|---:|---:|---:|")
    for r, (a, b) in enumerate(zip(*times.values())):
        print(f"| {r + 1} | {a:.3f} | {b:.3f} |")
    kept, every = (statistics.median(v) for v in times.values())
    print(f"| median | {kept:.3f} | {every:.3f} |\n\nsampled rows / every row: {kept / every:.2f}x")


if __name__ == "__main__":
    main()
