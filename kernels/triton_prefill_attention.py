"""Triton varlen causal attention over paged KV: prefill with cached prefixes, chunked prefill, mixed batches.

One program per (sequence, tile of BLOCK_Q new tokens, kv head). Its rows are the BLOCK_Q tokens x the group's
query heads (row r = token r // BLOCK_G, head r % BLOCK_G), so a K/V tile serves the whole group at once. New token
i of sequence b sits at position seq_lens[b] - q_len_b + i and sees positions <= its own; the K/V loop stops at the
tile's last visible position. Sequences with q_len 0 exit at once. With a sliding window W (window > 0) a row at
position p also needs position > p - W, and the K/V loop starts at the tile's first row's window. SOFTCAP turns
each scaled score s into c * tanh(s / c) before the softmax.
Reference: kernels.reference.paged_attention_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import INDEX_DTYPES, STORAGE_DTYPES, check_last_dim_contiguous, check_tensor, next_pow2
from kernels.triton_decode_attention import check_window, softcap_args, tanh



@triton.jit
def _prefill_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
                              scale_log2, softcap_scale, softcap_log2, window,
                              stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                              stride_vb, stride_vs, stride_vh, stride_bt, stride_ot, stride_oh,
                              group, head_dim, block_size, SOFTCAP: tl.constexpr,
                              BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # grid (B, cdiv(max_q_len, BLOCK_Q), Hkv). q: [Nq, Hq, D]; k/v_cache: [num_blocks, block_size, Hkv, D]
    # rows: BLOCK_M = BLOCK_Q * BLOCK_G
    b = tl.program_id(0).to(tl.int64)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = (tl.load(qsl_ptr + b + 1) - q_start).to(tl.int32)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    context_len = seq_len - q_len  # tokens cached before this step's new ones

    r = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + r // BLOCK_G  # [BLOCK_M] index among the new tokens
    g = r % BLOCK_G
    heads = kv_head * group + g
    row_mask = (tok < q_len) & (g < group)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_rows = (q_start + tok) * stride_qt + heads * stride_qh  # [BLOCK_M]
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :],
                other=0.0)  # [BLOCK_M, BLOCK_D]
    q_pos = context_len + tok  # [BLOCK_M] absolute position

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + b * stride_bt
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)  # last visible position + 1
    # first position any row of the tile sees; rows see positions > lo_row
    kv_start = tl.where(window > 0, tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0), 0)
    lo_row = tl.where(window > 0, q_pos - window, -1)  # [BLOCK_M]
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        p_mask = pos < kv_end
        phys = tl.load(table + pos // block_size, mask=p_mask, other=0).to(tl.int64)
        slot_k = phys * stride_kb + (pos % block_size) * stride_ks + kv_head * stride_kh  # [BLOCK_N]
        slot_v = phys * stride_vb + (pos % block_size) * stride_vs + kv_head * stride_vh
        k = tl.load(k_cache_ptr + slot_k[None, :] + d[:, None],
                    mask=p_mask[None, :] & d_mask[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        if SOFTCAP:
            s = tanh(tl.dot(q, k, input_precision="ieee") * softcap_scale) * softcap_log2
        else:
            s = tl.dot(q, k, input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N] fp32, log2 units
        visible = p_mask[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > lo_row[:, None])
        s = tl.where(visible, s, float("-inf"))
        # Without a window position 0 is visible to every row, so m_new is finite; with one, a row may see
        # nothing in the tile's first K/V tiles: subtract 0 then (every p is 0 and the empty state stays empty).
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + slot_v[:, None] + d[None, :],
                    mask=p_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    out_rows = (q_start + tok) * stride_ot + heads * stride_oh
    tl.store(out_ptr + out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def default_block_m(head_dim: int, device: torch.device) -> int:
    """Rows (tokens x group heads) per program: smaller tiles under the CPU interpreter keep tests fast."""
    return (64 if head_dim <= 64 else 32) * (2 if device.type == "cuda" else 1)


def prefill_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                             scale: float, *, sliding_window: int | None = None, softcap: float | None = None,
                             max_query_len: int | None = None, block_m: int | None = None,
                             block_n: int | None = None) -> torch.Tensor:
    """Same semantics as paged_attention. max_query_len (host int, upper bound) sizes the grid; computed with a
    device sync when omitted. block_m / block_n override the tile sizes (rows = tokens x group heads)."""
    # query: [Nq, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]
    # block_tables: [B, max_blocks_per_seq]; seq_lens: [B]; query_start_loc: [B+1] -> out [Nq, Hq, D]
    check_tensor("k_cache", k_cache, ndim=4, dtypes=STORAGE_DTYPES)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,), device=device)
    check_tensor("query", query, shape=(None, None, head_dim), dtypes=(k_cache.dtype,), device=device)
    num_heads = query.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    batch = seq_lens.shape[0]
    check_tensor("block_tables", block_tables, shape=(batch, None), dtypes=INDEX_DTYPES, device=device)
    check_tensor("query_start_loc", query_start_loc, shape=(batch + 1,), dtypes=INDEX_DTYPES, device=device)
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    out = torch.empty_like(query)
    if query.shape[0] == 0 or batch == 0:
        return out
    window = check_window(sliding_window)
    scale_log2, softcap_scale, softcap_log2, has_softcap = softcap_args(scale, softcap)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    block_g = next_pow2(group)
    block_m = block_m or default_block_m(head_dim, device)
    block_q = max(1, max(16, block_m) // block_g)  # rows = block_q * block_g >= 16 for tl.dot
    block_n = block_n or (64 if head_dim <= 64 else 32)
    grid = (batch, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_attention_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale_log2, softcap_scale,
        softcap_log2, window, query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), group, head_dim, block_size, SOFTCAP=has_softcap,
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_M=block_q * block_g, BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(head_dim)), num_warps=4)
    return out
