"""Builders for paged-KV test cases and the naive dense attention they are checked against."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    query: torch.Tensor  # [num_query_tokens, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D] (what the cache holds, contiguous)
    values: list[torch.Tensor]
    q_lens: list[int]
    scale: float


def make_paged_case(seq_lens: list[int], q_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                    block_size: int, dtype=torch.float32, device="cpu", pad_value: int = -1,
                    extra_blocks: int = 3) -> PagedCase:
    """Random K/V per sequence written into shuffled physical blocks; block-table padding set to pad_value."""
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    max_blocks = max(blocks_per_seq + [1]) + 1  # one spare column of padding
    perm = torch.randperm(num_blocks).tolist()
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32).to(dtype)
    block_tables = torch.full((len(seq_lens), max_blocks), pad_value, dtype=torch.int32)
    keys, values = [], []
    for b, seq_len in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(blocks_per_seq[b])]
        block_tables[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
        for t in range(seq_len):
            k_cache[ids[t // block_size], t % block_size] = k[t]
            v_cache[ids[t // block_size], t % block_size] = v[t]
        keys.append(k)
        values.append(v)
    query = torch.randn(sum(q_lens), num_heads, head_dim).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    return PagedCase(query.to(device), k_cache.to(device), v_cache.to(device), block_tables.to(device),
                     torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl.to(device),
                     keys, values, list(q_lens), head_dim ** -0.5)


def naive_attention(case: PagedCase) -> torch.Tensor:
    """Dense causal attention per sequence in fp64, K/V repeated per query head."""
    num_heads = case.query.shape[1]
    out = torch.zeros(case.query.shape, dtype=torch.float64)
    start = 0
    for k, v, q_len in zip(case.keys, case.values, case.q_lens):
        seq_len = k.shape[0]
        group = num_heads // k.shape[1]
        q = case.query[start:start + q_len].cpu().double()  # [q_len, Hq, D]
        kk = k.double().repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * case.scale  # [Hq, q_len, seq_len]
        pos = torch.arange(q_len) + seq_len - q_len
        scores.masked_fill_(torch.arange(seq_len)[None, :] > pos[:, None], float("-inf"))
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
        start += q_len
    return out


def make_cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [max_pos, rot/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_pos, rot_dim]
