"""The native CPU small ops (kernels/cpu_ops.c) against the torch reference, on the default model's shapes (hidden
576, 9 query / 3 KV heads, head_dim 64, intermediate 1536) and the views engine.model passes them: differences
are float rounding order only; KV writes are exact; decode attention is batch and thread-count invariant."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from engine.rope import rope_cos_sin_cache
from kernels import cpu_ops, native_build
from kernels import reference as ref
from kvstore.block_pool import BlockPool

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK = 576, 9, 3, 64, 1536, 16
Q_SIZE, KV_SIZE = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler: native ops unavailable")


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


def qkv_views(num_tokens: int):
    """q [T, 9, 64], k and v [T, 3, 64]: views into one fused projection output, as DecoderModel._qkv makes."""
    qkv = torch.randn(num_tokens, Q_SIZE + 2 * KV_SIZE)
    return (qkv[:, :Q_SIZE].view(num_tokens, HEADS, HEAD_DIM),
            qkv[:, Q_SIZE:Q_SIZE + KV_SIZE].view(num_tokens, KV_HEADS, HEAD_DIM),
            qkv[:, Q_SIZE + KV_SIZE:].view(num_tokens, KV_HEADS, HEAD_DIM))


# --------------------------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_rms_norm_matches_reference(num_tokens):
    weight = torch.rand(HIDDEN) + 0.5
    x = torch.randn(num_tokens, HIDDEN) * 3
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-5), ref.rms_norm_ref(x, weight, 1e-5),
                               rtol=2e-6, atol=2e-6)
    residual = torch.randn(num_tokens, HIDDEN)
    normed, new_residual = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    want, want_residual = ref.rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, want_residual)  # one fp32 add either way
    torch.testing.assert_close(normed, want, rtol=2e-6, atol=2e-6)


def test_rms_norm_per_head_rows_and_strided_input():
    # qk_norm's [T * heads, head_dim] rows, and an x whose rows are a slice of a wider tensor
    weight = torch.rand(HEAD_DIM) + 0.5
    q, _, _ = qkv_views(5)
    rows = q.reshape(-1, HEAD_DIM)
    torch.testing.assert_close(cpu_ops.rms_norm(rows, weight, 1e-6), ref.rms_norm_ref(rows, weight, 1e-6),
                               rtol=2e-6, atol=2e-6)
    wide = torch.randn(3, HIDDEN + 64)[:, 7:7 + HIDDEN]
    assert not wide.is_contiguous()
    weight = torch.rand(HIDDEN)
    torch.testing.assert_close(cpu_ops.rms_norm(wide, weight, 1e-5), ref.rms_norm_ref(wide, weight, 1e-5),
                               rtol=2e-6, atol=2e-6)


def test_rms_norm_rejects_and_falls_back():
    x = torch.randn(2, HIDDEN)
    with pytest.raises(ValueError, match="weight"):
        cpu_ops.rms_norm(x, torch.ones(HIDDEN - 1), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        cpu_ops.rms_norm(x, torch.ones(HIDDEN), 1e-5, torch.randn(3, HIDDEN))
    xb = x.to(torch.bfloat16)  # a dtype the C code does not take: the reference, same results
    assert torch.equal(cpu_ops.rms_norm(xb, torch.ones(HIDDEN, dtype=torch.bfloat16), 1e-5),
                       ref.rms_norm_ref(xb, torch.ones(HIDDEN, dtype=torch.bfloat16), 1e-5))


# --------------------------------------------------------------------------------------------------- rotary
@pytest.mark.parametrize("rot_dim", [HEAD_DIM, 32])
def test_rotary_matches_reference_on_qkv_views(rot_dim):
    cache = rope_cos_sin_cache(rot_dim, 4096, 100000.0, None)
    q, k, _ = qkv_views(9)
    q2, k2 = q.clone(), k.clone()
    positions = torch.tensor([0, 1, 15, 16, 17, 511, 2047, 4000, 4095])
    cpu_ops.rotary_embedding(positions, q, k, cache)
    ref.rotary_embedding_ref(positions, q2, k2, cache)
    torch.testing.assert_close(q, q2, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(k, k2, rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="positions"):
        cpu_ops.rotary_embedding(torch.tensor([0, 4096, 1, 2, 3, 4, 5, 6, 7]), q, k, cache)


# --------------------------------------------------------------------------------------------------- KV write
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_is_exact_and_skips_padding(dtype):
    _, k, v = qkv_views(6)
    kv = torch.randn(2, 10, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    kv2 = kv.clone()
    slots = torch.tensor([0, 15, -1, 16, 159, 77])  # block boundaries, a padding slot, the last slot
    cpu_ops.write_kv(k, v, kv[0], kv[1], slots)
    ref.write_kv_ref(k, v, kv2[0], kv2[1], slots)
    assert torch.equal(kv, kv2)
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu_ops.write_kv(k, v, kv[0], kv[1], torch.tensor([0, 1, 2, 3, 4, 160]))
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu_ops.write_kv(k, v, kv[0], kv[1], torch.tensor([0, 1, 2, 3, 4, -2]))


def test_write_kv_rounds_to_bfloat16_as_torch_does_special_values_included():
    """The bfloat16 rows are written 8 values at a time: ties to even, infinities, subnormals and the largest
    values (which round up to infinity) as torch rounds them; a NaN stays a NaN (torch's own conversions disagree
    on its bits: 0x7FC0 scalar, 0xFFFF vectorized)."""
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40, -1e-40, 3.4e38, -3.4e38, 1.0 + 2 ** -8,
                            1.0 + 3 * 2 ** -8, 1.0 + 2 ** -8 + 2 ** -20, float("nan")])
    nans = torch.tensor([0x7FC00001, 0xFFC00000, 0x7F800001, 0xFF812345], dtype=torch.int64).to(torch.uint32)
    key = torch.randn(5, KV_HEADS, HEAD_DIM)
    key.view(-1)[:special.numel()] = special
    key.view(-1)[200:204] = nans.view(torch.float32)             # signalling and quiet NaNs with payloads
    value = -key
    kv = torch.zeros(2, 10, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    kv2 = kv.clone()
    slots = torch.tensor([3, 40, 41, 100, 159])
    cpu_ops.write_kv(key, value, kv[0], kv[1], slots)
    ref.write_kv_ref(key, value, kv2[0], kv2[1], slots)
    nan = kv2.isnan()
    assert nan.sum() == 2 * 5 and torch.equal(kv.isnan(), nan)
    assert torch.equal(kv.view(torch.int16)[~nan], kv2.view(torch.int16)[~nan])


# --------------------------------------------------------------------------------------------------- attention
def decode_case(seq_lens: list[int], dtype=torch.float32, extra_blocks: int = 4):
    """A decode step's attention inputs laid out as the engine lays them: blocks from a real BlockPool, tables
    padded with block 0 to the longest (ModelRunner.execute), K/V already written, query a view into qkv."""
    blocks_per_seq = [-(-n // BLOCK) for n in seq_lens]
    pool = BlockPool(sum(blocks_per_seq) + extra_blocks, enable_caching=False)
    pool.allocate(extra_blocks // 2)  # blocks of other requests: the batch's ids do not start at 0
    tables = [pool.allocate(n) for n in blocks_per_seq]
    width = max(blocks_per_seq)
    kv = torch.randn(2, pool.num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    q, _, _ = qkv_views(len(seq_lens))
    return (q, kv[0], kv[1], torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32), torch.arange(len(seq_lens) + 1, dtype=torch.int32))


LENS = [1, 2, 15, 16, 17, 33, 127, 128, 129, 300]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (32, None), (17, None), (None, 50.0)])
def test_decode_attention_matches_reference(dtype, window, softcap):
    case = decode_case(LENS, dtype)
    got = cpu_ops.paged_attention(*case, HEAD_DIM ** -0.5, window, softcap)
    want = ref.paged_attention_ref(*case, HEAD_DIM ** -0.5, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_is_batch_and_thread_invariant(dtype):
    """A batch's rows (each sequence's kv heads read together, the next block's lines fetched as the rows are
    read, a bfloat16 row widened in registers) equal a lone sequence's, on 1 or 2 threads, and the row prefill
    computes for the same position (a 2-token chunk ending there)."""
    lens = [int(n) for n in torch.randint(1, 700, (32,))]
    lens[5] = 129
    q, k_cache, v_cache, tables, seq_lens, qsl = decode_case(lens, dtype)
    chunk_q = torch.cat([torch.randn(1, HEADS, HEAD_DIM), q[5:6]])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 0.125)
        alone = cpu_ops.paged_attention(q[5:6], k_cache, v_cache, tables[5:6, :9].contiguous(), seq_lens[5:6],
                                        qsl[:2], 0.125)
        torch.set_num_threads(2)
        two = cpu_ops.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 0.125)
        chunk = cpu_ops.paged_attention(chunk_q, k_cache, v_cache, tables[5:6, :9].contiguous(), seq_lens[5:6],
                                        torch.tensor([0, 2], dtype=torch.int32), 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one[5:6], alone)
    assert torch.equal(one[5:6], chunk[1:2])


def prefill_case(seq_lens: list[int], q_lens: list[int], dtype=torch.float32):
    """A mixed step's attention inputs: sequence b has q_lens[b] new tokens ending at seq_lens[b] - 1 (a whole
    prompt, a prompt after a cached prefix, a chunk, a decode token, or none), blocks from a real BlockPool."""
    _, k_cache, v_cache, tables, lens, _ = decode_case(seq_lens, dtype)
    q, _, _ = qkv_views(sum(q_lens))
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k_cache, v_cache, tables, lens, qsl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (32, None), (17, None), (None, 50.0)])
def test_prefill_and_mixed_attention_match_reference(dtype, window, softcap):
    # a whole prompt, a decode token, a prefix hit, a long chunk past two tiles, a sequence with nothing new
    case = prefill_case([40, 100, 7, 300, 5], [40, 1, 3, 170, 0], dtype)
    got = cpu_ops.paged_attention(*case, HEAD_DIM ** -0.5, window, softcap)
    want = ref.paged_attention_ref(*case, HEAD_DIM ** -0.5, window, softcap)
    torch.testing.assert_close(got[:214], want[:214], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("window", [None, 40])
def test_a_row_gets_the_same_bits_cold_continued_chunked_batched_and_as_a_decode_step(window):
    """A position's attention row is one fixed computation: the same bits whether the whole prompt ran cold, the
    prompt continued after a cached prefix or an earlier chunk, it shared the step with other sequences, it ran
    on 1 or 2 threads, or it was the one new token of a decode step. So a prefix-cache hit gives the cold
    prompt's tokens, and a preempted sequence recomputed by prefill continues on the bits it decoded."""
    length = 300
    q, k_cache, v_cache, tables, _, _ = prefill_case([length, 50, 9], [length, 1, 9])  # sequence 0's rows

    def rows(start: int, stop: int) -> torch.Tensor:
        return cpu_ops.paged_attention(q[start:stop], k_cache, v_cache, tables[:1],
                                       torch.tensor([stop], dtype=torch.int32),
                                       torch.tensor([0, stop - start], dtype=torch.int32), 0.125, window)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cold = rows(0, length)
        torch.set_num_threads(2)
        assert torch.equal(rows(0, length), cold)
        for cached in (1, 16, 37, 64, 200, 299):
            assert torch.equal(rows(cached, length), cold[cached:]), cached
        assert torch.equal(rows(100, 150), cold[100:150])
        for pos in (0, 5, 15, 16, 100, 299):
            assert torch.equal(rows(pos, pos + 1), cold[pos:pos + 1]), pos
        # in one step with a decode token of another sequence and a short prompt
        mixed_q = torch.cat([q[64:length], torch.randn(10, HEADS, HEAD_DIM)])
        qsl = torch.tensor([0, length - 64, length - 63, length - 54], dtype=torch.int32)
        mixed = cpu_ops.paged_attention(mixed_q, k_cache, v_cache, tables, torch.tensor([length, 50, 9],
                                        dtype=torch.int32), qsl, 0.125, window)
        assert torch.equal(mixed[:length - 64], cold[64:])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (500, None), (None, 50.0)])
def test_one_long_sequence_decodes_on_two_threads_with_the_same_bits(dtype, window, softcap):
    """A decode step of one sequence has fewer kv heads than twice the threads: from ~1k (position, kv head) pairs
    its attention splits into phases (scores by runs of blocks, PV by 32 columns) that keep every sum in position
    order, so its row is the same bits as on one thread and as the same position's row in a cold prompt."""
    threads = torch.get_num_threads()
    try:
        for length in (343, 700, 1000, 1500):
            q, k_cache, v_cache, tables, seq_lens, qsl = prefill_case([length], [length], dtype)

            def attention(q_rows: torch.Tensor) -> torch.Tensor:
                return cpu_ops.paged_attention(q_rows, k_cache, v_cache, tables, seq_lens,
                                               torch.tensor([0, len(q_rows)], dtype=torch.int32), 0.125, window,
                                               softcap)

            torch.set_num_threads(1)
            cold = attention(q)
            alone = attention(q[-1:])
            torch.set_num_threads(2)
            split = attention(q[-1:])
            assert torch.equal(split, alone), length
            assert torch.equal(split, cold[-1:]), length
            want = ref.paged_attention_ref(q[-1:], k_cache, v_cache, tables, seq_lens,
                                           torch.tensor([0, 1], dtype=torch.int32), 0.125, window, softcap)
            torch.testing.assert_close(split, want, rtol=1e-5, atol=2e-6)
    finally:
        torch.set_num_threads(threads)


def test_paged_attention_rejects_bad_query_start_loc():
    q, k_cache, v_cache, tables, lens, _ = prefill_case([20, 3], [4, 3])
    for qsl in ([0, 4, 8], [0, 2, 7], [-1, 4, 7], [0, 4, 3]):  # past T; q_len > seq_len; negative; falling
        with pytest.raises(ValueError, match="query_start_loc"):
            cpu_ops.paged_attention(q, k_cache, v_cache, tables, lens, torch.tensor(qsl, dtype=torch.int32), 0.125)
    with pytest.raises(ValueError, match="query_start_loc"):
        cpu_ops.paged_attention(q, k_cache, v_cache, tables, lens, torch.tensor([0, 7], dtype=torch.int32), 0.125)


def test_decode_attention_rejects_bad_tables():
    q, k_cache, v_cache, tables, seq_lens, qsl = decode_case([20, 3])
    bad = tables.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match="block_tables"):
        cpu_ops.paged_attention(q, k_cache, v_cache, bad, seq_lens, qsl, 0.125)
    with pytest.raises(ValueError, match="seq_lens"):
        cpu_ops.paged_attention(q, k_cache, v_cache, tables, torch.tensor([20, 40], dtype=torch.int32), qsl, 0.125)


# --------------------------------------------------------------------------------------------------- SiLU * up
def test_silu_mul_matches_reference():
    gate_up = torch.randn(5, 2 * INTERMEDIATE) * 4
    gate_up[0, :6] = torch.tensor([0.0, -100.0, 100.0, -87.5, 88.0, 1e-30])
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), ref.silu_mul_ref(gate_up), rtol=1e-6, atol=1e-6)
    wide = torch.randn(3, 2 * INTERMEDIATE + 32)[:, :2 * INTERMEDIATE]
    torch.testing.assert_close(cpu_ops.silu_mul(wide), ref.silu_mul_ref(wide), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------- top k
def test_top_k_indices_are_the_k_largest_of_each_row():
    # the LM head's shape (vocab 49152) at 1, 32 and 65 rows, rows of any stride, k from 1 to the largest native k
    logits = torch.randn(65, 49152 + 8) * 5
    for rows in (1, 32, 65):
        for k in (1, 16, cpu_ops.TOP_K_MAX):
            x = logits[:rows, 4:4 + 49152]
            got = cpu_ops.top_k_indices(x, k)
            assert got.shape == (rows, k) and got.dtype == torch.int64
            assert torch.equal(got.sort(dim=-1).values, ref.top_k_indices_ref(x, k).sort(dim=-1).values)


def test_top_k_indices_ties_nan_and_what_falls_back():
    x = torch.zeros(2, 40)
    x[0, [5, 9, 30]] = 2.0
    x[1, 3] = float("nan")
    x[1, [7, 20]] = 1.0
    # of equal values the earliest index; NaN is never taken
    assert sorted(cpu_ops.top_k_indices(x, 5)[0].tolist()) == [0, 1, 5, 9, 30]
    assert sorted(cpu_ops.top_k_indices(x, 4)[1].tolist()) == [0, 1, 7, 20]
    # fewer than k values above -inf, k past TOP_K_MAX, k == N: the reference answers (torch.topk's choice)
    masked = torch.full((1, 100), float("-inf"))
    masked[0, :3] = 1.0
    assert sorted(cpu_ops.top_k_indices(masked, 4)[0].tolist())[:3] == [0, 1, 2]
    wide = torch.randn(2, 200)
    assert torch.equal(cpu_ops.top_k_indices(wide, 65).sort(-1).values, wide.topk(65).indices.sort(-1).values)
    assert sorted(cpu_ops.top_k_indices(wide[:, :16], 16)[0].tolist()) == list(range(16))


def lm_head_case(vocab: int, hidden: int, rows: int, bias: bool):
    """An int8 LM head (engine.quant.Int8Linear's layout) and the candidates its logits recompute: logits
    [rows, vocab] as its forward leaves them, in rows of a wider tensor (the native kernel takes any row stride)."""
    qweight = torch.randint(-127, 128, (vocab, hidden), dtype=torch.int8)
    scale = torch.rand(vocab) * 0.01 + 1e-3
    x = torch.randn(rows, hidden) * 4
    logits = (torch.randn(rows, vocab + 8) * 5)[:, 3:3 + vocab]
    return qweight, scale, (torch.randn(vocab) if bias else None), x, logits


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """t's values in rows of a wider tensor, as lm_head_case's logits (a .clone() of those is contiguous)."""
    return torch.empty(t.shape[0], t.shape[1] + 8)[:, 3:3 + t.shape[1]].copy_(t)


@pytest.mark.parametrize("hidden", [576, 100])     # the default model's width; one with a tail past 16 lanes
@pytest.mark.parametrize("bias", [False, True])
def test_recompute_logits_int8_matches_the_reference(hidden, bias):
    qweight, scale, b, x, logits = lm_head_case(3000, hidden, 33, bias)
    ids = cpu_ops.top_k_indices(logits, 16)
    out = strided_copy(logits)
    assert out.stride(0) == logits.shape[1] + 8
    got = cpu_ops.recompute_logits_int8(out, x, qweight, scale, b, ids)
    want = ref.recompute_logits_int8_ref(logits.clone(), x, qweight, scale, b, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    untouched = torch.ones_like(logits, dtype=torch.bool).scatter_(1, ids, False)
    assert torch.equal(got[untouched], logits[untouched])      # only the candidates change
    assert not torch.equal(got.gather(1, ids), logits.gather(1, ids))
    for i in (0, 7, 32):                                       # a row's values do not depend on its batch
        alone = cpu_ops.recompute_logits_int8(logits[i:i + 1].clone(), x[i:i + 1], qweight, scale, b, ids[i:i + 1])
        assert torch.equal(alone, got[i:i + 1]), i


def test_recompute_logits_int8_names_what_is_wrong():
    qweight, scale, _, x, logits = lm_head_case(300, 64, 2, False)
    ids = torch.tensor([[0, 5], [299, 300]])
    before = logits.clone()
    with pytest.raises(ValueError, match="ids"):
        cpu_ops.recompute_logits_int8(logits, x, qweight, scale, None, ids)
    assert torch.equal(logits, before)                          # nothing written
    with pytest.raises(ValueError, match="ids"):                # the same on the reference's way (a float64 x)
        cpu_ops.recompute_logits_int8(logits, x.double(), qweight, scale, None, ids)
    assert torch.equal(logits, before)
    ids = ids[:, :1]
    with pytest.raises(ValueError, match="qweight"):
        cpu_ops.recompute_logits_int8(logits, x, qweight[:, :32], scale, None, ids)
    with pytest.raises(ValueError, match="x must"):
        cpu_ops.recompute_logits_int8(logits, x[:1], qweight, scale, None, ids)
    with pytest.raises(ValueError, match="scale"):
        cpu_ops.recompute_logits_int8(logits, x, qweight, scale[:10], None, ids)


# --------------------------------------------------------------------------------------------------- ISAs
def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":")[1].split()}


# --------------------------------------------------------------------------------------------------- int8 KV blocks
def int8_case(dtype: torch.dtype):
    """A cache [30, 2, 12, 16, 3, 64] of heads whose magnitudes span 2^-20 .. 2^8, one all-zero head, one of
    halves with amax 127 (scale 1: x * inv ties at k + 0.5, rounded to even) and one holding a NaN; block ids with
    a repeat."""
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(30, 2, 12, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    cache *= torch.pow(2.0, torch.randint(-20, 9, (30, 2, 12, 1, KV_HEADS, 1), generator=g).float())
    cache[4, 1, 3, :, 2] = 0.0
    cache[7, 0, 5, :, 1] = torch.arange(BLOCK * HEAD_DIM).view(BLOCK, HEAD_DIM) % 20 - 9.5
    cache[7, 0, 5, 0, 1, 0] = 127.0
    cache[9, 1, 8, 3, 0, 7] = float("nan")
    return cache.to(dtype), torch.tensor([3, 5, 8, 0, 11, 5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_blocks_equal_the_reference(dtype):
    """gather_blocks_int8 gives the reference's codes and scales bit for bit (the NaN head: a NaN scale, codes 0,
    as torch's float-to-int8 cast gives here), also written into a payload's records (block stride past the
    codes: scales at unaligned offsets of no tensor); scatter_blocks_int8 writes the reference's values, bf16
    rounded the same, from those strided records, and only into the blocks named."""
    cache, ids = int8_case(dtype)
    data, scales = cpu_ops.gather_blocks_int8(cache, ids)
    data_ref, scales_ref = ref.gather_blocks_int8_ref(cache, ids)
    assert torch.equal(data, data_ref)
    assert torch.equal(scales.nan_to_num(-1.0), scales_ref.nan_to_num(-1.0)) and scales[2, 9, 1, 0].isnan()
    n, codes, head_scales = len(ids), data[0].numel(), scales[0].numel()
    records = torch.zeros(n, codes + 4 * head_scales + 4, dtype=torch.uint8)  # records 4 bytes longer than needed
    out = (records[:, :codes].view(torch.int8).view(data.shape),
           records[:, codes:codes + 4 * head_scales].view(torch.float32).view(scales.shape))
    cpu_ops.gather_blocks_int8(cache, ids, out=out)
    assert torch.equal(out[0], data) and torch.equal(out[1].nan_to_num(-1.0), scales.nan_to_num(-1.0))
    assert not records[:, codes + 4 * head_scales:].any()
    dest, dest_ref = torch.zeros_like(cache), torch.zeros_like(cache)
    to = torch.tensor([1, 2, 4, 6, 7, 9])
    cpu_ops.scatter_blocks_int8(out[0], out[1], dest, to)
    ref.scatter_blocks_int8_ref(data_ref, scales_ref, dest_ref, to)
    assert torch.equal(dest.nan_to_num(7.0), dest_ref.nan_to_num(7.0))
    untouched = [b for b in range(12) if b not in to.tolist()]
    assert not dest[:, :, untouched].any()


def test_int8_blocks_reject_bad_block_ids_and_outputs():
    cache, _ = int8_case(torch.float32)
    for bad in ([12], [-1], [0, 99]):
        with pytest.raises(ValueError, match="block_ids"):
            cpu_ops.gather_blocks_int8(cache, torch.tensor(bad))
        data, scales = cpu_ops.gather_blocks_int8(cache, torch.zeros(len(bad), dtype=torch.int64))
        with pytest.raises(ValueError, match="block_ids"):
            cpu_ops.scatter_blocks_int8(data, scales, cache, torch.tensor(bad))
    data, scales = cpu_ops.gather_blocks_int8(cache, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"out\[0\]"):
        cpu_ops.gather_blocks_int8(cache, torch.tensor([1, 2]), out=(data[:1], scales))
    with pytest.raises(ValueError, match=r"out\[1\]"):
        cpu_ops.gather_blocks_int8(cache, torch.tensor([1, 2]), out=(data, scales.double()))
    with pytest.raises(ValueError, match="scales"):
        cpu_ops.scatter_blocks_int8(data, scales[:, :3], cache, torch.tensor([1, 2]))


def test_clones_are_picked_by_isa_not_by_cpu_model():
    """GCC picks a target_clones "arch=NAME" clone only on that CPU model (its resolver asks for NAME itself):
    "arch=haswell" left every other AVX2 CPU, AMD's included, on the portable clone. Every clone of
    kernels/cpu_ops.c is an ISA: a feature or an x86-64 level."""
    line = next(line for line in cpu_ops.SOURCE.read_text().splitlines() if "target_clones(" in line)
    targets = re.findall(r'"([^"]+)"', line)
    assert "default" in targets and any("x86-64-v3" in t or "avx2" in t for t in targets), targets
    for target in targets:
        assert not target.startswith("arch=") or re.fullmatch(r"arch=x86-64-v[234]", target), target


@pytest.mark.parametrize("flags", [(), ("-march=haswell",), ("-march=haswell", "-DPD_NARROW")],
                         ids=["portable", "avx2", "avx2-narrow"])
def test_each_isa_path_matches_the_reference(flags, tmp_path, monkeypatch):
    """The loader picks the best clone the CPU runs; the AVX2 and portable ones are built alone here
    (-DPD_NO_CLONES) and checked on the same cases, the prefill attention in 8-lane vectors too (-DPD_NARROW:
    what CPUs without AVX512 run)."""
    if flags and not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA")
    cc = native_build.compiler()
    target = tmp_path / "cpu_ops.so"
    subprocess.run([cc, *native_build.CFLAGS, "-DPD_NO_CLONES", *flags, "-o", str(target), str(cpu_ops.SOURCE),
                    "-lm"], check=True, capture_output=True, timeout=120)
    monkeypatch.setattr(native_build, "load", lambda source, what: ctypes.CDLL(str(target)))
    cpu_ops.library.cache_clear()
    try:
        x, weight, residual = torch.randn(3, HIDDEN), torch.rand(HIDDEN), torch.randn(3, HIDDEN)
        torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-5, residual),
                                   ref.rms_norm_ref(x, weight, 1e-5, residual), rtol=2e-6, atol=2e-6)
        gate_up = torch.randn(3, 2 * INTERMEDIATE) * 4
        torch.testing.assert_close(cpu_ops.silu_mul(gate_up), ref.silu_mul_ref(gate_up), rtol=1e-6, atol=1e-6)
        logits = torch.randn(3, 49152)
        assert torch.equal(cpu_ops.top_k_indices(logits, 16).sort(-1).values,
                           ref.top_k_indices_ref(logits, 16).sort(-1).values)
        qweight, scale, b, x, logits = lm_head_case(3000, 100, 3, True)
        ids = cpu_ops.top_k_indices(logits, 16)
        torch.testing.assert_close(cpu_ops.recompute_logits_int8(logits.clone(), x, qweight, scale, b, ids),
                                   ref.recompute_logits_int8_ref(logits.clone(), x, qweight, scale, b, ids),
                                   rtol=1e-5, atol=1e-5)
        q, k, _ = qkv_views(3)
        q2, k2 = q.clone(), k.clone()
        cache, positions = rope_cos_sin_cache(HEAD_DIM, 512, 10000.0, None), torch.tensor([0, 17, 511])
        cpu_ops.rotary_embedding(positions, q, k, cache)
        ref.rotary_embedding_ref(positions, q2, k2, cache)
        torch.testing.assert_close((q, k), (q2, k2), rtol=2e-6, atol=2e-6)
        for dtype in (torch.float32, torch.bfloat16):
            case = decode_case([1, 17, 129, 40], dtype)
            torch.testing.assert_close(cpu_ops.paged_attention(*case, 0.125, 50, 30.0),
                                       ref.paged_attention_ref(*case, 0.125, 50, 30.0), rtol=1e-5, atol=2e-6)
            case = prefill_case([70, 129, 40], [70, 1, 33], dtype)
            prefill = cpu_ops.paged_attention(*case, 0.125, 50, 30.0)
            torch.testing.assert_close(prefill, ref.paged_attention_ref(*case, 0.125, 50, 30.0), rtol=1e-5,
                                       atol=2e-6)
            # the 16-at-a-time score tree is the decode kernel's, on this path too: the last row as a decode step
            q, k_cache, v_cache, tables, _, _ = case
            one = torch.tensor([0, 1], dtype=torch.int32)
            decode = cpu_ops.paged_attention(q[69:70], k_cache, v_cache, tables[:1], one[1:] * 70, one, 0.125, 50, 30.0)
            assert torch.equal(decode[0], prefill[69])
            # one long sequence's decode step split over two threads: still its cold prompt's last row
            q, k_cache, v_cache, tables, lens, qsl = prefill_case([700], [700], dtype)
            cold = cpu_ops.paged_attention(q, k_cache, v_cache, tables, lens, qsl, 0.125, None, 30.0)
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(2)
                decode = cpu_ops.paged_attention(q[-1:], k_cache, v_cache, tables, lens, one, 0.125, None, 30.0)
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(decode, cold[-1:])
            kv_cache, ids = int8_case(dtype)
            data, scales = cpu_ops.gather_blocks_int8(kv_cache, ids)
            data_ref, scales_ref = ref.gather_blocks_int8_ref(kv_cache, ids)
            assert torch.equal(data, data_ref) and torch.equal(scales.nan_to_num(), scales_ref.nan_to_num())
            dest, dest_ref = torch.zeros_like(kv_cache), torch.zeros_like(kv_cache)
            to = torch.tensor([1, 2, 4, 6, 7, 9])
            cpu_ops.scatter_blocks_int8(data, scales, dest, to)
            ref.scatter_blocks_int8_ref(data, scales, dest_ref, to)
            assert torch.equal(dest.nan_to_num(), dest_ref.nan_to_num())
    finally:
        cpu_ops.library.cache_clear()


# --------------------------------------------------------------------------------------------------- dispatch
def test_dispatch_picks_native_on_cpu_and_torch_pins_the_reference():
    x, weight = torch.randn(3, HIDDEN), torch.rand(HIDDEN)
    gate_up = torch.randn(3, 2 * INTERMEDIATE)
    previous = kernels.get_backend()
    try:
        for backend in ("auto", "native"):
            kernels.set_backend(backend)
            assert torch.equal(kernels.rms_norm(x, weight, 1e-5), cpu_ops.rms_norm(x, weight, 1e-5))
            assert torch.equal(kernels.silu_mul(gate_up), cpu_ops.silu_mul(gate_up))
            assert torch.equal(kernels.top_k_indices(gate_up, 8), cpu_ops.top_k_indices(gate_up, 8))
        kernels.set_backend("torch")
        assert torch.equal(kernels.rms_norm(x, weight, 1e-5), ref.rms_norm_ref(x, weight, 1e-5))
        assert torch.equal(kernels.silu_mul(gate_up), ref.silu_mul_ref(gate_up))
        assert torch.equal(kernels.top_k_indices(gate_up, 8), ref.top_k_indices_ref(gate_up, 8))
    finally:
        kernels.set_backend(previous)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=120, check=False)


def test_env_var_sets_backend_and_no_compiler_falls_back(tmp_path):
    code = ("import logging, torch; logging.basicConfig(level=logging.WARNING)\n"
            "import kernels; from kernels import reference as ref\n"
            "print(kernels.get_backend(), kernels.native_available())\n"
            "x, w = torch.randn(2, 576), torch.rand(576)\n"
            "assert torch.equal(kernels.rms_norm(x, w, 1e-5), ref.rms_norm_ref(x, w, 1e-5))\n"
            "try:\n    kernels.set_backend('native')\nexcept RuntimeError as e:\n    print('refused')\n")
    done = _python(code, CC="/nonexistent/cc", XDG_CACHE_HOME=str(tmp_path), PDSERVE_KERNEL_BACKEND="auto")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["auto", "False", "refused"]
    warnings = [line for line in done.stderr.splitlines() if "native CPU op kernels unavailable" in line]
    assert len(warnings) == 1 and "/nonexistent/cc" in warnings[0]
    done = _python("import kernels; print(kernels.get_backend())", PDSERVE_KERNEL_BACKEND="torch")
    assert done.returncode == 0 and done.stdout.strip() == "torch", done.stderr
    done = _python("import kernels", PDSERVE_KERNEL_BACKEND="cuda")
    assert done.returncode != 0 and "PDSERVE_KERNEL_BACKEND" in done.stderr
