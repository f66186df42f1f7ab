"""Triton reshape-and-cache: store each new token's K/V at its slot of the paged cache (slot -1 = skip).

Reference: kernels.reference.write_kv_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import INDEX_DTYPES, STORAGE_DTYPES, check_last_dim_contiguous, check_tensor, next_pow2


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
                     num_kv_heads, head_dim, block_size,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program per token: key[t]: [Hkv, D] -> k_cache[slot // block_size, slot % block_size]: [Hkv, D]
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block_id * stride_kc_b + offset * stride_kc_s + h * stride_kc_h + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block_id * stride_vc_b + offset * stride_vc_s + h * stride_vc_h + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    # key, value: [num_tokens, Hkv, D] (any token/head strides, dense last dim)
    # k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot_mapping: [num_tokens] int32/int64, -1 = skip
    check_tensor("k_cache", k_cache, ndim=4, dtypes=STORAGE_DTYPES)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,), device=device)
    check_tensor("key", key, shape=(None, num_kv_heads, head_dim), dtypes=STORAGE_DTYPES, device=device)
    num_tokens = key.shape[0]
    check_tensor("value", value, shape=(num_tokens, num_kv_heads, head_dim), dtypes=STORAGE_DTYPES, device=device)
    check_tensor("slot_mapping", slot_mapping, shape=(num_tokens,), dtypes=INDEX_DTYPES, device=device)
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_dim, block_size,
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim))
