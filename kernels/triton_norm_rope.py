"""Triton fused RMSNorm (+ residual add) and rotary embedding (NeoX / HF rotate_half, in place on q and k).

References: kernels.reference.rms_norm_ref, rotary_embedding_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import INDEX_DTYPES, STORAGE_DTYPES, check_last_dim_contiguous, check_tensor, next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                     stride_x, stride_r, stride_o, stride_ro, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    # one program per row: x[t]: [H] (+ residual[t]) -> out[t]: [H]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # stored residual, as rounded
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    # x, residual: [T, H]; weight: [H] -> out [T, H] (and new residual [T, H] = x + residual)
    check_tensor("x", x, ndim=2, dtypes=STORAGE_DTYPES)
    num_tokens, hidden = x.shape
    check_tensor("weight", weight, shape=(hidden,), dtypes=STORAGE_DTYPES, device=x.device)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if residual is not None:
        check_tensor("residual", residual, shape=(num_tokens, hidden), dtypes=(x.dtype,), device=x.device)
        check_last_dim_contiguous("residual", residual)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else out
    if num_tokens:
        r = residual if residual is not None else x
        _rms_norm_kernel[(num_tokens,)](
            x, r, weight, out, residual_out, x.stride(0), r.stride(0), out.stride(0), residual_out.stride(0),
            hidden, float(eps), HAS_RESIDUAL=residual is not None, BLOCK_H=next_pow2(hidden))
    return out if residual is None else (out, residual_out)


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, row, num_heads, cos, sin, half,
                  BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # x[row]: [num_heads, head_dim]; rotates dims [0, 2*half) in place; cos, sin: [1, BLOCK_HALF] fp32
    h = tl.arange(0, BLOCK_HEADS)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (d < half)
    p1 = x_ptr + row * stride_t + h * stride_h + d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(pos_ptr, q_ptr, k_ptr, cos_sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                 num_heads, num_kv_heads, half,
                 BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # one program per token: q[t]: [Hq, D], k[t]: [Hkv, D], cos_sin[pos]: [rot_dim] = [cos | sin]
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d < half, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + d, mask=d < half, other=0.0)
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, num_heads, cos, sin, half, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr, stride_kt, stride_kh, t, num_kv_heads, cos, sin, half, BLOCK_KH, BLOCK_HALF)


def rotary_embedding_triton(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                            cos_sin_cache: torch.Tensor) -> None:
    # positions: [T]; query: [T, Hq, D]; key: [T, Hkv, D] (views of a fused qkv are fine: dense last dim)
    # cos_sin_cache: [max_position, rot_dim] fp32, rot_dim <= D, rows = [cos(rot_dim/2) | sin(rot_dim/2)]
    check_tensor("query", query, ndim=3, dtypes=STORAGE_DTYPES)
    num_tokens, num_heads, head_dim = query.shape
    device = query.device
    check_tensor("key", key, shape=(num_tokens, None, head_dim), dtypes=(query.dtype,), device=device)
    check_tensor("positions", positions, shape=(num_tokens,), dtypes=INDEX_DTYPES, device=device)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32,), device=device)
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"cos_sin_cache width {rot_dim} must be even and <= head_dim {head_dim}")
    for name, t in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    if num_tokens == 0:
        return
    num_kv_heads = key.shape[1]
    _rope_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        cos_sin_cache.stride(0), num_heads, num_kv_heads, rot_dim // 2,
        BLOCK_QH=next_pow2(num_heads), BLOCK_KH=next_pow2(num_kv_heads), BLOCK_HALF=next_pow2(rot_dim // 2))
