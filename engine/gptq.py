"""The GPTQ algorithm (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers") and round-to-nearest, for one linear layer; engine.quantize runs them layer by layer.

Both minimize, per output row w of a weight W [out, in], the layer's output error on calibration inputs X [n, in]:
||w X^T - q X^T||^2 = (w - q) H (w - q)^T with H = 2 X^T X (`HessianAccumulator`; `hessian_error` reports it
relative to w H w^T). Round-to-nearest (`rtn_quantize`) rounds every weight of a group on that group's grid.
GPTQ (`gptq_quantize`) quantizes the columns one at a time and spreads each column's rounding error over the
columns not yet quantized, through the Cholesky factor of H^-1:
- dead inputs (H[i, i] == 0: never active in calibration) get weight 0;
- dampening: H += damp_percent * mean(diag(H)) * I, so that the inverse exists and stays well conditioned;
- act-order: columns are processed by decreasing diag(H) (the most active inputs first, while the most error can
  still be compensated); group i then holds the i-th run of group_size columns in that order, and g_idx maps each
  input (in the checkpoint's order) to its group;
- lazy batches: updates inside a block of `block_size` columns are applied at once to the remaining columns
  (one GEMM per block instead of a rank-1 update per column);
- groups: each group's scale and zero point are chosen from the (error-updated) weights when its first column
  is reached.
Grids (engine.gptq_format): asymmetric q in [0, 2^bits - 1] over [min(w, 0), max(w, 0)] with zero point
round(-min / scale); symmetric zero point 2^(bits - 1) over [-max|w|, max|w|]. Scales are rounded to float16
before any code is chosen, so that the codes are optimal for the scales the checkpoint stores. A zero point
of 0 is raised to 1 when `min_zero` is 1 (checkpoint_format gptq cannot store 0; see gptq_format.pack_weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedWeight:
    """One linear's codes and grids: W ~= (codes - zeros[g_idx].T) * scales[g_idx].T."""

    codes: torch.Tensor    # [out, in] int64 in [0, 2^bits)
    scales: torch.Tensor   # [groups, out] float32 (float16-representable)
    zeros: torch.Tensor    # [groups, out] int64
    g_idx: torch.Tensor    # [in] int64: group of each input

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] weight the codes stand for."""
        return (self.codes - self.zeros[self.g_idx].t()).float() * self.scales[self.g_idx].t()


class HessianAccumulator:
    """H = 2 / n * sum of x x^T over the n calibration rows seen (float32 [in, in]); `add` takes [..., in]."""

    def __init__(self, in_features: int) -> None:
        self.hessian = torch.zeros(in_features, in_features)
        self.num_rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        n = x.shape[0]
        if n == 0:
            return
        self.hessian *= self.num_rows / (self.num_rows + n)
        self.num_rows += n
        x = x * (2 / self.num_rows) ** 0.5
        self.hessian.addmm_(x.t(), x)


def _grid(w: torch.Tensor, bits: int, sym: bool, min_zero: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) per row of w [rows, n] (module docstring), scale float16-representable."""
    maxq = (1 << bits) - 1
    lo = w.amin(dim=1).clamp(max=0)
    hi = w.amax(dim=1).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    empty = (lo == 0) & (hi == 0)
    lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
    scale = ((hi - lo) / maxq).half().float()
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 2.0 ** -24))  # float16's smallest step
    if sym:
        zero = torch.full_like(scale, (maxq + 1) // 2, dtype=torch.int64)
    else:
        zero = torch.round(-lo / scale).clamp(min_zero, maxq).to(torch.int64)
    return scale, zero


def _codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    # w: [rows, n]; scale, zero: [rows] -> codes [rows, n] int64
    return torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, (1 << bits) - 1).to(torch.int64)


def _group_size(group_size: int, in_features: int) -> int:
    if group_size == -1:
        return in_features
    if group_size <= 0:
        raise ValueError(f"group_size must be -1 or positive, got {group_size}")
    return group_size


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool, min_zero: int = 0) -> QuantizedWeight:
    """Round each weight to nearest on its group's grid: weight [out, in] float."""
    w = weight.float()
    out_features, in_features = w.shape
    size = _group_size(group_size, in_features)
    codes, scales, zeros = torch.empty(out_features, in_features, dtype=torch.int64), [], []
    for start in range(0, in_features, size):
        cols = slice(start, min(start + size, in_features))
        scale, zero = _grid(w[:, cols], bits, sym, min_zero)
        codes[:, cols] = _codes(w[:, cols], scale, zero, bits)
        scales.append(scale)
        zeros.append(zero)
    return QuantizedWeight(codes, torch.stack(scales), torch.stack(zeros), torch.arange(in_features) // size)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, sym: bool,
                  act_order: bool = False, damp_percent: float = 0.01, block_size: int = 128,
                  min_zero: int = 0) -> QuantizedWeight:
    """GPTQ over weight [out, in] with the inputs' Hessian [in, in] (module docstring).

    Runs on one intra-op thread: the column loop is thousands of small ops, and with more threads their
    synchronization dominates (1536 x 576 on a loaded 2-core machine: 25 s with 2 threads, 1.3 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _gptq(weight, hessian, bits, group_size, sym, act_order, damp_percent, block_size, min_zero)
    finally:
        torch.set_num_threads(threads)


def _gptq(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, sym: bool, act_order: bool,
          damp_percent: float, block_size: int, min_zero: int) -> QuantizedWeight:
    w = weight.float().clone()
    out_features, in_features = w.shape
    size = _group_size(group_size, in_features)
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else torch.arange(in_features)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp_percent * torch.mean(torch.diag(h)) * torch.eye(in_features)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    codes = torch.empty(out_features, in_features, dtype=torch.int64)   # in processing (permuted) order
    scales, zeros = [], []
    scale = zero = None
    for b1 in range(0, in_features, block_size):
        b2 = min(b1 + block_size, in_features)
        w1 = w[:, b1:b2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[b1:b2, b1:b2]
        for i in range(b2 - b1):
            col = b1 + i
            if col % size == 0:  # a new group: its grid from the weights as updated so far
                group = w1[:, i:i + size] if i + size <= b2 - b1 else torch.cat(
                    [w1[:, i:], w[:, b2:col + size]], dim=1)
                scale, zero = _grid(group, bits, sym, min_zero)
                scales.append(scale)
                zeros.append(zero)
            q = _codes(w1[:, i:i + 1], scale, zero, bits)[:, 0]
            codes[:, col] = q
            dq = (q - zero).float() * scale
            err = (w1[:, i] - dq) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, b2:] -= err1 @ hinv[b1:b2, b2:]

    inverse = torch.argsort(perm)
    g_idx = (torch.arange(in_features) // size)[inverse]  # input c was processed at position inverse[c]
    return QuantizedWeight(codes[:, inverse].contiguous(), torch.stack(scales), torch.stack(zeros), g_idx)


def hessian_error(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """sum over rows of (w - q) H (w - q)^T / sum of w H w^T: the layer's relative output error on the
    calibration inputs."""
    w = weight.float()
    d = w - quantized.float()
    return float(((d @ hessian) * d).sum() / ((w @ hessian) * w).sum())
