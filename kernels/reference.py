"""Pure-torch reference of every kernel; also the CPU production path of the engine.

Each function here defines the semantics its Triton twin is tested against, so it favours clarity, but it is
vectorized (no per-token Python loops) because the CPU engine runs on it. Numerics: every reduction (softmax,
RMS, rotary products, int8 scales) is computed in fp32; results are stored in the storage dtype.

Layouts (one KV tensor per worker):
    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    k_cache = kv_cache[l, 0], v_cache = kv_cache[l, 1]: [num_blocks, block_size, num_kv_heads, head_dim]
    slot of a token = block_id * block_size + offset_in_block
    staging (wire format): [n, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._checks import check_gather_out

INT8_MAX = 127.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------------- KV write
def write_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V at its slot; slot -1 marks padding and is skipped."""
    # key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64
    # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], blocks and offsets one flat slot axis
    valid = slot_mapping >= 0  # [num_tokens] bool
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))  # [slots, Hkv, D]
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


# --------------------------------------------------------------------------------------------------- attention
def _gather_seq_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Contiguous [seq_len, num_kv_heads, head_dim] fp32 copy of one sequence's K or V."""
    # cache: [num_blocks, block_size, num_kv_heads, head_dim]; block_table_row: [max_blocks_per_seq]
    num_blocks_seq = _cdiv(seq_len, cache.shape[1])
    blocks = cache.index_select(0, block_table_row[:num_blocks_seq].long())  # [nb, block_size, Hkv, D]
    return blocks.flatten(0, 1)[:seq_len].float()  # [seq_len, Hkv, D]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v, all fp32; with `softcap` the scores s become softcap * tanh(s / softcap)
    before the mask (transformers' Gemma 2 order), which SDPA cannot express, so that case is written out."""
    # q: [..., M, D]; k, v: [..., N, D]; mask: broadcastable to [..., M, N] bool (True = visible) or None
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap  # [..., M, N]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _decode_attention_batched(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                              scale: float, sliding_window: int | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence: gather K/V padded to max_seq_len, mask by length (and window), one SDPA call.

    A batch of one takes the same path: with a mask, torch's CPU flash kernel gives a row the same bits whatever
    the padding and the other rows (on one thread; tested), where an unmasked call over the exact length rounds
    differently. So a sequence's attention does not depend on the batch it decodes in."""
    # query: [n, Hq, D]; block_tables: [n, max_blocks]; seq_lens: [n] (each >= 1)
    n, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_blocks_max = _cdiv(max_seq_len, block_size)
    seq_lens = seq_lens.to(torch.long)
    # Table entries past a sequence's last block are padding with any value: point them at block 0.
    blocks_used = torch.div(seq_lens + block_size - 1, block_size, rounding_mode="floor")  # [n]
    if sliding_window is None:
        first = torch.zeros_like(seq_lens)
        block_ids = block_tables[:, :num_blocks_max].long()  # [n, nb]
        in_use = torch.arange(num_blocks_max, device=query.device)[None, :] < blocks_used[:, None]  # [n, nb]
    else:
        # Only the blocks that hold a visible position: from each sequence's first visible block on.
        first = torch.div(seq_lens - sliding_window, block_size, rounding_mode="floor").clamp_(min=0)  # [n]
        num_blocks_max = min(num_blocks_max, _cdiv(sliding_window - 1, block_size) + 1)
        cols = first[:, None] + torch.arange(num_blocks_max, device=query.device)[None, :]  # [n, nb]
        in_use = cols < blocks_used[:, None]
        block_ids = block_tables.long().gather(1, cols.clamp(max=block_tables.shape[1] - 1))
    block_ids = torch.where(in_use, block_ids, torch.zeros_like(block_ids))
    padded_len = num_blocks_max * block_size
    # k_cache[block_ids]: [n, nb, block_size, Hkv, D] -> [n, Hkv, padded_len, D]
    # (index_select on the flat ids: the same copy as k_cache[block_ids], with less per-call overhead)
    flat_ids = block_ids.flatten()  # [n * nb]
    k = k_cache.index_select(0, flat_ids).view(n, padded_len, num_kv_heads, head_dim).transpose(1, 2).float()
    v = v_cache.index_select(0, flat_ids).view(n, padded_len, num_kv_heads, head_dim).transpose(1, 2).float()
    # GQA without copying K/V per query head: the `group` query heads of a kv head act as `group` query rows.
    q = query.view(n, num_kv_heads, group, head_dim).float()  # [n, Hkv, G, D]
    kv_pos = first[:, None] * block_size + torch.arange(padded_len, device=query.device)[None, :]  # [n, padded]
    mask = kv_pos < seq_lens[:, None]  # [n, padded_len]
    if sliding_window is not None:
        mask &= kv_pos >= seq_lens[:, None] - sliding_window
    out = _attend(q, k, v, mask[:, None, None, :], scale, softcap)  # [n, Hkv, G, D]
    return out.reshape(n, num_heads, head_dim)


def _first_visible_block(seq_len: int, q_len: int, sliding_window: int | None, block_size: int) -> int:
    """Index in the block table of the first block any of the q_len last tokens sees (0 without a window)."""
    if sliding_window is None:
        return 0
    return max(0, seq_len - q_len - sliding_window + 1) // block_size


def _prefill_attention_one(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of q_len new tokens that sit at the end of a contiguous K/V (with a window, K/V may
    start at any position before the first token's window: only its length up to the last token matters)."""
    # query: [q_len, Hq, D]; k, v: [seq_len, Hkv, D] fp32 (seq_len counted from K/V's first position)
    q_len, num_heads, head_dim = query.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # Fold each kv group's query heads into the row axis: [Hkv, G * q_len, D]; K/V stay [Hkv, seq_len, D].
    q = query.float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(
        num_kv_heads, group * q_len, head_dim)
    rows = torch.arange(q_len, device=query.device) + (seq_len - q_len)  # absolute position of each query
    kv_pos = torch.arange(seq_len, device=query.device)[None, :]
    mask = kv_pos <= rows[:, None]  # [q_len, seq_len]
    if sliding_window is not None:
        mask &= kv_pos > rows[:, None] - sliding_window
    # 4-D operands: torch's CPU flash kernel (3-D ones take its math path, ~3.5x slower at 512 tokens)
    out = _attend(q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask.repeat(group, 1), scale,
                  softcap)[0]  # [Hkv, G*q_len, D]
    return out.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float, sliding_window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """Varlen causal attention over paged KV (GQA/MQA); new tokens of seq b end at position seq_lens[b]-1.

    With `sliding_window` W a token at position p sees positions p - W + 1 .. p only; with `softcap` c the
    scores s (already scaled) become c * tanh(s / c) before the softmax.
    Sequences whose new tokens are all single (decode) run as one padded batch; the rest (prefill, prefix
    hits, chunks) run one sequence at a time. Sequences with no new tokens are skipped.
    """
    # query: [num_query_tokens, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]
    # block_tables: [B, max_blocks_per_seq] int32; seq_lens: [B] int32; query_start_loc: [B+1] int32
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    num_query_tokens = query.shape[0]
    out = torch.empty_like(query)  # [num_query_tokens, Hq, D]
    if num_query_tokens == 0:
        return out
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    for b, (q_len, seq_len) in enumerate(zip(q_lens, lens)):
        if q_len > seq_len or q_len < 0:
            raise ValueError(f"sequence {b}: query length {q_len} not in [0, seq_len={seq_len}]")
    decode_ids = [b for b, q_len in enumerate(q_lens) if q_len == 1]
    if decode_ids and len(decode_ids) == len(lens) == num_query_tokens:
        # Only decode tokens, one per sequence in order: query and output rows are the sequences themselves.
        return _decode_attention_batched(query, k_cache, v_cache, block_tables, seq_lens, max(lens),
                                         scale, sliding_window, softcap).to(query.dtype)
    if decode_ids:
        if len(decode_ids) == len(lens):
            rows, tables, dec_lens = query_start_loc[:-1].long(), block_tables, seq_lens
        else:
            sel = torch.tensor(decode_ids, device=query.device)
            rows = query_start_loc[:-1].long()[sel]
            tables, dec_lens = block_tables[sel], seq_lens[sel]
        max_len = max(lens[b] for b in decode_ids)
        out[rows] = _decode_attention_batched(query[rows], k_cache, v_cache, tables, dec_lens, max_len,
                                              scale, sliding_window, softcap).to(query.dtype)
    for b, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        # blocks wholly before the window are never read (they may be freed)
        first = _first_visible_block(lens[b], q_len, sliding_window, k_cache.shape[1])
        visible_len = lens[b] - first * k_cache.shape[1]
        k = _gather_seq_kv(k_cache, block_tables[b, first:], visible_len)  # [visible_len, Hkv, D]
        v = _gather_seq_kv(v_cache, block_tables[b, first:], visible_len)
        out[starts[b]:starts[b + 1]] = _prefill_attention_one(query[starts[b]:starts[b + 1]], k, v,
                                                              scale, sliding_window, softcap).to(query.dtype)
    return out


# --------------------------------------------------------------------------------------------------- norm, rope
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm in fp32; with `residual`, normalizes x + residual and also returns that sum (in x.dtype)."""
    # x, residual: [T, H]; weight: [H]
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)  # the new residual stream, as stored
    # x * rsqrt(mean(x^2) + eps) * weight, as one op (.float() and .to() are no-ops in fp32)
    normed = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    return normed if residual is None else (normed, x)


def _rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    # x: [T, heads, head_dim]; cos, sin: [T, 1, rot_dim // 2] fp32
    half = cos.shape[-1]
    x1 = x[..., :half]
    x2 = x[..., half:2 * half]
    x1f, x2f = x1.float(), x2.float()
    out1 = x1f * cos - x2f * sin
    out2 = torch.addcmul(x2f * cos, x1f, sin)  # x2 * cos + x1 * sin
    x1.copy_(out1)
    x2.copy_(out2)


def rotary_embedding_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> None:
    """NeoX / HF rotate_half RoPE, in place on query and key. rot_dim = cos_sin_cache.shape[1] (<= head_dim)."""
    # positions: [T] int64; query: [T, Hq, D]; key: [T, Hkv, D]; cos_sin_cache: [max_position, rot_dim] fp32
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions.long()).float()  # [T, rot_dim]
    cos = cos_sin[:, None, :half]  # [T, 1, rot_dim/2]
    sin = cos_sin[:, None, half:]
    _rotate_in_place(query, cos, sin)
    _rotate_in_place(key, cos, sin)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up projection (the first half of the last dim is the gate)."""
    # gate_up: [T, 2 * I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def top_k_indices_ref(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values of each row of x [M, N] -> [M, k] int64, in no promised order (the
    candidates an LM head recomputes exactly: engine.quant.Int8Linear.logits)."""
    return x.topk(k, dim=-1).indices


def recompute_logits_int8_ref(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                              bias: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """out[m, n] <- x[m] . (qweight[n] * scale[n]) + bias[n] in float32 for each n in ids[m] ([M, k] int64): an int8
    LM head's candidates (top_k_indices of its rounded logits out [M, N]) recomputed as its dequantize + GEMM path
    computes every logit; the other entries of out stay as they are. Each row on its own (products summed along
    K row by row, not a bmm whose rounding depends on M). Returns out."""
    flat = ids.flatten()
    rows = (qweight[flat].float() * scale.float()[flat, None]).view(*ids.shape, -1)    # [M, k, K]
    exact = (rows * x.float()[:, None, :]).sum(-1)                                     # [M, k]
    if bias is not None:
        exact += bias.float()[ids]
    return out.scatter_(1, ids, exact)


# --------------------------------------------------------------------------------------------------- blocks
def gather_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the given blocks of every layer into one contiguous staging buffer (the wire format). With `out`
    (a contiguous [n, L, 2, block_size, Hkv, D] tensor of the cache dtype, e.g. a view of a pooled shared-memory
    segment) the blocks land there and `out` is returned: no allocation, no first-touch page faults."""
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]; block_ids: [n] int64
    # Selecting along the block axis moved to the front copies once, straight into the staging layout.
    by_block = kv_cache.permute(2, 0, 1, 3, 4, 5)  # [num_blocks, L, 2, block_size, Hkv, D], a view
    if out is None:
        return by_block[block_ids.long()]  # [n, L, 2, block_size, Hkv, D]
    check_gather_out(out, kv_cache, block_ids.shape[0])
    return torch.index_select(by_block, 0, block_ids.long(), out=out)


def scatter_blocks_ref(staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Inverse of gather_blocks: write staging block i into cache block block_ids[i] of every layer."""
    # staging: [n, L, 2, block_size, Hkv, D]; kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
    # One copy per block (a [L, 2, block_size, Hkv, D] slab of contiguous chunks): about 1.5x faster on CPU than
    # index_copy_ through the permuted view, and it reads staging (e.g. a mapped segment) in order.
    by_block = kv_cache.permute(2, 0, 1, 3, 4, 5)  # [num_blocks, L, 2, block_size, Hkv, D], a view
    for i, block_id in enumerate(block_ids.tolist()):
        by_block[block_id].copy_(staging[i])


def quantize_blocks_int8_ref(staging: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per (block, layer, K/V, kv head): scale = absmax / 127, q = round_half_even(x / scale)."""
    # staging: [n, L, 2, block_size, Hkv, D] -> data int8 same shape, scales fp32 [n, L, 2, Hkv]
    x = staging.float()
    scales = x.abs().amax(dim=(3, 5)) / INT8_MAX  # [n, L, 2, Hkv]
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))  # all-zero head -> q = 0
    data = torch.round(x * inv[:, :, :, None, :, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return data, scales


def dequantize_blocks_int8_ref(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_blocks_int8: data * scale, in `dtype`."""
    # data: [n, L, 2, block_size, Hkv, D] int8; scales: [n, L, 2, Hkv] fp32
    return (data.float() * scales[:, :, :, None, :, None]).to(dtype)


def gather_blocks_int8_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_blocks then quantize_blocks_int8 (the Triton twin fuses them: cache blocks read once)."""
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D] -> (int8 [n, L, 2, block_size, Hkv, D], fp32 [n, L, 2, Hkv])
    return quantize_blocks_int8_ref(gather_blocks_ref(kv_cache, block_ids))


def scatter_blocks_int8_ref(data: torch.Tensor, scales: torch.Tensor, kv_cache: torch.Tensor,
                            block_ids: torch.Tensor) -> None:
    """dequantize_blocks_int8 then scatter_blocks, in kv_cache's dtype."""
    # data: [n, L, 2, block_size, Hkv, D] int8; scales: [n, L, 2, Hkv]
    scatter_blocks_ref(dequantize_blocks_int8_ref(data, scales, kv_cache.dtype), kv_cache, block_ids)


def gptq_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  g_idx: torch.Tensor, bits: int, zero_offset: int) -> torch.Tensor:
    """x @ W.T over a GPTQ-packed W (engine.gptq_format): W[j, i] = (q[i, j] - z[g_idx[i], j]) * scales[g_idx[i], j]
    with z the qzeros field + zero_offset (1 for checkpoint_format gptq, 0 for gptq_v2). fp32 accumulation, the
    result in x.dtype; W is rounded to x.dtype before the product, as the Triton kernel feeds tl.dot."""
    # x: [M, K]; qweight: int32 [K // p, N]; qzeros: int32 [G, N // p]; scales: [G, N]; g_idx: [K] -> [M, N]
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    mask = (1 << bits) - 1
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, qweight.shape[1])        # [K, N]
    z = ((qzeros[:, :, None] >> shifts[None, None, :]) & mask).reshape(qzeros.shape[0], -1) + zero_offset  # [G, N]
    g = g_idx.long()
    w = ((q - z[g]).float() * scales[g].float()).to(x.dtype)                                         # [K, N]
    return (x.float() @ w.float()).to(x.dtype)
