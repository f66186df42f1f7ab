"""Native CPU matmuls over 4-bit and int8 weights with int8-quantized activations (kernels/cpu_matmul.c).

The C source (its header comment is the exact arithmetic) is compiled on first use by kernels.native_build
(-O3 -fopenmp; one ISA per function picked at run time: AVX512-VNNI, AVX2, scalar). No compiler, a failed build
or a failed load logs one warning and `available()` is False: engine.quant then keeps the torch kernels.

    q4_matmul(x, codes, scale_zero)   x [M, K] float32, codes [N, K // 2] uint8 (GGML Q4 order per 32),
                                      scale_zero [N, K // 32, 2] bfloat16 (scale, zero) -> [M, N] float32
    q8_matmul(x, qweight, scale)      x [M, K] float32, qweight [N, K] int8, scale [N] float32 -> [M, N] float32

Both quantize each row of x to int8 per 32 inputs inside the kernel (llama.cpp's Q8_0 activations), so results
differ from the float matmul by that rounding (measured on the default model's layer 0: 0.55-0.6% relative error
on the layers, 0.06% on the LM head), and each row of the result depends on that
row of x only (batch invariant). Threads: torch.get_num_threads() unless `nthreads` is given; `isa` forces a
path (ISA_SCALAR, ISA_AVX2, ISA_AVX512_VNNI; a path the CPU lacks falls back to the best it has).
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

ISA_SCALAR, ISA_AVX2, ISA_AVX512_VNNI = 0, 1, 2
ISA_NAMES = {ISA_SCALAR: "scalar", ISA_AVX2: "avx2", ISA_AVX512_VNNI: "avx512-vnni"}
ISA_BEST = -1


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None (after one warning) when it cannot be."""
    lib = native_build.load(SOURCE, "matmul")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pd_best_isa.restype = ctypes.c_int
    lib.pd_best_isa.argtypes = []
    for fn in (lib.pd_q4_matmul, lib.pd_q8_matmul):
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    log.info("native CPU matmul kernels: %s", ISA_NAMES[lib.pd_best_isa()])
    return lib


def available() -> bool:
    """Whether the native kernels are built and loaded (a CPU x86 or portable build of kernels/cpu_matmul.c)."""
    return library() is not None


def best_isa() -> int:
    """The fastest path this CPU runs (ISA_*); RuntimeError when the library is unavailable."""
    return _lib().pd_best_isa()


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("native CPU matmul kernels are unavailable (see the warning logged at first use)")
    return lib


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor of shape {list(shape)}, got "
                         f"{t.dtype} {list(t.shape)} (contiguous: {t.is_contiguous()}, {t.device})")


class NativeMatmul:
    """One weight's matmul, validated once: `(x)` -> [M, N] float32 (the hot path checks only x)."""

    def __init__(self, kind: str, weight: torch.Tensor, table: torch.Tensor, *, isa: int = ISA_BEST) -> None:
        if kind == "q4":
            out_features, half = weight.shape
            in_features = 2 * half
            shapes = (("codes", torch.uint8, (out_features, half)),
                      ("scale_zero", torch.bfloat16, (out_features, in_features // GROUP, 2)))
        elif kind == "q8":
            out_features, in_features = weight.shape
            shapes = (("qweight", torch.int8, (out_features, in_features)), ("scale", torch.float32, (out_features,)))
        else:
            raise ValueError(f"kind must be 'q4' or 'q8', got {kind!r}")
        if in_features % GROUP:
            raise ValueError(f"{shapes[0][0]}' row width {in_features} is not a multiple of {GROUP}")
        for (name, dtype, shape), t in zip(shapes, (weight, table)):
            _check(name, t, dtype, shape)
        lib = _lib()
        self._fn = lib.pd_q4_matmul if kind == "q4" else lib.pd_q8_matmul
        self._weight, self._table = weight, table  # kept alive: the kernel reads their memory
        self._ptrs = (weight.data_ptr(), table.data_ptr())
        self.in_features, self.out_features, self.isa = in_features, out_features, isa

    def __call__(self, x: torch.Tensor, nthreads: int | None = None) -> torch.Tensor:
        # x: [M, in] (any float dtype; made contiguous float32) -> [M, out] float32. The hot path (a contiguous
        # float32 CPU x) costs a few attribute reads: batch-1 decode calls this 121 times a step.
        if not (x.is_cpu and x.dtype is torch.float32 and x.dim() == 2 and x.is_contiguous()):
            x = self._prepared(x)
        m, k = x.shape
        if k != self.in_features:
            raise ValueError(f"x must be a CPU [M, {self.in_features}] tensor, got {list(x.shape)}")
        y = torch.empty(m, self.out_features)
        if m and self._fn(x.data_ptr(), m, k, self._ptrs[0], self._ptrs[1], self.out_features, y.data_ptr(),
                          nthreads or torch.get_num_threads(), self.isa) < 0:
            raise MemoryError("native CPU matmul: out of memory for the quantized activations")
        return y

    def _prepared(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not x.is_cpu or not x.is_floating_point():
            raise ValueError(f"x must be a CPU [M, {self.in_features}] float tensor, got {x.device} {x.dtype} "
                             f"{list(x.shape)}")
        return x.to(torch.float32).contiguous()  # (`to` alone returns a float32 x as it is, strides and all)


def q4_matmul(x: torch.Tensor, codes: torch.Tensor, scale_zero: torch.Tensor, *, nthreads: int | None = None,
              isa: int = ISA_BEST) -> torch.Tensor:
    """x [M, K] @ W.T with W[n, 32 g + j] = (q - 8) * scale[n, g] + zero[n, g] (module docstring): [M, N] float32.
    The weights must already be in the kernel's layout (ValueError naming the argument otherwise)."""
    return NativeMatmul("q4", codes, scale_zero, isa=isa)(x, nthreads)


def q8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, *, nthreads: int | None = None,
              isa: int = ISA_BEST) -> torch.Tensor:
    """x [M, K] @ (qweight * scale[:, None]).T with int8 qweight in [-127, 127]: [M, N] float32."""
    return NativeMatmul("q8", qweight, scale, isa=isa)(x, nthreads)
