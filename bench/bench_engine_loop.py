"""Batch-1 decode through an `EngineLoop` (the workers' path), engine built on the main thread vs on a short-lived
thread (`engine.engine_loop.build_engine`, what the workers do), each in its own process, alternating.

    python bench/bench_engine_loop.py [--threads 2] [--rounds 2]

Prints ms per output token (median of 4 requests of 128 prompt tokens, 64 new tokens) for each build. Why the
build thread matters: the module docstring of engine/engine_loop.py.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def measure(build: str, threads: int) -> float:
    from engine.config import EngineConfig
    from engine.engine_loop import EngineLoop, build_engine
    from engine.llm_engine import LLMEngine
    from engine.model_fetch import resolve_model_path
    from engine.sampling_params import SamplingParams

    config = EngineConfig(model=str(resolve_model_path("default")), num_threads=threads,
                          kv_cache_memory=512 * 2**20)
    engine = build_engine(config, progress=False) if build == "thread" else LLMEngine(config, progress=False)
    loop = EngineLoop(engine).start()
    ids = list(range(1000, 1128))
    per_token = []
    for i in range(4):
        rid = f"r{i}"
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        stream = loop.open_stream(rid, lambda e: e.add_request(rid, ids[i:] + ids[:i], params))
        times = [time.perf_counter() for _ in stream]
        per_token.append((times[-1] - times[0]) / (len(times) - 1) * 1000)
    loop.stop()
    return statistics.median(per_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--build", choices=("main", "thread"), help=argparse.SUPPRESS)  # one measurement
    args = parser.parse_args()
    if args.build:
        print(f"{measure(args.build, args.threads):.1f}")
        return
    print(f"batch-1 decode through EngineLoop, {args.threads} threads, ms per token")
    for _ in range(args.rounds):
        for build in ("main", "thread"):
            out = subprocess.run([sys.executable, __file__, "--build", build, "--threads", str(args.threads)],
                                 check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            where = "the main thread" if build == "main" else "a short-lived thread (build_engine)"
            print(f"  engine built on {where}: {out}")


if __name__ == "__main__":
    main()
