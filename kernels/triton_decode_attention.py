"""Triton paged decode attention: one query token per sequence, GQA/MQA, split-K (flash-decoding).

One program per (sequence, kv head, split): it loads the group's query heads as the rows of a [BLOCK_G, D] tile
(padded to 16 rows for tl.dot), so each K/V tile is read once per kv head, not once per query head. Long contexts
are cut into `num_splits` ranges per sequence; each split writes a normalized partial output and its log-sum-exp
(base 2), and a second kernel merges them. With one split the first kernel writes the output directly.
A sliding window W (window > 0) starts the range at seq_len - W: blocks before it are never read. A softcap c
(SOFTCAP) turns each scaled score s into c * tanh(s / c) before the softmax.
Reference: kernels.reference.paged_attention_ref (decode rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import INDEX_DTYPES, STORAGE_DTYPES, check_last_dim_contiguous, check_tensor, next_pow2

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


@triton.jit
def tanh(x):
    """tanh from exp2 of -2|x| (no overflow, full precision near 0 and at the tails)."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


def softcap_args(scale: float, softcap: float | None) -> tuple[float, float, float, bool]:
    """(scale_log2, softcap_scale, softcap_log2, SOFTCAP) as the attention kernels take them: without a softcap
    scores are dot * scale_log2; with one, tanh(dot * softcap_scale) * softcap_log2 (log2 units)."""
    if softcap is None:
        return float(scale) * LOG2E, 0.0, 0.0, False
    if softcap <= 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    return float(scale) * LOG2E, float(scale) / softcap, float(softcap) * LOG2E, True


def check_window(sliding_window: int | None) -> int:
    """The kernels' `window` argument: 0 for none."""
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    return int(sliding_window)


@triton.jit
def _decode_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                             out_ptr, part_out_ptr, part_lse_ptr, scale_log2, softcap_scale, softcap_log2,
                             window, num_splits,
                             stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                             stride_vb, stride_vs, stride_vh, stride_bt, stride_ot, stride_oh,
                             num_heads, group, head_dim, block_size,
                             SINGLE_SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_G: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # grid (B, Hkv, num_splits). q[b]: [Hq, D]; k/v_cache: [num_blocks, block_size, Hkv, D]
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # first visible position
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - lo, BLOCK_N), num_splits)
    start = lo + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g  # [BLOCK_G] query heads of this kv head
    g_mask = g < group
    d_mask = d < head_dim
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + b * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        phys = tl.load(table + pos // block_size, mask=p_mask, other=0).to(tl.int64)
        slot_k = phys * stride_kb + (pos % block_size) * stride_ks + kv_head * stride_kh  # [BLOCK_N]
        slot_v = phys * stride_vb + (pos % block_size) * stride_vs + kv_head * stride_vh
        k = tl.load(k_cache_ptr + slot_k[None, :] + d[:, None],
                    mask=p_mask[None, :] & d_mask[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        if SOFTCAP:
            s = tanh(tl.dot(q, k, input_precision="ieee") * softcap_scale) * softcap_log2
        else:
            s = tl.dot(q, k, input_precision="ieee") * scale_log2  # [BLOCK_G, BLOCK_N] fp32, log2 units
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + slot_v[:, None] + d[None, :],
                    mask=p_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    has_kv = l_sum > 0.0
    out = acc / tl.where(has_kv, l_sum, 1.0)[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # part_out: [B, Hq, num_splits, D] fp32; part_lse: [B, Hq, num_splits] fp32 (log2 units)
        row = (b * num_heads + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_out_ptr + row[:, None] * head_dim + d[None, :], out, mask=out_mask)
        lse = tl.where(has_kv, m + tl.log2(tl.where(has_kv, l_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_ot, stride_oh,
                         num_heads, head_dim, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # grid (B, Hq): out[b, h] = sum_s w_s * part_out[b, h, s] with w_s = softmax(lse)_s
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (b * num_heads + h) * num_splits
    lse = tl.load(part_lse_ptr + row + s, mask=s < num_splits, other=float("-inf"))  # [BLOCK_S]
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)  # empty splits -> 0
    parts = tl.load(part_out_ptr + (row + s[:, None]) * head_dim + d[None, :],
                    mask=(s[:, None] < num_splits) & (d[None, :] < head_dim), other=0.0)  # [BLOCK_S, BLOCK_D]
    w_sum = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(w_sum > 0.0, w_sum, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def _default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough programs to fill the GPU twice over, but at least MIN_TOKENS_PER_SPLIT tokens per split."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    wanted = triton.cdiv(2 * num_sms, max(1, batch * num_kv_heads))
    by_length = triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT)
    return next_pow2(max(1, min(wanted, by_length, MAX_SPLITS)))  # pow2: bounds the merge kernel's variants


def decode_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                            sliding_window: int | None = None, softcap: float | None = None,
                            max_seq_len: int | None = None, num_splits: int | None = None,
                            block_n: int | None = None) -> torch.Tensor:
    """Decode attention; query row b is sequence b's single new token (already written to the cache).
    sliding_window / softcap as in kernels.paged_attention.

    max_seq_len (upper bound, host int) only sizes the split count; without it the block-table width is used.
    num_splits / block_n override the heuristics (tests use them to force the split-K path).
    """
    # query: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]
    # block_tables: [B, max_blocks_per_seq] int32; seq_lens: [B] int32 (>= 1) -> out [B, Hq, D]
    check_tensor("k_cache", k_cache, ndim=4, dtypes=STORAGE_DTYPES)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,), device=device)
    check_tensor("query", query, shape=(None, None, head_dim), dtypes=(k_cache.dtype,), device=device)
    batch, num_heads, _ = query.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    check_tensor("block_tables", block_tables, shape=(batch, None), dtypes=INDEX_DTYPES, device=device)
    check_tensor("seq_lens", seq_lens, shape=(batch,), dtypes=INDEX_DTYPES, device=device)
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)
    if seq_lens.numel() > 1 and seq_lens.stride(0) != 1:
        raise ValueError("seq_lens must be contiguous")
    out = torch.empty_like(query)
    if batch == 0:
        return out
    window = check_window(sliding_window)
    scale_log2, softcap_scale, softcap_log2, has_softcap = softcap_args(scale, softcap)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if window:
        max_seq_len = min(max_seq_len, window)  # what one sequence reads
    if num_splits is None:
        num_splits = _default_num_splits(batch, num_kv_heads, max_seq_len, device)
    group = num_heads // num_kv_heads
    block_g = max(16, next_pow2(group))
    block_d = max(16, next_pow2(head_dim))
    if block_n is None:
        block_n = 64 if head_dim <= 64 else 32
    single = num_splits == 1
    if single:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    _decode_attention_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, scale_log2, softcap_scale,
        softcap_log2, window, num_splits,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), num_heads, group, head_dim, block_size,
        SINGLE_SPLIT=single, SOFTCAP=has_softcap, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4)
    if not single:
        _merge_splits_kernel[(batch, num_heads)](
            part_out, part_lse, out, num_splits, out.stride(0), out.stride(1), num_heads, head_dim,
            BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(head_dim))
    return out
