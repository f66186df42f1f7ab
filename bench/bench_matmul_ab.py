"""Two builds of kernels/cpu_matmul.c side by side in one process: the working tree's and the one at a git
revision, on the default model's int4 layer shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536;
random codes in int4pack's 64-row layout, or 32-row with --block-rows 32: torch's AVX2 packing; with --int8-layers
int8 weights with a scale per output row, the `quantization="int8"` mode's) and its 49152x576 int8 LM head,
q4-bf16 / q8-bf16 (or, with --int8-activations, q4 / q8: `--cpu-matmul native`'s kinds) at each build's best ISA,
timed in interleaved rounds (best of each); prints the table. --layers N holds N copies of the layer's
weights and a pass runs them all, as a step runs the model's 30 layers: the codes come from memory, not from a
cache one layer fits in (what a step's first read of each weight costs is then in the figures).

    python bench/bench_matmul_ab.py --against a9db6a8 --threads 2 --rows 1,32,512,2048 --head-rows 1,8,32 [--layers 30]
                                    [--block-rows 32] [--int8-activations] [--int8-layers]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import cpu_matmul, native_build  # noqa: E402

LAYERS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def load(source: Path):
    lib = native_build.load(source, "matmul")
    if lib is None:
        raise SystemExit(f"could not build {source}")
    lib.pd_matmul.restype = ctypes.c_int
    lib.pd_matmul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.pd_bf16_best_isa.restype = ctypes.c_int
    lib.pd_best_isa.restype = ctypes.c_int
    return lib


def interleaved(libs: dict, calls: list, rows: int, threads: int, repeats: int, rounds: int = 7) -> dict:
    """Best seconds per pass over `calls` ((weight struct, x, y) triples) for each build, rounds interleaved."""
    best = {name: float("inf") for name in libs}
    for _ in range(rounds):
        for name, lib in libs.items():
            start = time.perf_counter()
            for _ in range(repeats):
                for w, x, y in calls:
                    lib.pd_matmul(ctypes.addressof(w), x.data_ptr(), rows, y.data_ptr(), threads)
            best[name] = min(best[name], (time.perf_counter() - start) / repeats)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", required=True, help="git revision of the other build")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,32,512,2048", help="rows of x of the layer pass")
    parser.add_argument("--head-rows", default="1,8,32", help="rows of x of the LM head")
    parser.add_argument("--layers", type=int, default=1, help="copies of the layer's weights a pass runs")
    parser.add_argument("--block-rows", type=int, choices=(32, 64), default=64, help="int4pack's block of rows")
    parser.add_argument("--int8-activations", action="store_true", help="the int8-activation kinds (q4, q8)")
    parser.add_argument("--int8-layers", action="store_true", help="the layers' weights int8 (the int8 mode's)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        old_path = native_build.source_at_revision(cpu_matmul.SOURCE, args.against, Path(tmp))
        libs = {args.against: load(old_path), "working tree": load(cpu_matmul.SOURCE)}
    names = list(libs)
    g = torch.Generator().manual_seed(0)
    q4_kind, q8_kind = (0, 1) if args.int8_activations else (2, 3)  # struct pd_weight's kinds
    keep = []  # the tensors the weight structs point into
    layers = []
    for n, k in LAYERS * args.layers:
        if args.int8_layers:
            codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
            table = torch.rand(n, generator=g) / 64
            weight = cpu_matmul._Weight(codes.data_ptr(), table.data_ptr(), k, n, q8_kind, -1, 0, 1)
        else:
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
            table = (torch.randn(k // 32, n, 2, generator=g) * 0.01).bfloat16()
            weight = cpu_matmul._Weight(codes.data_ptr(), table.data_ptr(), k, n, q4_kind, -1, args.block_rows, 1)
        keep += [codes, table]
        layers.append((weight, k, n))
    qweight = torch.randint(-127, 128, HEAD, dtype=torch.int8, generator=g)
    scale = torch.rand(HEAD[0], generator=g) / 64
    head = cpu_matmul._Weight(qweight.data_ptr(), scale.data_ptr(), HEAD[1], HEAD[0], q8_kind, -1, 0, 1)
    isas = ", ".join(f"{n} {(lib.pd_best_isa if args.int8_activations else lib.pd_bf16_best_isa)()}"
                     for n, lib in libs.items())
    print(f"threads {args.threads}; layers {args.layers} ({'int8' if args.int8_layers else '4-bit'}); block rows "
          f"{args.block_rows}; {'int8' if args.int8_activations else 'bfloat16'} activations, ISA {isas}")
    print(f"| matmuls | rows | {names[0]} ms | {names[1]} ms | ratio | GFLOP/s |")
    print("|---|---:|---:|---:|---:|---|")
    for rows in map(int, args.rows.split(",")):
        calls = [(w, torch.randn(rows, k, generator=g), torch.empty(rows, n)) for w, k, n in layers]
        flops = sum(2 * rows * n * k for _, k, n in layers)
        best = interleaved(libs, calls, rows, args.threads, 200 if rows == 1 else max(3, int(5e9 / flops)))
        a, b = (best[n] for n in names)
        print(f"| {args.layers} x (qkv + o + gate_up + down) | {rows} | {a * 1e3:.3f} | {b * 1e3:.3f} | {b / a:.2f}x | "
              f"{flops / a / 1e9:.0f} -> {flops / b / 1e9:.0f} |")
    for rows in map(int, args.head_rows.split(",")):
        calls = [(head, torch.randn(rows, HEAD[1], generator=g), torch.empty(rows, HEAD[0]))]
        best = interleaved(libs, calls, rows, args.threads, 10)
        a, b = (best[n] for n in names)
        print(f"| LM head 49152x576 | {rows} | {a * 1e3:.3f} | {b * 1e3:.3f} | {b / a:.2f}x | |")
    del keep
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
