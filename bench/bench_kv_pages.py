"""The decode attention of a batch over a CPU KV cache on 4 KiB pages against one on transparent huge pages
(kvstore.malloc_tuning.zeros_on_huge_pages, how the engine allocates it on CPU): the same kernel
(kernels.cpu_ops.paged_attention), the same shape as the serving suite's 32-stream scenario mid-decode (30 layers,
3 kv heads of 64, 9 query heads, blocks of 16, each sequence's blocks drawn at random from a 2 GiB cache), the
two caches timed alternately, best of 7 passes over all layers each. --cache-resident reads layer 0's cache for
every layer instead (8.7 MB at the defaults: in L3 after the first), which separates what the kernel's own work
costs from what reading 30 layers' caches from memory adds.

    python bench/bench_kv_pages.py [--threads 2] [--batch 32] [--context 176] [--rounds 2] [--cache-resident]
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels import cpu_ops
from kvstore.malloc_tuning import zeros_on_huge_pages
from pdserve.bench.roofline import cpu_model

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, Q_HEADS = 30, 8192, 16, 3, 64, 9


def time_attention(kv: torch.Tensor, batch: int, context: int, resident: bool = False) -> float:
    """Best seconds of one pass of the decode attention over every layer of `kv` (over layer 0 as often, resident)."""
    kv.normal_()
    blocks = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    tables = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(0))[:batch * blocks]
    tables = tables.view(batch, blocks).int()
    query = torch.randn(batch, Q_HEADS, HEAD_DIM)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for layer in range(LAYERS):
            cache = kv[0 if resident else layer]
            cpu_ops.paged_attention(query, cache[0], cache[1], tables, seq_lens, starts, HEAD_DIM ** -0.5)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=176)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache-resident", action="store_true", help="layer 0's cache for every layer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    print(f"{cpu_model()}, {args.threads} threads: decode attention of {args.batch} sequences x {args.context} "
          f"tokens, {LAYERS} layers{' (layer 0 each time)' if args.cache_resident else ''}, best of 7")
    print("| round | 4 KiB pages (ms) | huge pages (ms) | ratio |\n|---:|---:|---:|---:|")
    for r in range(args.rounds):
        small = time_attention(torch.zeros(shape), args.batch, args.context, args.cache_resident)
        huge = time_attention(zeros_on_huge_pages(shape, torch.float32), args.batch, args.context, args.cache_resident)
        print(f"| {r + 1} | {small * 1e3:.2f} | {huge * 1e3:.2f} | {huge / small:.2f}x |")


if __name__ == "__main__":
    main()
