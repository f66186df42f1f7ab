"""Kernel micro-benchmarks on one CUDA device, each next to a torch peer and the device's own ceilings.

Measures (bf16, CUDA events, warmup, L2 flushed before every timed call so bytes come from HBM):
  decode attention   achieved GB/s = bytes actually read (K/V of every token, q, block tables) / kernel time,
                     at 1k/8k/32k context x batch 1/32/128, SmolLM2-135M-like (9q/3kv x 64) and Llama-3-8B-like
                     (32q/8kv x 128); peer: F.scaled_dot_product_attention on contiguous K/V.
  prefill attention  TFLOP/s of causal attention (4 * B * Hq * D * S(S+1)/2 flops); peer: SDPA is_causal.
  block gather/scatter (plain and fused int8) GB/s = bytes read + written; peer: the torch reference.
  ceilings           device copy bandwidth (a large tensor copy, read + write) and bf16 matmul TFLOP/s, used for
                     the "% of copy" / "% of matmul" ratio columns.
Writes one markdown report to $OUT/kernels.md when OUT is set, else bench/results/kernels.md. Without CUDA it says
so and exits 0. `--smoke` runs tiny shapes on CPU through the torch reference to check this script itself.

`--cpu-matmuls` instead measures, on CPU, the batch-1 matmuls engine.quant runs (issues 15 and 16): every linear of
SmolLM2-135M's 30 layers (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) in one pass, and the 49152x576 LM
head, as float32 (F.linear), int8 (Int8Linear: int8pack_mm) and int4 (Int4Linear: int4pack_mm), and, where
kernels.cpu_matmul builds, int8 and int4 on the native kernels (cpu_matmul="native": int8 activations; "native-bf16":
bfloat16 activations); every kind over the same weights, timed in interleaved rounds; `--rows 1,32,512` repeats the
layer pass and the LM head (`logits` with its top-k recompute where the kind has one) at those rows of x, `--kinds`
keeps the kinds whose label contains a string; each at GB/s = weight bytes read / time and as a % of a large tensor
copy (read + write bytes, pdserve.bench.roofline.copy_bandwidth) and of a read-only sweep (a float32 sum), and at
GFLOP/s (2 M N K) as a % of the float32 FMA peak on the same threads (bench/fma_peak.c; the compute ceiling of the
M = 32 rows; for the kinds on kernels.cpu_matmul's avx512-bf16 level also of vdpbf16ps's peak, their ceiling); the LM
head rotates over copies whose bytes exceed the last-level cache; the native kinds' layer pass is timed twice, called
one by one from Python (the engine's layer loop) and as one C call over the 120 matmuls (kernels.cpu_matmul.MatmulChain:
what the native decoder pays). Writes bench/results/cpu_matmuls.md and .json (or under $OUT).
`--cpu-attention` instead times the CPU prefill attention of one whole prompt of 128, 512 and 2048 tokens:
the native kernel the engine runs (kernels/cpu_ops.c: causal, one fixed order per row), kernels.reference's
explicit mask and SDPA's causal mask (not used: it would make a continued prompt's rows differ from the cold
prompt's), against the FMA peak, and each path's cold rows against its continued ones; writes cpu_attention.md and
.json the same way.
Benchmarks measure and report; they never pass or fail on speed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from kernels import reference as ref  # noqa: E402

MODELS = {"SmolLM2-135M (9q/3kv x 64)": (9, 3, 64), "Llama-3-8B (32q/8kv x 128)": (32, 8, 128)}
LAYOUTS = {"SmolLM2-135M (30 L, 3kv x 64)": (30, 3, 64), "Llama-3-8B (32 L, 8kv x 128)": (32, 8, 128)}
BLOCK_SIZE = 16


class Bench:
    """Times a callable: median of per-call times, each call preceded by an L2 flush (CUDA)."""

    def __init__(self, device: torch.device, budget_s: float, target_ms: float):
        self.device = device
        self.deadline = time.monotonic() + budget_s
        self.target_ms = target_ms
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def _once(self, fn) -> float:
        if self.device.type != "cuda":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        self.flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def ms(self, fn, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        first = self._once(fn)
        iters = int(min(50, max(3, self.target_ms / max(first, 1e-3))))
        return statistics.median([first] + [self._once(fn) for _ in range(iters - 1)])


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _sdpa(q, k, v, **kw):
    """SDPA with native GQA when this torch has it (no K/V copy); else K/V repeated once, outside the timing."""
    try:
        F.scaled_dot_product_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], enable_gqa=True)
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    except TypeError:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: F.scaled_dot_product_attention(q, k, v, **kw)


# ------------------------------------------------------------------------------------------------ ceilings
def measure_ceilings(bench: Bench, dtype: torch.dtype, smoke: bool) -> tuple[float, float]:
    numel = (1 << 20) if smoke else (1 << 30)  # 2 GiB of bf16 on GPU
    x = torch.empty(numel, dtype=dtype, device=bench.device).normal_()
    y = torch.empty_like(x)
    copy_gbs = 2 * x.numel() * x.element_size() / (bench.ms(lambda: y.copy_(x)) * 1e6)
    del x, y
    n = 256 if smoke else 8192
    a = torch.randn(n, n, dtype=dtype, device=bench.device)
    b = torch.randn(n, n, dtype=dtype, device=bench.device)
    matmul_tflops = 2 * n ** 3 / (bench.ms(lambda: a @ b) * 1e9)
    return copy_gbs, matmul_tflops


# ------------------------------------------------------------------------------------------------ decode
def bench_decode(bench: Bench, dtype, contexts, batches, copy_gbs) -> list[list[str]]:
    rows = []
    elt = torch.tensor([], dtype=dtype).element_size()
    for model, (num_heads, num_kv_heads, head_dim) in MODELS.items():
        for ctx in contexts:
            for batch in batches:
                if bench.time_left() < 0:
                    rows.append([model, str(ctx), str(batch), "skipped: time budget spent"] + [""] * 5)
                    continue
                dev = bench.device
                scale = head_dim ** -0.5
                num_blocks = batch * ctx // BLOCK_SIZE
                # kv: [2, num_blocks, block_size, Hkv, D]; blocks of a sequence scattered over the pool
                kv = torch.empty(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, device=dev).normal_()
                block_tables = torch.randperm(num_blocks, device=dev).view(batch, -1).to(torch.int32)
                seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
                qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
                q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=dev)
                kv_bytes = 2 * batch * ctx * num_kv_heads * head_dim * elt
                read_bytes = kv_bytes + q.numel() * elt + block_tables.numel() * 4
                t_paged = bench.ms(lambda: kernels.paged_attention(q, kv[0], kv[1], block_tables, seq_lens, qsl, scale,
                                                                   max_query_len=1, max_seq_len=ctx))
                splits = "-"
                if dev.type == "cuda":
                    from kernels.triton_decode_attention import _default_num_splits
                    splits = str(_default_num_splits(batch, num_kv_heads, ctx, dev))
                del kv, block_tables
                # peer: q [B, Hq, 1, D] against contiguous K/V [B, Hkv, ctx, D]
                k = torch.empty(batch, num_kv_heads, ctx, head_dim, dtype=dtype, device=dev).normal_()
                v = torch.empty_like(k).normal_()
                t_sdpa = bench.ms(_sdpa(q[:, :, None, :], k, v, scale=scale))
                del k, v
                gbs_paged = read_bytes / (t_paged * 1e6)
                gbs_sdpa = read_bytes / (t_sdpa * 1e6)
                rows.append([model, str(ctx), str(batch), splits, _fmt(t_paged * 1e3), _fmt(gbs_paged),
                             _fmt(100 * gbs_paged / copy_gbs), _fmt(t_sdpa * 1e3), _fmt(gbs_sdpa)])
                print("decode", rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ prefill
def bench_prefill(bench: Bench, dtype, shapes, matmul_tflops) -> list[list[str]]:
    rows = []
    for model, (num_heads, num_kv_heads, head_dim) in MODELS.items():
        for batch, seq in shapes:
            if bench.time_left() < 0:
                rows.append([model, str(batch), str(seq), "skipped: time budget spent"] + [""] * 4)
                continue
            dev = bench.device
            scale = head_dim ** -0.5
            num_blocks = batch * seq // BLOCK_SIZE
            kv = torch.empty(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, device=dev).normal_()
            block_tables = torch.randperm(num_blocks, device=dev).view(batch, -1).to(torch.int32)
            seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=dev)
            qsl = torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device=dev)
            q = torch.randn(batch * seq, num_heads, head_dim, dtype=dtype, device=dev)
            flops = 4 * batch * num_heads * head_dim * seq * (seq + 1) / 2
            t_paged = bench.ms(lambda: kernels.paged_attention(q, kv[0], kv[1], block_tables, seq_lens, qsl, scale,
                                                               max_query_len=seq, max_seq_len=seq))
            del kv
            q4 = q.view(batch, seq, num_heads, head_dim).transpose(1, 2).contiguous()  # [B, Hq, S, D]
            k = torch.randn(batch, num_kv_heads, seq, head_dim, dtype=dtype, device=dev)
            v = torch.randn_like(k)
            t_sdpa = bench.ms(_sdpa(q4, k, v, is_causal=True, scale=scale))
            del q4, k, v
            tf_paged, tf_sdpa = flops / (t_paged * 1e9), flops / (t_sdpa * 1e9)
            rows.append([model, str(batch), str(seq), _fmt(t_paged, 3), _fmt(tf_paged),
                         _fmt(100 * tf_paged / matmul_tflops), _fmt(t_sdpa, 3), _fmt(tf_sdpa)])
            print("prefill", rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ blocks
def bench_blocks(bench: Bench, dtype, num_blocks_moved: int, copy_gbs: float) -> list[list[str]]:
    rows = []
    for layout, (num_layers, num_kv_heads, head_dim) in LAYOUTS.items():
        if bench.time_left() < 0:
            rows.append([layout, "skipped: time budget spent"] + [""] * 5)
            continue
        dev = bench.device
        pool = 2 * num_blocks_moved
        # kv_cache: [L, 2, pool, block_size, Hkv, D]
        kv_cache = torch.empty(num_layers, 2, pool, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype,
                               device=dev).normal_()
        block_ids = torch.randperm(pool, device=dev)[:num_blocks_moved]
        staging = kernels.gather_blocks(kv_cache, block_ids)
        data, scales = kernels.gather_blocks_int8(kv_cache, block_ids)
        nbytes = staging.numel() * staging.element_size()
        int8_bytes = data.numel() + scales.numel() * 4
        cases = [
            ("gather", 2 * nbytes, lambda: kernels.gather_blocks(kv_cache, block_ids),
             lambda: ref.gather_blocks_ref(kv_cache, block_ids)),
            ("scatter", 2 * nbytes, lambda: kernels.scatter_blocks(staging, kv_cache, block_ids),
             lambda: ref.scatter_blocks_ref(staging, kv_cache, block_ids)),
            ("gather+int8", nbytes + int8_bytes, lambda: kernels.gather_blocks_int8(kv_cache, block_ids),
             lambda: ref.gather_blocks_int8_ref(kv_cache, block_ids)),
            ("int8+scatter", nbytes + int8_bytes,
             lambda: kernels.scatter_blocks_int8(data, scales, kv_cache, block_ids),
             lambda: ref.scatter_blocks_int8_ref(data, scales, kv_cache, block_ids)),
        ]
        for op, moved, fn, peer in cases:
            t, t_ref = bench.ms(fn), bench.ms(peer)
            gbs = moved / (t * 1e6)
            rows.append([layout, op, str(num_blocks_moved), _fmt(nbytes / 2**20), _fmt(t * 1e3), _fmt(gbs),
                         _fmt(100 * gbs / copy_gbs), _fmt(moved / (t_ref * 1e6))])
            print("blocks", rows[-1], flush=True)
        del kv_cache, staging, data, scales
    return rows


# ------------------------------------------------------------------------------------------------ CPU matmuls
SMOLLM2_LINEARS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SMOLLM2_LAYERS, SMOLLM2_HEAD = 30, (49152, 576)


def _cpu_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _all_layers(layers: list, xs: dict) -> None:
    for layer in layers:
        for lin in layer:
            lin.forward(xs[lin_in(lin)])


def _rotating(copies: list, call: str, x: torch.Tensor):
    state = {"i": 0}

    def next_copy() -> None:
        state["i"] = (state["i"] + 1) % len(copies)
        getattr(copies[state["i"]], call)(x)

    return next_copy


def _interleaved(fns: dict, repeats: int) -> dict[str, list[float]]:
    """ms of each call, one warm-up and then `repeats` rounds calling every fn once per round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def _row(name: str, m: int, nbytes: int, times: list[float], weights: int) -> dict:
    best = min(times)
    return {"matmuls": name, "m": m, "weight_mib": nbytes / 2**20, "ms": statistics.median(times), "best_ms": best,
            "gbs": nbytes / (best * 1e6), "gflops": 2 * m * weights / (best * 1e6)}


def fma_peak_gflops(threads: int, which: str = "fma") -> float | None:
    """GFLOP/s of float32 FMAs on `threads` threads (bench/fma_peak.c: 12 chains a thread, best of 5), the ceiling
    of the M >= 32 rows; "bf16": vdpbf16ps's, "vnni": vpdpbusd's (GOP/s); None without them or a C compiler."""
    import ctypes

    from kernels import native_build

    lib = native_build.load(Path(__file__).with_name("fma_peak.c"), "FMA peak")
    if lib is None:
        return None
    fn = getattr(lib, {"fma": "pd_fma_peak_gflops", "bf16": "pd_bf16_dot_peak_gflops",
                       "vnni": "pd_vnni_dot_peak_gops"}[which])
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    sink = (ctypes.c_float * threads)()
    return fn(20_000_000, 5, threads, sink) or None


def bench_cpu_matmuls(repeats: int, batch_rows: tuple[int, ...] = (1,), only: tuple[str, ...] = ()) -> dict:
    """Float32 / int8 / int4 linears of SmolLM2-135M on CPU (torch's kernels and the native ones,
    kernels.cpu_matmul), GB/s against copy and read bandwidth, at each number of rows of x in `batch_rows`;
    `only`: the kinds whose label contains one of these strings (all when empty)."""
    import functools

    from engine import quant
    from kernels import cpu_matmul
    from pdserve.bench.roofline import copy_bandwidth, cpu_model

    copy_gbs = copy_bandwidth(2**28) / 1e9
    fma_peak, dot_peak, vnni_peak = (fma_peak_gflops(torch.get_num_threads(), w) for w in ("fma", "bf16", "vnni"))
    big = torch.ones(2**28 // 4)
    read_gbs = big.numel() * 4 / (_cpu_ms(big.sum, repeats) * 1e6)
    g = torch.Generator().manual_seed(0)
    kinds = {"float32 (F.linear)": quant.FloatLinear, "int8 (int8pack_mm)": quant.Int8Linear.quantize,
             "int4 (int4pack_mm)": quant.Int4Linear.quantize}
    if cpu_matmul.available():
        for choice, kind in (("native", ""), ("native-bf16", "-bf16")):
            isa = cpu_matmul.isa_name("q4" + kind, cpu_matmul.best_isa("q4" + kind))
            kinds[f"int8 ({choice}, {isa})"] = functools.partial(quant.Int8Linear.quantize, cpu_matmul=choice)
            kinds[f"int4 ({choice}, {isa})"] = functools.partial(quant.Int4Linear.quantize, cpu_matmul=choice)
    kinds = {kind: make for kind, make in kinds.items() if not only or any(o in kind for o in only)}
    rows = []
    with torch.inference_mode():
        # Every kind over the same weights, timed in interleaved rounds (a loaded machine drifts between kinds):
        # the median and the best pass of each; GB/s from the best.
        weights = [[torch.randn(shape, generator=g) * 0.02 for shape in SMOLLM2_LINEARS.values()]
                   for _ in range(SMOLLM2_LAYERS)]
        layers = {kind: [[make(w) for w in layer] for layer in weights] for kind, make in kinds.items()}
        for m in batch_rows:
            xs = {k: torch.randn(m, k, generator=g) for k in {shape[1] for shape in SMOLLM2_LINEARS.values()}}
            passes = {kind: functools.partial(_all_layers, ls, xs) for kind, ls in layers.items()}
            # The native kinds once more as one C call over the 120 matmuls (the native decoder's view: no Python
            # between them); the native decoder uses the same kernels with up to native_max_rows rows.
            chains = {f"{kind}, one C call": cpu_matmul.MatmulChain([(lin.native, xs[lin_in(lin)])
                                                                     for layer in ls for lin in layer])
                      for kind, ls in layers.items()
                      if all(getattr(lin, "native", None) is not None and m <= lin.native_max_rows
                             for layer in ls for lin in layer)}
            times = _interleaved({**passes, **chains}, repeats if m < 64 else max(2, repeats // 5))
            for kind in [*passes, *chains]:
                ls = layers[kind.removesuffix(", one C call")]
                nbytes = sum(lin.nbytes for layer in ls for lin in layer)
                rows.append(_row(f"30 layers x 4 linears, {kind}", m, nbytes, times[kind],
                                 SMOLLM2_LAYERS * sum(n * k for n, k in SMOLLM2_LINEARS.values())))
                print("cpu matmuls", rows[-1], flush=True)
            del chains
        del layers, weights
        heads = {}
        for kind, make in kinds.items():
            head = make(torch.randn(SMOLLM2_HEAD, generator=g) * 0.02)
            heads[kind] = [head] + [make(torch.randn(SMOLLM2_HEAD, generator=g) * 0.02)
                                    for _ in range(max(0, -(-(96 << 20) // head.nbytes) - 1))]  # > 96 MiB in all
        calls = {kind: "logits" if hasattr(copies[0], "logits") else "forward" for kind, copies in heads.items()}
        for m in batch_rows:  # the LM head at each row count too: `logits` includes the exact top-k recompute
            x = torch.randn(m, SMOLLM2_HEAD[1], generator=g)
            rounds = max(repeats if m < 64 else max(2, repeats // 5), 2 * max(len(c) for c in heads.values()))
            times = _interleaved({kind: _rotating(copies, calls[kind], x) for kind, copies in heads.items()}, rounds)
            for kind, copies in heads.items():
                rows.append(_row(f"LM head 49152x576 `{calls[kind]}`, {kind}", m, copies[0].nbytes, times[kind],
                                 SMOLLM2_HEAD[0] * SMOLLM2_HEAD[1]))
                print("cpu matmuls", rows[-1], flush=True)
    for row in rows:
        row["pct_of_copy"] = 100 * row["gbs"] / copy_gbs
        row["pct_of_read"] = 100 * row["gbs"] / read_gbs
        row["pct_of_fma_peak"] = 100 * row["gflops"] / fma_peak if fma_peak else None
        peak = (dot_peak if cpu_matmul.ISA_NAMES[cpu_matmul.ISA_AVX512_BF16] in row["matmuls"] else vnni_peak
                if "(native, avx512" in row["matmuls"] else fma_peak)
        row["pct_of_peak"] = 100 * row["gflops"] / peak if peak else None
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(), "copy_gbs": copy_gbs, "read_gbs": read_gbs,
            "fma_peak_gflops": fma_peak, "bf16_dot_peak_gflops": dot_peak, "vnni_dot_peak_gops": vnni_peak,
            "repeats": repeats, "batch_rows": list(batch_rows), "only": list(only), "rows": rows}


def bench_cpu_attention(repeats: int, lengths: tuple[int, ...] = (128, 512, 2048)) -> dict:
    """The CPU prefill attention of one whole prompt of each length (SmolLM2-135M's 9 query / 3 kv heads of 64):
    the native kernel the engine runs on CPU (kernels.cpu_ops.paged_attention: only the causal half, each row in
    the decode kernel's fixed order) and kernels.reference's (the flash kernel over the whole K/V under an explicit
    mask, query heads folded into rows), both over the same paged cache, and SDPA's own causal mask with GQA on
    contiguous K/V, which skips the key
    blocks above the diagonal but is not used (a row's sums would depend on where the computed rows start);
    interleaved rounds, GFLOP/s = 4 Hq D L (L + 1) / 2 (the causal half of QK^T and PV) of the best, as a % of the
    FMA peak. Then each path's rows of a prompt computed cold against the same rows computed after a cached
    prefix (SDPA's cold rows against the reference's continued ones: what using it would serve)."""
    from kernels import cpu_ops
    from kernels import reference as ref
    from pdserve.bench.roofline import cpu_model

    fma_peak = fma_peak_gflops(torch.get_num_threads())
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    native = cpu_ops.available()

    def paged(k: torch.Tensor, v: torch.Tensor) -> tuple:
        """k, v laid out as a paged cache of 16-token blocks (in order): (k_cache, v_cache, block table)."""
        length = k.shape[0]
        blocks = -(-length // 16)
        cache = torch.zeros(2, blocks * 16, kv_heads, dim)
        cache[0, :length], cache[1, :length] = k, v
        cache = cache.view(2, blocks, 16, kv_heads, dim)
        return cache[0], cache[1], torch.arange(blocks, dtype=torch.int32)[None]

    def attend(fn, q: torch.Tensor, cache: tuple, cached: int = 0) -> torch.Tensor:
        """fn (the native kernel or the reference) over the paged cache, the rows from `cached` on new."""
        length = q.shape[0]
        return fn(q[cached:], *cache, torch.tensor([length], dtype=torch.int32),
                  torch.tensor([0, length - cached], dtype=torch.int32), dim ** -0.5)

    rows = []
    with torch.inference_mode():
        for length in lengths:
            q = torch.randn(length, heads, dim, generator=g)
            k, v = (torch.randn(length, kv_heads, dim, generator=g) for _ in range(2))
            cache = paged(k, v)
            paths = {"reference: explicit mask, heads folded into rows":
                         lambda: attend(ref.paged_attention_ref, q, cache),
                     "SDPA causal mask, GQA (not used; contiguous K/V)": lambda: _sdpa_causal(q, k, v, dim ** -0.5)}
            if native:
                paths = {"native: causal, fixed order per row (the engine's)":
                             lambda: attend(cpu_ops.paged_attention, q, cache), **paths}
            times = _interleaved(paths, repeats if length < 1024 else max(3, repeats // 4))
            flops = 4 * heads * dim * length * (length + 1) / 2
            for name, t in times.items():
                best = min(t)
                rows.append({"path": name, "tokens": length, "ms": statistics.median(t), "best_ms": best,
                             "gflops": flops / (best * 1e6),
                             "pct_of_fma_peak": 100 * flops / (best * 1e6) / fma_peak if fma_peak else None})
                print("cpu attention", rows[-1], flush=True)
        # A prompt's rows computed cold against the same rows computed after a cached prefix, at the split
        # lengths of the kernel tests.
        splits = []
        for length, cached in ((7, 3), (130, 64), (200, 17), (600, 512), (1100, 1000), (1100, 37)):
            q = torch.randn(length, heads, dim, generator=g)
            k, v = (torch.randn(length, kv_heads, dim, generator=g) for _ in range(2))
            continued = ref._prefill_attention_one(q[cached:], k, v, dim ** -0.5)
            row = {"tokens": length, "cached": cached,
                   "reference": float((ref._prefill_attention_one(q, k, v, dim ** -0.5)[cached:] - continued)
                                      .abs().max()),
                   "sdpa_causal": float((_sdpa_causal(q, k, v, dim ** -0.5)[cached:] - continued).abs().max())}
            if native:
                cache = paged(k, v)
                row["native"] = float((attend(cpu_ops.paged_attention, q, cache)[cached:]
                                       - attend(cpu_ops.paged_attention, q, cache, cached)).abs().max())
            splits.append(row)
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "fma_peak_gflops": fma_peak, "repeats": repeats, "rows": rows, "cold_vs_continued": splits}


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[L, Hq, D] x [L, Hkv, D] -> [L, Hq, D]: SDPA's own causal mask with GQA (top-left aligned: a whole prompt)."""
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)


def cpu_attention_report(result: dict) -> str:
    splits = result["cold_vs_continued"]
    native = bool(splits) and "native" in splits[0]
    return (f"### Prefill attention on CPU ({datetime.datetime.now(datetime.UTC):%Y-%m-%d}, {result['cpu']}, "
            f"{result['threads']} threads, torch {result['torch']})\n\n"
            f"Command: `python bench/bench_kernels.py --cpu-attention --threads {result['threads']}`. One whole "
            f"prompt, 9 query / 3 kv heads of 64, float32; paths timed in interleaved rounds, median and best; "
            f"GFLOP/s of the causal half (4 Hq D L (L + 1) / 2) of the best against the float32 FMA peak "
            f"(bench/fma_peak.c) {_fmt(result['fma_peak_gflops'], 0)} GFLOP/s.\n\n"
            + _table(["path", "tokens", "ms median", "ms best", "GFLOP/s", "% of FMA peak"],
                     [[r["path"], str(r["tokens"]), _fmt(r["ms"], 2), _fmt(r["best_ms"], 2), _fmt(r["gflops"]),
                       _fmt(r["pct_of_fma_peak"], 0)] for r in result["rows"]])
            + "\n\nA prompt's rows computed cold against the same rows computed after a cached prefix, largest "
              "difference (0: bit for bit, what a prefix-cache hit needs to serve the cold prompt's tokens; SDPA's "
              "cold rows against the reference's continued rows, what serving it would mix):\n\n"
            + _table(["tokens", "cached"] + (["native"] if native else []) + ["reference", "SDPA causal"],
                     [[str(r["tokens"]), str(r["cached"])] + ([f"{r['native']:.1e}"] if native else [])
                      + [f"{r['reference']:.1e}", f"{r['sdpa_causal']:.1e}"] for r in splits]) + "\n")


def lin_in(lin) -> int:
    """Input width of an engine.quant linear."""
    return lin.weight.shape[1] if hasattr(lin, "weight") else (lin.qweight.shape[1] if hasattr(lin, "qweight")
                                                                 else lin.shape[1])


def cpu_matmuls_report(result: dict) -> str:
    return (f"### Matmuls on CPU ({datetime.datetime.now(datetime.UTC):%Y-%m-%d}, {result['cpu']}, "
            f"{result['threads']} threads, torch {result['torch']}, {result['capability']})\n\n"
            f"Command: `python bench/bench_kernels.py --cpu-matmuls --threads {result['threads']} --rows {','.join(map(str, result['batch_rows']))}"
            f"{' --kinds ' + repr(','.join(result['only'])) if result['only'] else ''}`. Copy {result['copy_gbs']:.1f} GB/s (read + "
            f"write), read-only sweep {result['read_gbs']:.1f} GB/s, float32 FMA peak (bench/fma_peak.c) "
            f"{_fmt(result['fma_peak_gflops'], 0)} GFLOP/s, vdpbf16ps peak "
            f"{_fmt(result.get('bf16_dot_peak_gflops'), 0)} GFLOP/s and vpdpbusd peak "
            f"{_fmt(result.get('vnni_dot_peak_gops'), 0)} GOP/s (the last column's ceilings of the avx512-bf16 rows "
            f"and the int8-activation ones on avx512, the FMA peak that of the others); kinds timed in interleaved "
            f"rounds ({result['repeats']} at M < 64, a fifth of that from 64), median and best pass, GB/s and GFLOP/s "
            f"(2 M N K) of the best.\n\n"
            + _table(["matmuls", "M", "weight MiB", "ms median", "ms best", "GB/s", "% of copy", "% of read",
                      "GFLOP/s", "% of FMA peak", "% of its compute peak"],
                     [[r["matmuls"], str(r["m"]), _fmt(r["weight_mib"]), _fmt(r["ms"], 2), _fmt(r["best_ms"], 2),
                       _fmt(r["gbs"]), _fmt(r["pct_of_copy"], 0), _fmt(r["pct_of_read"], 0), _fmt(r["gflops"]),
                       _fmt(r["pct_of_fma_peak"], 0), _fmt(r.get("pct_of_peak"), 0)] for r in result["rows"]]) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU via the torch reference")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this long")
    parser.add_argument("--out", type=Path, default=None, help="report path (default $OUT/kernels.md or "
                                                               "bench/results/kernels.md; smoke: no file)")
    parser.add_argument("--cpu-matmuls", action="store_true", help="batch-1 float32/int8/int4 linears on CPU instead")
    parser.add_argument("--cpu-attention", action="store_true",
                        help="the CPU prefill attention of one whole prompt (native, reference, SDPA causal) instead")
    parser.add_argument("--repeats", type=int, default=20, help="--cpu-matmuls / --cpu-attention: timed passes")
    parser.add_argument("--threads", type=int, default=None,
                        help="--cpu-matmuls / --cpu-attention: torch threads (default: torch's)")
    parser.add_argument("--rows", default="1", help="--cpu-matmuls: rows of x of the layer matmuls, e.g. 1,32,512")
    parser.add_argument("--kinds", default="", help="--cpu-matmuls: only the kinds whose label contains one of "
                                                    "these comma-separated strings, e.g. 'int4 (,int8 ('")
    args = parser.parse_args(argv)

    if args.cpu_matmuls or args.cpu_attention:
        import json

        if args.threads:
            torch.set_num_threads(args.threads)
        if args.cpu_matmuls:
            result = bench_cpu_matmuls(args.repeats, tuple(int(m) for m in args.rows.split(",")),
                                       tuple(k for k in args.kinds.split(",") if k))
            report, name = cpu_matmuls_report(result), "cpu_matmuls.md"
        else:
            result = bench_cpu_attention(args.repeats)
            report, name = cpu_attention_report(result), "cpu_attention.md"
        print("\n" + report)
        base = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench/results"
        out = args.out or base / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        contexts, batches, prefill_shapes, moved = [64, 256], [1, 4], [(1, 64), (2, 128)], 8
    elif not torch.cuda.is_available():
        print("bench_kernels: no CUDA device available; nothing measured (use --smoke to check the script on CPU)")
        return 0
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        contexts, batches, prefill_shapes, moved = [1024, 8192, 32768], [1, 32, 128], [
            (1, 1024), (1, 4096), (1, 16384), (8, 2048)], 512
    bench = Bench(device, args.budget_s, target_ms=5 if args.smoke else 150)

    started = time.monotonic()
    copy_gbs, matmul_tflops = measure_ceilings(bench, dtype, args.smoke)
    print(f"ceilings: copy {copy_gbs:,.0f} GB/s, matmul {matmul_tflops:,.1f} TFLOP/s", flush=True)
    decode = bench_decode(bench, dtype, contexts, batches, copy_gbs)
    prefill = bench_prefill(bench, dtype, prefill_shapes, matmul_tflops)
    blocks = bench_blocks(bench, dtype, moved, copy_gbs)

    backend = "triton" if device.type == "cuda" and kernels.triton_available() else "torch reference"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    report = "\n\n".join([
        f"# Kernel benchmarks\n\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {name}; "
        f"torch {torch.__version__}, triton {triton_version}; dtype {str(dtype).removeprefix('torch.')}, "
        f"block_size {BLOCK_SIZE}; backend `{backend}`; "
        f"L2 flushed before each timed call; median of up to 50 calls; {time.monotonic() - started:.0f} s in all.",
        f"## Device ceilings\n\n" + _table(["copy GB/s (read+write)", "bf16 matmul TFLOP/s"],
                                           [[_fmt(copy_gbs, 0), _fmt(matmul_tflops)]]),
        "## Decode attention (paged, one token per sequence)\n\nGB/s = K/V + q + block-table bytes read / time; "
        "SDPA reads the same K/V from contiguous [B, Hkv, ctx, D] tensors.\n\n" + _table(
            ["model", "ctx", "batch", "splits", "paged µs", "paged GB/s", "% of copy", "SDPA µs", "SDPA GB/s"],
            decode),
        "## Prefill attention (causal, whole prompt new)\n\n" + _table(
            ["model", "batch", "seq", "paged ms", "paged TFLOP/s", "% of matmul", "SDPA ms", "SDPA TFLOP/s"], prefill),
        "## Block gather/scatter (KV transfer staging)\n\nGB/s = bytes read + written / time; int8 rows read bf16 "
        "and write int8 + scales (or the reverse).\n\n" + _table(
            ["layout", "op", "blocks", "staging MiB", "µs", "GB/s", "% of copy", "torch ref GB/s"], blocks),
    ]) + "\n"
    print("\n" + report)
    out = args.out
    if out is None and not args.smoke:
        out = Path(os.environ["OUT"]) / "kernels.md" if os.environ.get("OUT") else ROOT / "bench/results/kernels.md"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
