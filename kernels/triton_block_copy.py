"""Triton block copies between the paged cache and the contiguous staging buffer of KV transfer, plain or int8.

One (block, layer, K/V) chunk is block_size * Hkv * D contiguous elements on both sides, so the plain copy is a
flat memcpy per chunk; the int8 kernels work per (block, layer, K/V, kv head) on a [block_size, D] tile and may
read from / write to the cache directly (fused gather+quantize, dequantize+scatter).
References: kernels.reference.{gather,scatter}_blocks_ref, {quantize,dequantize}_blocks_int8_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (INDEX_DTYPES, STORAGE_DTYPES, check_gather_out, check_inner_contiguous, check_tensor,
                             next_pow2)

COPY_BLOCK = 1024


@triton.jit
def _copy_chunks_kernel(src_ptr, dst_ptr, ids_ptr, chunk_numel,
                        src_stride_blk, src_stride_layer, src_stride_kv,
                        dst_stride_blk, dst_stride_layer, dst_stride_kv,
                        IDS_ON_SRC: tl.constexpr, BLOCK: tl.constexpr):
    # grid (n, num_layers * 2, cdiv(chunk_numel, BLOCK)); chunk = one [block_size, Hkv, D] slab
    i = tl.program_id(0)
    layer = (tl.program_id(1) // 2).to(tl.int64)  # layer * stride can pass 2**31
    kv = (tl.program_id(1) % 2).to(tl.int64)
    block_id = tl.load(ids_ptr + i).to(tl.int64)
    if IDS_ON_SRC:
        src_blk = block_id
        dst_blk = i.to(tl.int64)
    else:
        src_blk = i.to(tl.int64)
        dst_blk = block_id
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < chunk_numel
    src = src_ptr + src_blk * src_stride_blk + layer * src_stride_layer + kv * src_stride_kv
    dst = dst_ptr + dst_blk * dst_stride_blk + layer * dst_stride_layer + kv * dst_stride_kv
    x = tl.load(src + offs, mask=mask)
    tl.store(dst + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    tie_to_odd = ((r - x) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0)
    return tl.where(tie_to_odd, r - 1.0, r)


@triton.jit
def _quantize_kernel(src_ptr, data_ptr, scales_ptr, ids_ptr,
                     src_stride_blk, src_stride_layer, src_stride_kv,
                     data_stride_blk, data_stride_layer, data_stride_kv,
                     num_kv_heads, block_size, head_dim,
                     HAS_IDS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # grid (n, num_layers * 2, Hkv): tile [block_size, D] of one head -> int8 tile + one fp32 scale
    i = tl.program_id(0)
    layer = (tl.program_id(1) // 2).to(tl.int64)  # layer * stride can pass 2**31
    kv = (tl.program_id(1) % 2).to(tl.int64)
    h = tl.program_id(2)
    if HAS_IDS:
        src_blk = tl.load(ids_ptr + i).to(tl.int64)
    else:
        src_blk = i.to(tl.int64)
    s = tl.arange(0, BLOCK_S)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (s < block_size) & (d < head_dim)
    inner = s * (num_kv_heads * head_dim) + h * head_dim + d  # [BLOCK_S, BLOCK_D]
    src = src_ptr + src_blk * src_stride_blk + layer * src_stride_layer + kv * src_stride_kv
    x = tl.load(src + inner, mask=mask, other=0.0).to(tl.float32)
    scale = tl.max(tl.max(tl.abs(x), axis=1), axis=0) / 127.0
    inv = tl.where(scale > 0.0, 1.0 / tl.where(scale > 0.0, scale, 1.0), 0.0)  # all-zero head -> q = 0
    q = tl.minimum(tl.maximum(_round_half_even(x * inv), -127.0), 127.0)
    dst = data_ptr + i.to(tl.int64) * data_stride_blk + layer * data_stride_layer + kv * data_stride_kv
    tl.store(dst + inner, q.to(tl.int8), mask=mask)
    tl.store(scales_ptr + ((i.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * num_kv_heads + h), scale)


@triton.jit
def _dequantize_kernel(data_ptr, scales_ptr, dst_ptr, ids_ptr,
                       data_stride_blk, data_stride_layer, data_stride_kv,
                       dst_stride_blk, dst_stride_layer, dst_stride_kv,
                       num_kv_heads, block_size, head_dim,
                       HAS_IDS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # grid (n, num_layers * 2, Hkv): int8 tile [block_size, D] * scale -> dst (staging or cache block ids[i])
    i = tl.program_id(0)
    layer = (tl.program_id(1) // 2).to(tl.int64)  # layer * stride can pass 2**31
    kv = (tl.program_id(1) % 2).to(tl.int64)
    h = tl.program_id(2)
    if HAS_IDS:
        dst_blk = tl.load(ids_ptr + i).to(tl.int64)
    else:
        dst_blk = i.to(tl.int64)
    s = tl.arange(0, BLOCK_S)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (s < block_size) & (d < head_dim)
    inner = s * (num_kv_heads * head_dim) + h * head_dim + d
    src = data_ptr + i.to(tl.int64) * data_stride_blk + layer * data_stride_layer + kv * data_stride_kv
    scale = tl.load(scales_ptr + ((i.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * num_kv_heads + h))
    x = tl.load(src + inner, mask=mask, other=0).to(tl.float32) * scale
    dst = dst_ptr + dst_blk * dst_stride_blk + layer * dst_stride_layer + kv * dst_stride_kv
    tl.store(dst + inner, x.to(dst_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------ launchers
def _check_cache(kv_cache: torch.Tensor) -> None:
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
    check_tensor("kv_cache", kv_cache, ndim=6, dtypes=STORAGE_DTYPES)
    if kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache dim 1 must be 2 (K, V), got shape {tuple(kv_cache.shape)}")
    check_inner_contiguous("kv_cache", kv_cache, 3)


def _check_ids(block_ids: torch.Tensor, device: torch.device) -> None:
    check_tensor("block_ids", block_ids, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if block_ids.numel() > 1 and block_ids.stride(0) != 1:
        raise ValueError("block_ids must be contiguous")


def _check_staging(name: str, staging: torch.Tensor, kv_cache: torch.Tensor | None, n: int | None,
                   dtypes: tuple) -> None:
    # staging: [n, L, 2, block_size, Hkv, D]
    check_tensor(name, staging, ndim=6, dtypes=dtypes)
    if kv_cache is not None:
        num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        check_tensor(name, staging, shape=(n, num_layers, 2, block_size, num_kv_heads, head_dim),
                     device=kv_cache.device)
    elif staging.shape[2] != 2:
        raise ValueError(f"{name} dim 2 must be 2 (K, V), got shape {tuple(staging.shape)}")
    check_inner_contiguous(name, staging, 3)


def _staging_strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _cache_strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(2), t.stride(0), t.stride(1)  # (block, layer, kv)


def gather_blocks_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]; block_ids: [n] -> staging [n, L, 2, block_size, Hkv, D]
    # (into `out`, contiguous and of that shape, when given: e.g. pinned or pooled memory reused across transfers)
    _check_cache(kv_cache)
    _check_ids(block_ids, kv_cache.device)
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    n = block_ids.shape[0]
    if out is None:
        staging = torch.empty((n, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=kv_cache.dtype,
                              device=kv_cache.device)
    else:
        check_gather_out(out, kv_cache, n)
        staging = out
    chunk = block_size * num_kv_heads * head_dim
    if n:
        _copy_chunks_kernel[(n, num_layers * 2, triton.cdiv(chunk, COPY_BLOCK))](
            kv_cache, staging, block_ids, chunk, *_cache_strides(kv_cache), *_staging_strides(staging),
            IDS_ON_SRC=True, BLOCK=COPY_BLOCK)
    return staging


def scatter_blocks_triton(staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    # staging: [n, L, 2, block_size, Hkv, D] -> kv_cache[:, :, block_ids[i]] for each i
    _check_cache(kv_cache)
    _check_ids(block_ids, kv_cache.device)
    n = block_ids.shape[0]
    _check_staging("staging", staging, kv_cache, n, STORAGE_DTYPES)
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    chunk = block_size * num_kv_heads * head_dim
    if n:
        _copy_chunks_kernel[(n, num_layers * 2, triton.cdiv(chunk, COPY_BLOCK))](
            staging, kv_cache, block_ids, chunk, *_staging_strides(staging), *_cache_strides(kv_cache),
            IDS_ON_SRC=False, BLOCK=COPY_BLOCK)


def _launch_quantize(src: torch.Tensor, src_strides: tuple, ids: torch.Tensor | None, n: int, num_layers: int,
                     block_size: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.empty((n, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=torch.int8, device=src.device)
    scales = torch.empty((n, num_layers, 2, num_kv_heads), dtype=torch.float32, device=src.device)
    if n:
        _quantize_kernel[(n, num_layers * 2, num_kv_heads)](
            src, data, scales, ids if ids is not None else scales, *src_strides, *_staging_strides(data),
            num_kv_heads, block_size, head_dim,
            HAS_IDS=ids is not None, BLOCK_S=next_pow2(block_size), BLOCK_D=next_pow2(head_dim))
    return data, scales


def quantize_blocks_int8_triton(staging: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # staging: [n, L, 2, block_size, Hkv, D] -> data int8 same shape, scales fp32 [n, L, 2, Hkv]
    _check_staging("staging", staging, None, None, STORAGE_DTYPES)
    n, num_layers, _, block_size, num_kv_heads, head_dim = staging.shape
    return _launch_quantize(staging, _staging_strides(staging), None, n, num_layers, block_size, num_kv_heads,
                            head_dim)


def gather_blocks_int8_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused gather + quantize: reads each cache block once, writes only int8 + scales."""
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]; block_ids: [n]
    _check_cache(kv_cache)
    _check_ids(block_ids, kv_cache.device)
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return _launch_quantize(kv_cache, _cache_strides(kv_cache), block_ids, block_ids.shape[0], num_layers,
                            block_size, num_kv_heads, head_dim)


def _check_int8(data: torch.Tensor, scales: torch.Tensor) -> None:
    _check_staging("data", data, None, None, (torch.int8,))
    n, num_layers, _, _, num_kv_heads, _ = data.shape
    check_tensor("scales", scales, shape=(n, num_layers, 2, num_kv_heads), dtypes=(torch.float32,),
                 device=data.device)
    if not scales.is_contiguous():
        raise ValueError("scales must be contiguous")


def dequantize_blocks_int8_triton(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # data: [n, L, 2, block_size, Hkv, D] int8; scales: [n, L, 2, Hkv] fp32 -> [n, L, 2, block_size, Hkv, D] dtype
    _check_int8(data, scales)
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype must be one of {STORAGE_DTYPES}, got {dtype}")
    n, num_layers, _, block_size, num_kv_heads, head_dim = data.shape
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    if n:
        _dequantize_kernel[(n, num_layers * 2, num_kv_heads)](
            data, scales, out, scales, *_staging_strides(data), *_staging_strides(out),
            num_kv_heads, block_size, head_dim,
            HAS_IDS=False, BLOCK_S=next_pow2(block_size), BLOCK_D=next_pow2(head_dim))
    return out


def scatter_blocks_int8_triton(data: torch.Tensor, scales: torch.Tensor, kv_cache: torch.Tensor,
                               block_ids: torch.Tensor) -> None:
    """Fused dequantize + scatter into cache blocks block_ids."""
    # data: [n, L, 2, block_size, Hkv, D] int8; scales: [n, L, 2, Hkv]; kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
    _check_cache(kv_cache)
    _check_ids(block_ids, kv_cache.device)
    n = block_ids.shape[0]
    _check_staging("data", data, kv_cache, n, (torch.int8,))
    _check_int8(data, scales)
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if n:
        _dequantize_kernel[(n, num_layers * 2, num_kv_heads)](
            data, scales, kv_cache, block_ids, *_staging_strides(data), *_cache_strides(kv_cache),
            num_kv_heads, block_size, head_dim,
            HAS_IDS=True, BLOCK_S=next_pow2(block_size), BLOCK_D=next_pow2(head_dim))
