"""The native CPU small ops (kernels/cpu_ops.c) against the torch reference, one call at a time, on the default
model's decode shapes (hidden 576, 9 query / 3 KV heads, head_dim 64, intermediate 1536, block size 16, vocabulary
49152: the LM head's 16 candidates a row, top_k_indices).

    python bench/bench_cpu_ops.py [--threads 1,2] [--batches 1,32] [--contexts 128,1024,4096] [--repeats 5]
        [--out bench/results/cpu_ops.json]

Per op and shape: the best of --repeats timings of a loop of calls (microseconds per call, wall time), native and
torch interleaved in one process, and their ratio. Attention runs every batch x context pair over a float32 and
a bfloat16 cache (each sequence's blocks in a shuffled order, as a pool hands them out); the other ops depend on
the batch only. The machine's load disturbs the figures: compare the ratio, rerun on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from engine.rope import rope_cos_sin_cache
from kernels import cpu_ops
from kernels import reference as ref
from pdserve.bench.roofline import cpu_model
from pdserve.cli_args import parse_int_list

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK, VOCAB = 576, 9, 3, 64, 1536, 16, 49152


def best_us(fn, repeats: int, budget_s: float = 0.05) -> float:
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(budget_s / max(time.perf_counter() - start, 1e-7)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def small_ops(batch: int) -> dict[str, tuple]:
    """(native call, torch call) per op at `batch` tokens, on views as engine.model passes them."""
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q = qkv[:, :HEADS * HEAD_DIM].view(batch, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(batch, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(batch, KV_HEADS, HEAD_DIM)
    x, residual, weight = torch.randn(batch, HIDDEN), torch.randn(batch, HIDDEN), torch.rand(HIDDEN)
    cache = rope_cos_sin_cache(HEAD_DIM, 8192, 100000.0, None)
    positions = torch.randint(0, 8192, (batch,))
    kv = torch.zeros(2, batch * 4, BLOCK, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(batch * 4 * BLOCK)[:batch]
    gate_up = torch.randn(batch, 2 * INTERMEDIATE)
    logits = torch.randn(batch, VOCAB) * 5
    return {
        "rms_norm + residual": (lambda: cpu_ops.rms_norm(x, weight, 1e-5, residual),
                                lambda: ref.rms_norm_ref(x, weight, 1e-5, residual)),
        "rotary_embedding": (lambda: cpu_ops.rotary_embedding(positions, q, k, cache),
                             lambda: ref.rotary_embedding_ref(positions, q, k, cache)),
        "write_kv": (lambda: cpu_ops.write_kv(k, v, kv[0], kv[1], slots),
                     lambda: ref.write_kv_ref(k, v, kv[0], kv[1], slots)),
        "silu_mul": (lambda: cpu_ops.silu_mul(gate_up), lambda: ref.silu_mul_ref(gate_up)),
        "top_k_indices (k 16)": (lambda: cpu_ops.top_k_indices(logits, 16), lambda: ref.top_k_indices_ref(logits, 16)),
    }


def attention(batch: int, context: int, dtype: torch.dtype) -> tuple:
    per_seq = -(-context // BLOCK)
    kv = torch.randn(2, batch * per_seq, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    tables = torch.randperm(batch * per_seq).to(torch.int32).view(batch, per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM)[:, :HEADS * HEAD_DIM].view(batch, HEADS, HEAD_DIM)
    args = (query, kv[0], kv[1], tables, seq_lens, qsl, HEAD_DIM ** -0.5)
    return (lambda: cpu_ops.paged_attention(*args)), (lambda: ref.paged_attention_ref(*args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=parse_int_list, default=(1, 2))
    parser.add_argument("--batches", type=parse_int_list, default=(1, 32))
    parser.add_argument("--contexts", type=parse_int_list, default=(128, 1024, 4096))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results/cpu_ops.json")
    args = parser.parse_args()
    if not cpu_ops.available():
        parser.error("the native CPU ops cannot be built here (see the warning above)")
    rows = []
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.batches:
                cases = [(name, "", calls) for name, calls in small_ops(batch).items()]
                cases += [("paged_attention", f"{context} {str(dtype).removeprefix('torch.')}",
                           attention(batch, context, dtype))
                          for context in args.contexts for dtype in (torch.float32, torch.bfloat16)]
                for name, shape, (native, torch_ref) in cases:
                    native_us, torch_us = best_us(native, args.repeats), best_us(torch_ref, args.repeats)
                    rows.append({"op": name, "threads": threads, "batch": batch, "context": shape,
                                 "native_us": native_us, "torch_us": torch_us})
                    print(f"{name:20s} threads {threads} batch {batch:3d} {shape:14s} native {native_us:10.1f} us "
                          f"torch {torch_us:10.1f} us  ({torch_us / native_us:.1f}x)", flush=True)
    lines = [(f"CPU ops, microseconds per call ({cpu_model()}, torch {torch.__version__}, load average "
              f"{os.getloadavg()[0]:.1f})"), "", "| op | threads | batch | context, cache | native | torch | speed-up |",
             "|---|---:|---:|---|---:|---:|---:|"]
    lines += [f"| {r['op']} | {r['threads']} | {r['batch']} | {r['context'] or '-'} | {r['native_us']:.1f} "
              f"| {r['torch_us']:.1f} | {r['torch_us'] / r['native_us']:.1f}x |" for r in rows]
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu_model(), "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
