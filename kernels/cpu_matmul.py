"""Native CPU matmuls over 4-bit and int8 weights (kernels/cpu_matmul.c), on int8-quantized or bfloat16 activations.

The C source (its header comments are the exact arithmetic) is compiled on first use by kernels.native_build
(-O3 -fopenmp; one ISA per function picked at run time: AVX512-BF16, AVX512, AVX2, scalar). No compiler, a
failed build or a failed load logs one warning and `available()` is False: engine.quant then keeps the torch
kernels.

    q4_matmul(x, packed, scale_zero, block_rows)
                                          x [M, K] float32, packed [N, K // 2] uint8 in int4pack_mm's layout
                                          (blocks of block_rows = 64 or 32 output channels), scale_zero
                                          [K // 32, N, 2] bfloat16 (int4pack_mm's table) -> [M, N] float32
    q8_matmul(x, qweight, scale)          x [M, K] float32, qweight [N, K] int8, scale [N] float32 -> [M, N] float32
    q4_bf16_matmul(x, packed, scale_zero, block_rows)
                                          q4_matmul's operands, bfloat16 activations
    q8_bf16_matmul(x, qweight, scale)     q8_matmul's operands, bfloat16 activations

Kinds "q4" / "q8" quantize each row of x to int8 per 32 inputs inside the kernel (llama.cpp's Q8_0 activations), so
results differ from the float matmul by that rounding (measured on the default model's layer 0: 0.55-0.6% relative
error on the layers, 0.06% on the LM head); q4 sums each group's integer products exactly, then folds the groups in
order per output channel (y = fma(isum_g, scale_g * dx_g, y), then + m_g * dx_g * sumq_g, m = zero - 8 scale), 64
products a vpdpbusd with lanes over output channels. Kinds "q4-bf16" / "q8-bf16" round x to bfloat16 and sum float32
products of the same weights: q8-bf16 what torch's `_weight_int8pack_mm` computes (each weight q * scale, exact; its
AVX512 / AVX2 summation orders on those paths; at ISA_AVX512_BF16 the exact products x q summed in vdpbf16ps's
pairs, then times the row's scale); q4-bf16 the exact products of x with the integer codes (q - 8), summed per group
of 32 inputs in bfloat16 pairs (the arithmetic of avx512_bf16's vdpbf16ps, which runs it at twice the FMA rate where
the CPU has it), then scaled: sum_g scale_g * S_g + zero_g * X_g (X_g the group's sum of x). That is torch's
`_weight_int4pack_mm_for_cpu` in another order (within float32 rounding of it; the output, rounded to bfloat16
values as both return it, differs in a few per mille of the values, by one bfloat16 step).
Every kind computes each row of the result from that row of x only (batch invariant), the same on any number of
threads; q4 and q4-bf16 give the same bits on every path. Threads: torch.get_num_threads() unless `nthreads` is given;
`isa` forces a path (ISA_SCALAR, ISA_AVX2, ISA_AVX512, ISA_AVX512_BF16 / ISA_AVX512_VBMI; a path the CPU lacks falls
back to the best it has).
ISA_AVX512 is avx512f/bw/vl/dq + VNNI for the int8-activation kinds, avx512f/bw for the bfloat16 ones; level 3 adds
avx512_bf16 for the bfloat16 kinds (ISA_AVX512_BF16), taken when a check at load finds this CPU's vdpbf16ps
computing exactly the sums above, and AVX512-VBMI for the int8-activation ones (ISA_AVX512_VBMI: the same bits
as ISA_AVX512) (`best_isa(kind)`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kernels import native_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_matmul.c")
GROUP = 32
"""Inputs per activation (and 4-bit weight) scale."""

KINDS = ("q4", "q8", "q4-bf16", "q8-bf16")
"""NativeMatmul kinds: 4-bit or int8 weights, int8 (no suffix) or bfloat16 (-bf16) activations."""

ISA_SCALAR, ISA_AVX2, ISA_AVX512, ISA_AVX512_BF16 = 0, 1, 2, 3
ISA_AVX512_VBMI = 3
"""Level 3 of the int8-activation kinds: ISA_AVX512 plus AVX512-VBMI (the int4 codes spread by vpermt2b)."""
ISA_NAMES = {ISA_SCALAR: "scalar", ISA_AVX2: "avx2", ISA_AVX512: "avx512", ISA_AVX512_BF16: "avx512-bf16"}
"""Path names of the bfloat16 kinds (isa_name: any kind's)."""


def isa_name(kind: str, isa: int) -> str:
    """The name of path `isa` of `kind` (level 3: avx512-bf16 for the bfloat16 kinds, avx512-vbmi otherwise)."""
    return ISA_NAMES[isa] if kind.endswith("-bf16") or isa != ISA_AVX512_VBMI else "avx512-vbmi"
ISA_BEST = -1


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None (after one warning) when it cannot be."""
    lib = native_build.load(SOURCE, "matmul")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.pd_best_isa, lib.pd_bf16_best_isa):
        fn.restype = ctypes.c_int
        fn.argtypes = []
    lib.pd_matmul.restype = ctypes.c_int
    lib.pd_matmul.argtypes = [ptr, ptr, i64, ptr, ctypes.c_int]
    lib.pd_matmul_chain.restype = ctypes.c_int
    lib.pd_matmul_chain.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_int]
    log.info("native CPU matmul kernels: int8 activations %s, bfloat16 activations %s",
             isa_name("q4", lib.pd_best_isa()), isa_name("q4-bf16", lib.pd_bf16_best_isa()))
    return lib


def available() -> bool:
    """Whether the native kernels are built and loaded (a CPU x86 or portable build of kernels/cpu_matmul.c)."""
    return library() is not None


def best_isa(kind: str = "q4") -> int:
    """The fastest path this CPU runs for `kind` (ISA_*); RuntimeError when the library is unavailable."""
    lib = _lib()
    return lib.pd_bf16_best_isa() if kind.endswith("-bf16") else lib.pd_best_isa()


def matmul_address() -> int:
    """The address of pd_matmul (a C function pointer: kernels.cpu_ops' decode layers call it); RuntimeError when
    the library is unavailable."""
    return ctypes.cast(_lib().pd_matmul, ctypes.c_void_p).value


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("native CPU matmul kernels are unavailable (see the warning logged at first use)")
    return lib


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor of shape {list(shape)}, got "
                         f"{t.dtype} {list(t.shape)} (contiguous: {t.is_contiguous()}, {t.device})")


class _Weight(ctypes.Structure):
    """struct pd_weight of kernels/cpu_matmul.c: one weight's operands, filled once, passed to every pd_matmul."""

    _fields_ = [("w", ctypes.c_void_p), ("table", ctypes.c_void_p), ("K", ctypes.c_int64), ("N", ctypes.c_int64),
                ("kind", ctypes.c_int32), ("isa", ctypes.c_int32), ("B", ctypes.c_int32), ("round_out", ctypes.c_int32)]


class NativeMatmul:
    """One weight's matmul, validated once: `(x)` -> [M, N] float32 (the hot path checks only x). `round_output`
    (bfloat16 kinds only; default True, what torch's kernels return) rounds the result to bfloat16 values."""

    def __init__(self, kind: str, weight: torch.Tensor, table: torch.Tensor, *, isa: int = ISA_BEST,
                 round_output: bool = True, block_rows: int = 0) -> None:
        if kind in ("q4", "q4-bf16"):
            out_features, half = weight.shape
            in_features = 2 * half
            if block_rows not in (32, 64) or out_features % block_rows:
                raise ValueError(f"block_rows must be 32 or 64 and divide the {out_features} rows, got {block_rows}")
            shapes = (("packed", torch.uint8, (out_features, half)),
                      ("scale_zero", torch.bfloat16, (in_features // GROUP, out_features, 2)))
        elif kind in ("q8", "q8-bf16"):
            out_features, in_features = weight.shape
            shapes = (("qweight", torch.int8, (out_features, in_features)), ("scale", torch.float32, (out_features,)))
        else:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if in_features % GROUP:
            raise ValueError(f"{shapes[0][0]}' row width {in_features} is not a multiple of {GROUP}")
        for (name, dtype, shape), t in zip(shapes, (weight, table)):
            _check(name, t, dtype, shape)
        self._fn = _lib().pd_matmul
        self._weight, self._table = weight, table  # kept alive: the kernel reads their memory
        self._operands = _Weight(weight.data_ptr(), table.data_ptr(), in_features, out_features, KINDS.index(kind), isa,
                                 block_rows, int(round_output))
        self._operands_ptr = ctypes.addressof(self._operands)
        self.kind, self.in_features, self.out_features, self.isa = kind, in_features, out_features, isa

    def __call__(self, x: torch.Tensor, nthreads: int | None = None) -> torch.Tensor:
        # x: [M, in] (any float dtype; made contiguous float32) -> [M, out] float32. The hot path (a contiguous
        # float32 CPU x) costs a few attribute reads: batch-1 decode calls this 121 times a step.
        if not (x.is_cpu and x.dtype is torch.float32 and x.dim() == 2 and x.is_contiguous()):
            x = self._prepared(x)
        m, k = x.shape
        if k != self.in_features:
            raise ValueError(f"x must be a CPU [M, {self.in_features}] tensor, got {list(x.shape)}")
        y = torch.empty(m, self.out_features)
        if m and self._fn(self._operands_ptr, x.data_ptr(), m, y.data_ptr(), nthreads or torch.get_num_threads()) < 0:
            raise MemoryError("native CPU matmul: out of memory for the activation scratch")
        return y

    @property
    def operands(self) -> int:
        """The address of this weight's struct pd_weight (pd_matmul's first argument; valid while self lives)."""
        return self._operands_ptr

    def _prepared(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not x.is_cpu or not x.is_floating_point():
            raise ValueError(f"x must be a CPU [M, {self.in_features}] float tensor, got {x.device} {x.dtype} "
                             f"{list(x.shape)}")
        return x.to(torch.float32).contiguous()  # (`to` alone returns a float32 x as it is, strides and all)


class MatmulChain:
    """A fixed sequence of NativeMatmul calls, each on its own input and output, run by one C call
    (pd_matmul_chain): the kernels' rate without a caller between them, as the native decoder calls them.
    `calls`: (matmul, x [M, in] contiguous float32 CPU) pairs, all with the same M; the outputs are `self.outputs`
    (overwritten by every run)."""

    def __init__(self, calls: list[tuple[NativeMatmul, torch.Tensor]]) -> None:
        if not calls:
            raise ValueError("calls must hold at least one (matmul, x) pair")
        m = calls[0][1].shape[0]
        for i, (mm, x) in enumerate(calls):
            _check(f"calls[{i}] x", x, torch.float32, (m, mm.in_features))
        self.inputs = [x for _, x in calls]
        self.outputs = [torch.empty(m, mm.out_features) for mm, _ in calls]
        self._matmuls = [mm for mm, _ in calls]  # kept alive: their operands are read by address
        n = len(calls)
        self._wts = (ctypes.c_void_p * n)(*(mm.operands for mm in self._matmuls))
        self._xs = (ctypes.c_void_p * n)(*(x.data_ptr() for x in self.inputs))
        self._ys = (ctypes.c_void_p * n)(*(y.data_ptr() for y in self.outputs))
        self._n, self._m = n, m

    def __call__(self, nthreads: int | None = None) -> None:
        if _lib().pd_matmul_chain(self._wts, self._xs, self._ys, self._n, self._m,
                                  nthreads or torch.get_num_threads()) < 0:
            raise MemoryError("native CPU matmul: out of memory for the activation scratch")


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, block_rows: int, *,
              nthreads: int | None = None, isa: int = ISA_BEST) -> torch.Tensor:
    """x [M, K] @ W.T with W[n, k] = (q - 8) * scale[k // 32, n] + zero[k // 32, n] (module docstring), x quantized
    to int8 per 32 inputs: [M, N] float32. The weights must already be in int4pack_mm's layout (ValueError naming
    the argument otherwise)."""
    return NativeMatmul("q4", packed, scale_zero, isa=isa, block_rows=block_rows)(x, nthreads)


def q8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, *, nthreads: int | None = None,
              isa: int = ISA_BEST) -> torch.Tensor:
    """x [M, K] @ (qweight * scale[:, None]).T with int8 qweight in [-127, 127]: [M, N] float32."""
    return NativeMatmul("q8", qweight, scale, isa=isa)(x, nthreads)


def q4_bf16_matmul(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, block_rows: int, *,
                   nthreads: int | None = None, isa: int = ISA_BEST, round_output: bool = True) -> torch.Tensor:
    """bf16(x) [M, K] @ W.T over int4pack_mm's weights (packed, scale_zero, its block_rows), summed per group
    (module docstring): [M, N] float32 (rounded to bfloat16 values unless round_output is False)."""
    return NativeMatmul("q4-bf16", packed, scale_zero, isa=isa, round_output=round_output,
                        block_rows=block_rows)(x, nthreads)


def q8_bf16_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, *, nthreads: int | None = None,
                   isa: int = ISA_BEST, round_output: bool = True) -> torch.Tensor:
    """bf16(x) [M, K] @ (qweight * scale[:, None]).T, float32 sums, rounded to bfloat16 values: [M, N] float32."""
    return NativeMatmul("q8-bf16", qweight, scale, isa=isa, round_output=round_output)(x, nthreads)
