"""The default model's int4 layer matmuls with their weights each on a mapping of its own (4 KiB pages, as torch
allocates them) against the same weights placed back to back on huge-page chunks
(kvstore.malloc_tuning.on_huge_pages, how engine.quant's linears hold them): 30 layers of qkv 960x576, o 576x576,
gate_up 3072x576 and down 576x1536 as the engine's Int4Linear builds them from random weights, run through their
native kernel (--cpu-matmul: int8 activations "native", bfloat16 ones "native-bf16") at each row count, the two
sets timed alternately, best of 7 passes over all layers each.

    python bench/bench_weight_pages.py [--threads 2] [--rows 1,4,32] [--cpu-matmul native] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import torch

import engine.quant as quant
from pdserve.bench.roofline import cpu_model

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def layers(cpu_matmul: str, placed: bool) -> list[quant.Int4Linear]:
    """The 120 linears, their weights placed on huge pages or each left on its own allocation."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * 0.05 for n, k in SHAPES * LAYERS]
    place = quant.on_huge_pages
    try:
        if not placed:
            quant.on_huge_pages = lambda t: t.clone()  # a fresh allocation each, as before the placement
        return [quant.Int4Linear.quantize(w, cpu_matmul=cpu_matmul) for w in weights]
    finally:
        quant.on_huge_pages = place


def time_pass(linears: list[quant.Int4Linear], rows: int, threads: int) -> float:
    """Best seconds of one pass of every linear's native kernel over `rows` rows."""
    xs = [torch.randn(rows, lin.shape[1]) for lin in linears]
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for lin, x in zip(linears, xs):
            lin.native(x, threads)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,32")
    parser.add_argument("--cpu-matmul", choices=("native", "native-bf16"), default="native")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    small, huge = layers(args.cpu_matmul, placed=False), layers(args.cpu_matmul, placed=True)
    if small[0].native is None:
        raise SystemExit("the native kernels are not built here")
    print(f"{cpu_model()}, {args.threads} threads, cpu_matmul {args.cpu_matmul}: the {len(small)} int4 matmuls of "
          f"{LAYERS} layers, best of 7")
    print("| round | rows | 4 KiB pages (ms) | huge pages (ms) | ratio |\n|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):
        for rows in map(int, args.rows.split(",")):
            a, b = time_pass(small, rows, args.threads), time_pass(huge, rows, args.threads)
            print(f"| {r + 1} | {rows} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
