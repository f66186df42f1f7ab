"""Tensor parallelism: prefill and decode time of the offline engine at TP=1 vs TP=N, same model, same machine.

    python bench/bench_tp.py [--tp 1,2] [--threads 2] [--prompt-tokens 256] [--decode-tokens 32]
                             [--device cpu] [--quantization int8] [--out bench/results/tp.json]

For each degree it builds `LLM(tensor_parallel_size=N)` (N rank processes; on CPU the --threads are divided
among the ranks, at least one each, so every degree uses the same cores), warms up, then measures with prefix
caching off:
    prefill_ms      one prompt of --prompt-tokens tokens through one step (the time to its first token)
    decode_ms       per generated token of a batch-1 sequence: (E2E - TTFT) / (decode_tokens - 1)
and prints them side by side with TP=1, naming the CPU (lscpu) or GPU, then saves JSON.

What the numbers mean: TP splits each matmul over the ranks and adds two all-reduces per layer plus a logits
gather per step. On one CPU socket with the cores divided among the ranks the total compute is the same as TP=1
and the collectives (gloo over loopback TCP) are pure overhead, so TP=2 is expected to be no faster, decode
(small matmuls, 60 latency-bound all-reduces per token for SmolLM2's 30 layers) slower. TP pays on several GPUs
(or sockets), where each rank brings its own memory bandwidth: bench/gpu_tp.sh runs this on a multi-GPU machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {len(os.sched_getaffinity(0))} CPUs available"


def measure(tp: int, args) -> dict:
    threads = max(1, args.threads // tp) if args.device == "cpu" else None
    llm = LLM(model=args.model, progress=False, tensor_parallel_size=tp, num_threads=threads, device=args.device,
              quantization=args.quantization, enable_prefix_caching=False, kv_cache_memory=256 * 2**20,
              max_num_batched_tokens=max(2048, args.prompt_tokens))
    try:
        vocab = llm.engine.model_config.vocab_size
        prompt = [(i * 7919) % (vocab - 1000) + 500 for i in range(args.prompt_tokens)]
        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        decode = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([prompt[:32]], decode)  # warm-up: allocators, OpenMP pools, the gloo connections
        prefill = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.generate([prompt], first)
            prefill.append((time.perf_counter() - start) * 1e3)
        e2e = []
        short = prompt[:16]
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.generate([short], first)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate([short], decode)
            e2e.append(((time.perf_counter() - start) - ttft) * 1e3 / (args.decode_tokens - 1))
    finally:
        llm.engine.close()
    return {"tp": tp, "threads_per_rank": threads, "prefill_ms": min(prefill), "decode_ms_per_token": min(e2e),
            "prefill_ms_all": prefill, "decode_ms_per_token_all": e2e}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", default="1,2", help="degrees, comma-separated (the first is the baseline)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads in all")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the best is reported")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantization", default=None, choices=[None, "int8", "int4"])
    parser.add_argument("--out", default="bench/results/tp.json")
    args = parser.parse_args()

    results = [measure(int(tp), args) for tp in args.tp.split(",")]
    base = results[0]
    print(f"# tensor parallelism, {args.model} ({args.quantization or 'float'}) on {machine(args.device)}")
    print(f"# prompt {args.prompt_tokens} tokens, {args.decode_tokens} decode tokens, best of {args.repeats}")
    print(f"{'TP':>3} {'threads/rank':>12} {'prefill ms':>11} {'x TP=1':>7} {'decode ms/tok':>14} {'x TP=1':>7}")
    for r in results:
        print(f"{r['tp']:>3} {r['threads_per_rank'] or '-':>12} {r['prefill_ms']:>11.1f} "
              f"{base['prefill_ms'] / r['prefill_ms']:>7.2f} {r['decode_ms_per_token']:>14.2f} "
              f"{base['decode_ms_per_token'] / r['decode_ms_per_token']:>7.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now(datetime.UTC).isoformat(),
                               "machine": machine(args.device), "args": vars(args), "results": results}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
