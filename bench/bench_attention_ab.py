"""Two builds of kernels/cpu_ops.c side by side in one process, the working tree's and the one at a git revision:
the decode attention (pd_paged_attention, one new token per sequence), or with --prompt N the prefill attention of
whole N-token prompts, on the default model's shapes (9 query / 3 KV heads, head_dim 64, blocks of 16), timed in
interleaved rounds (median of each), outputs compared bit for bit.

    python bench/bench_attention_ab.py --against 2a0a170 [--threads 2] [--batches 1,32] [--contexts 160,1024]
        [--prompt 128] [--rounds 5] [--out bench/results/attention_ab.md]

Each of --layers (30, the model's) has its own KV cache, each sequence's blocks in a shuffled order as a pool
hands them out, and a pass calls every layer once, as a decode step does: the caches together are larger than the
last-level cache, so the K and V rows come from DRAM as in serving (one layer's cache timed alone would sit in L3);
each cache is allocated as the engine allocates its own (kvstore.malloc_tuning.zeros_on_huge_pages: transparent huge
pages where the kernel gives them; until 2026-12-05 this script timed caches on 4 KiB pages, which read slower).
Each sequence's length is drawn from [context / 2, context] (with --prompt: each is the prompt, --contexts unused).
GB/s: K and V bytes read per second (each position's once).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import cpu_ops, native_build  # noqa: E402
from kvstore.malloc_tuning import zeros_on_huge_pages  # noqa: E402
from pdserve.bench.roofline import cpu_model  # noqa: E402
from pdserve.cli_args import parse_int_list  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def attention_pass(lib, case: dict, threads: int) -> torch.Tensor:
    """Every layer's attention once; the last layer's output."""
    q, seq_lens, starts, out = case["q"], case["seq_lens"], case["starts"], case["out"]
    for k, v, tables in case["layers"]:
        rc = lib.pd_paged_attention(
            q.data_ptr(), q.stride(0), q.stride(1), q.shape[0], seq_lens.shape[0], HEADS, HEAD_DIM, k.data_ptr(),
            v.data_ptr(), k.dtype is torch.bfloat16, k.shape[0], BLOCK, KV_HEADS, tables.data_ptr(), tables.shape[1],
            tables.shape[1], seq_lens.data_ptr(), starts.data_ptr(), HEAD_DIM ** -0.5, 0, 0.0, out.data_ptr(),
            threads)
        if rc:
            raise RuntimeError(f"pd_paged_attention returned {rc}")
    return out.clone()


def make_case(batch: int, context: int, layers: int, dtype: torch.dtype, g: torch.Generator,
              prompt: int | None = None) -> dict:
    """Decode: one new token per sequence at a length drawn from [context / 2, context]; prompt: whole prompts of
    that many tokens, all new."""
    context = prompt or context
    per_seq = (context + BLOCK - 1) // BLOCK
    num_blocks = batch * per_seq
    caches = []
    for _ in range(layers):
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        k, v = (zeros_on_huge_pages(shape, dtype).copy_(torch.randn(shape, generator=g)) for _ in range(2))
        tables = torch.randperm(num_blocks, generator=g).int().view(batch, per_seq)
        caches.append((k, v, tables))
    if prompt:
        seq_lens = torch.full((batch,), prompt, dtype=torch.int32)
        starts = torch.arange(0, batch * prompt + 1, prompt, dtype=torch.int32)
    else:
        seq_lens = torch.randint(max(1, context // 2), context + 1, (batch,), dtype=torch.int32, generator=g)
        starts = torch.arange(batch + 1, dtype=torch.int32)
    rows = int(starts[-1])
    return {"layers": caches, "q": torch.randn(rows, HEADS, HEAD_DIM, generator=g), "seq_lens": seq_lens,
            "starts": starts, "out": torch.empty(rows, HEADS, HEAD_DIM),
            "bytes": 2 * layers * int(seq_lens.sum()) * KV_HEADS * HEAD_DIM * (4 if dtype is torch.float32 else 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", required=True, help="git revision of the other build")
    parser.add_argument("--threads", type=parse_int_list, default=[1, 2])
    parser.add_argument("--batches", type=parse_int_list, default=[1, 32])
    parser.add_argument("--contexts", type=parse_int_list, default=[160, 1024])
    parser.add_argument("--prompt", type=int, default=None, help="prefill whole prompts of this many tokens")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/attention_ab.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        old_path = native_build.source_at_revision(cpu_ops.SOURCE, args.against, Path(tmp))
        libs = {args.against: cpu_ops.load_library(old_path), "working tree": cpu_ops.load_library(cpu_ops.SOURCE)}
    if None in libs.values():
        raise SystemExit("a build failed (see the warning above)")
    a_name, b_name = libs
    kind = f"Prefill attention of {args.prompt}-token prompts" if args.prompt else "Decode attention"
    lines = [f"### {kind}, {a_name} against the working tree ({datetime.date.today()}, {cpu_model()}, "
             f"{args.layers} layers' caches)", "",
             f"Command: `python bench/bench_attention_ab.py --against {args.against} --threads "
             f"{','.join(map(str, args.threads))} --batches {','.join(map(str, args.batches))} --contexts "
             f"{','.join(map(str, args.contexts))}{f' --prompt {args.prompt}' if args.prompt else ''} "
             f"--rounds {args.rounds}`", "",
             f"| cache | batch | context <= | threads | {a_name} ms / step | working tree ms / step | ratio | GB/s "
             "| same bits |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    print("\n".join(lines), flush=True)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for batch in args.batches:
            for context in [None] if args.prompt else args.contexts:
                case = make_case(batch, context, args.layers, dtype, g, args.prompt)
                for threads in args.threads:
                    times = {name: [] for name in libs}
                    outs = {name: attention_pass(lib, case, threads) for name, lib in libs.items()}  # warm-up
                    for _ in range(args.rounds):
                        for name, lib in libs.items():
                            start = time.perf_counter()
                            attention_pass(lib, case, threads)
                            times[name].append(time.perf_counter() - start)
                    a, b = (statistics.median(times[name]) for name in libs)
                    same = torch.equal(outs[a_name], outs[b_name])
                    line = (f"| {str(dtype).removeprefix('torch.')} | {batch} | {args.prompt or context} | {threads} "
                            f"| {a * 1e3:.2f} "
                            f"| {b * 1e3:.2f} | {b / a:.2f}x | {case['bytes'] / a / 1e9:.1f} -> "
                            f"{case['bytes'] / b / 1e9:.1f} | {'yes' if same else 'NO'} |")
                    print(line, flush=True)
                    lines.append(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
