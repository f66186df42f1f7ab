"""Benchmark of prompt logprobs (echo + logprobs, prompt_logprobs): what scoring a prompt costs next to a plain
prefill of it, offline, on the default model.

    python bench/bench_prompt_logprobs.py [--lengths 128 512 1024] [--reps 3] [--threads N]

For each prompt length: the median wall time of LLM.generate(max_tokens=1) without prompt logprobs (the
baseline), with prompt_logprobs=0 (the prompt tokens' own logprobs and ranks) and with prompt_logprobs=5; prefix
caching off, so every run computes the whole prompt. Then the log-softmax chunk size
(engine.prompt_logprobs.CHUNK_POSITIONS) alone: compute_prompt_logprobs over the hidden states of a prompt of the
longest length, with chunks of 32 positions up to all of them, and the float32 logits each chunk holds (the
whole [n, vocab] tensor at the largest). Prints a table and writes JSON to --out (default
bench/results/prompt_logprobs.json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine.prompt_logprobs import CHUNK_POSITIONS, compute_prompt_logprobs  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.bench.roofline import cpu_model  # noqa: E402

TEXT = ("Once upon a time, in a small village by the sea, there lived an old fisherman who went out every morning "
        "before the sun rose, and came back with stories nobody in the village quite believed. ")


def median_s(fn, reps: int) -> float:
    fn()                                                        # warm-up
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "prompt_logprobs.json"))
    args = parser.parse_args()
    llm = LLM(model=args.model, progress=False, enable_prefix_caching=False, num_threads=args.threads,
              kv_cache_memory=512 * 2**20, dtype="float32")
    ids = llm.tokenizer.encode(TEXT * 64)
    vocab = llm.engine.model_config.vocab_size
    rows = []
    for n in args.lengths:
        prompt = ids[:n]
        row = {"prompt_tokens": n}
        for name, prompt_logprobs in (("plain_s", None), ("prompt_logprobs_0_s", 0), ("prompt_logprobs_5_s", 5)):
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs)
            row[name] = median_s(lambda params=params, prompt=prompt: llm.generate([prompt], params), args.reps)
        row["overhead_0"] = row["prompt_logprobs_0_s"] / row["plain_s"] - 1
        row["overhead_5"] = row["prompt_logprobs_5_s"] / row["plain_s"] - 1
        rows.append(row)
        print(f"{n:6d} tokens  plain {row['plain_s'] * 1e3:8.1f} ms  prompt_logprobs=0 "
              f"{row['prompt_logprobs_0_s'] * 1e3:8.1f} ms (+{row['overhead_0']:.0%})  prompt_logprobs=5 "
              f"{row['prompt_logprobs_5_s'] * 1e3:8.1f} ms (+{row['overhead_5']:.0%})")

    model = llm.engine.runner.model
    n = max(args.lengths)
    hidden = torch.randn(n, llm.engine.model_config.hidden_size, generator=torch.Generator().manual_seed(0))
    targets = ids[1:n + 1]
    chunks = []
    for chunk in sorted({32, CHUNK_POSITIONS, n}):
        seconds = median_s(lambda chunk=chunk: compute_prompt_logprobs(model.compute_logits, hidden, targets, 5, chunk),
                           args.reps)
        chunks.append({"chunk_positions": chunk, "seconds": seconds, "logits_mib": chunk * vocab * 4 / 2**20})
        print(f"chunk {chunk:5d} positions: {seconds * 1e3:8.1f} ms for {n} positions, "
              f"{chunk * vocab * 4 / 2**20:7.1f} MiB of logits at once")

    result = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "model": args.model, "vocab": vocab,
              "reps": args.reps, "command": "python " + " ".join([Path(__file__).name, *sys.argv[1:]]),
              "prefill": rows, "chunks": chunks}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"CPU: {result['cpu']}, {result['threads']} threads; written to {args.out}")


if __name__ == "__main__":
    main()
