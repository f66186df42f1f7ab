"""Triton dequant-GEMM over a GPTQ-packed weight: out = x @ W.T, W unpacked tile by tile from its int32 words.

Reference: kernels.reference.gptq_gemm_ref (its docstring defines W). One program computes a [BLOCK_M, BLOCK_N]
tile of out: for each BLOCK_K slice of the inputs it loads x, the qweight words of those inputs, their g_idx,
and the scales and qzeros rows of those groups, unpacks codes and zero points with shifts and masks, forms W's
tile in x's dtype and accumulates tl.dot in fp32. g_idx is read per input, so act-order checkpoints need no
reordering. The weight is never materialized in memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import STORAGE_DTYPES, check_last_dim_contiguous, check_tensor

GPTQ_BITS = (4, 8)
BLOCK_N = 64
BLOCK_K = 64
BLOCK_K_FP32 = 32  # fp32 tiles at 64 spill registers on sm_90 (tests/kernels/sm90_compile.py)


@triton.jit
def _gptq_gemm_kernel(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, out_ptr,
                      M, N, K, zero_offset,
                      stride_xm, stride_qk, stride_zg, stride_sg, stride_om,
                      BITS: tl.constexpr, IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # x: [M, K]; qweight: [K // PACK, N] int32; qzeros: [G, N // PACK] int32; scales: [G, N]; out: [M, N]
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    z_shift = (offs_n % PACK) * BITS                                       # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)     # [BLOCK_M, BLOCK_K]
        kn_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(qweight_ptr + (offs_k // PACK)[:, None].to(tl.int64) * stride_qk + offs_n[None, :],
                        mask=kn_mask, other=0)                             # [BLOCK_K, BLOCK_N] int32
        q = (words >> ((offs_k % PACK) * BITS)[:, None]) & MASK
        g = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0).to(tl.int64)  # [BLOCK_K]
        s = tl.load(scales_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=kn_mask, other=0.0)
        zw = tl.load(qzeros_ptr + g[:, None] * stride_zg + (offs_n // PACK)[None, :], mask=kn_mask, other=0)
        z = ((zw >> z_shift[None, :]) & MASK) + zero_offset
        w = ((q - z).to(tl.float32) * s.to(tl.float32)).to(x.dtype)        # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gptq_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                     g_idx: torch.Tensor, bits: int, zero_offset: int) -> torch.Tensor:
    # x: [M, K] (dense rows); qweight: [K // p, N]; qzeros: [G, N // p]; scales: [G, N]; g_idx: [K] -> [M, N]
    if bits not in GPTQ_BITS:
        raise ValueError(f"bits must be one of {GPTQ_BITS}, got {bits!r}")
    pack = 32 // bits
    check_tensor("x", x, ndim=2, dtypes=STORAGE_DTYPES)
    num_rows, in_features = x.shape
    device = x.device
    if in_features % pack:
        raise ValueError(f"x has {in_features} inputs, not a multiple of {pack} (codes per qweight word)")
    check_tensor("qweight", qweight, shape=(in_features // pack, None), dtypes=(torch.int32,), device=device)
    out_features = qweight.shape[1]
    check_tensor("scales", scales, shape=(None, out_features), dtypes=STORAGE_DTYPES, device=device)
    groups = scales.shape[0]
    check_tensor("qzeros", qzeros, shape=(groups, -(-out_features // pack)), dtypes=(torch.int32,), device=device)
    check_tensor("g_idx", g_idx, shape=(in_features,), dtypes=(torch.int32, torch.int64), device=device)
    for name, t in (("x", x), ("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx)):
        check_last_dim_contiguous(name, t)
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=device)
    if num_rows == 0 or out_features == 0:
        return out
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, BLOCK_N))
    _gptq_gemm_kernel[grid](
        x, qweight, qzeros, scales, g_idx, out, num_rows, out_features, in_features, zero_offset,
        x.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K_FP32 if x.dtype == torch.float32 else BLOCK_K)
    return out
