"""The torch references (the CPU production path) against plain formulas."""

import pytest
import torch

from kernels import reference as ref
from kv_testutil import make_cos_sin_cache, make_paged_case, naive_attention

GQA = [(4, 4), (6, 2), (8, 1)]  # (num_heads, num_kv_heads): ratios 1, 3, 8


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("seq_lens,q_lens", [
    ([1, 17, 33, 5], [1, 1, 1, 1]),  # decode, lengths off the block grid
    ([20, 9], [20, 9]),  # plain prefill
    ([40, 23], [7, 23]),  # prefix hit: first 33 tokens of seq 0 cached
    ([30, 16, 12, 1, 50], [1, 5, 0, 1, 18]),  # mixed: decode, chunk, idle sequence, single token, chunk
], ids=["decode", "prefill", "prefix-hit", "mixed"])
def test_paged_attention_ref_matches_dense(block_size, num_heads, num_kv_heads, seq_lens, q_lens):
    case = make_paged_case(seq_lens, q_lens, num_heads, num_kv_heads, 16, block_size, pad_value=10**6)
    out = ref.paged_attention_ref(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  case.query_start_loc, case.scale)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    torch.testing.assert_close(out.double(), naive_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 24])
def test_paged_attention_ref_decode_row_does_not_depend_on_the_batch(sliding_window):
    """A decoding sequence's output is bit for bit the same alone as in any batch (one thread): every decode
    batch, of one sequence or many, takes the same masked, padded kernel, whose result does not depend on the
    padding. Quantized weights round activations to bfloat16 and so turn a last-bit difference here into a
    different token on a near tie: the cluster's tokens would then depend on what else its decode worker runs."""
    seq_lens = [17, 1, 160, 33, 64, 5]
    case = make_paged_case(seq_lens, [1] * len(seq_lens), num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            batched = ref.paged_attention_ref(case.query, case.k_cache, case.v_cache, case.block_tables,
                                              case.seq_lens, case.query_start_loc, case.scale, sliding_window)
            for b in range(len(seq_lens)):
                for others in ([], [2], [0, 3, 5]):  # alone, next to a longer one, among shorter ones
                    rows = [b] + [o for o in others if o != b]
                    sel = torch.tensor(rows)
                    out = ref.paged_attention_ref(case.query[sel], case.k_cache, case.v_cache,
                                                  case.block_tables[sel], case.seq_lens[sel],
                                                  torch.arange(len(rows) + 1, dtype=torch.int32), case.scale,
                                                  sliding_window)
                    assert torch.equal(out[0], batched[b]), (b, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (8, 1, 128)])
def test_a_continued_prompt_gets_the_cold_prompts_rows_bit_for_bit(num_heads, num_kv_heads, head_dim, threads):
    """A prompt's last rows computed after a cached prefix (or an earlier chunk) equal those rows of the whole
    prompt computed cold, bit for bit: what makes a prefix-cache hit give the cold prompt's tokens (a gateway's
    second request for a chat shares the first one's cached template). Every prefill row runs the flash kernel
    over the sequence's whole K/V under an explicit mask; SDPA's own causal mask would be 2.3x faster at 2048
    tokens but trims each query block's keys at its diagonal, so a row's sums would depend on where the
    computed rows start (BENCHMARKS.md, "Prefill attention"). Lengths on both sides of the CPU flash kernel's
    block-size thresholds (192 and 768 query rows)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(num_heads * 100 + head_dim)
        for length, cached in ((7, 3), (130, 64), (200, 17), (600, 512), (1100, 1000), (1100, 37)):
            q = torch.randn(length, num_heads, head_dim, generator=g) * 2
            k = torch.randn(length, num_kv_heads, head_dim, generator=g) * 2
            v = torch.randn(length, num_kv_heads, head_dim, generator=g)
            cold = ref._prefill_attention_one(q, k, v, head_dim ** -0.5)
            continued = ref._prefill_attention_one(q[cached:], k, v, head_dim ** -0.5)
            assert torch.equal(continued, cold[cached:]), (length, cached)
    finally:
        torch.set_num_threads(previous)


def test_paged_attention_ref_empty_query():
    case = make_paged_case([5], [0], 4, 2, 8, 8)
    out = ref.paged_attention_ref(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  case.query_start_loc, case.scale)
    assert out.shape == (0, 4, 8)


def test_paged_attention_ref_bf16_close_to_fp32():
    case = make_paged_case([37, 3], [1, 3], 6, 2, 16, 16, dtype=torch.bfloat16)
    out = ref.paged_attention_ref(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  case.query_start_loc, case.scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(case), atol=2e-2, rtol=2e-2)


def test_paged_attention_ref_rejects_query_longer_than_sequence():
    case = make_paged_case([4], [4], 2, 2, 8, 8)
    with pytest.raises(ValueError, match="query length"):
        ref.paged_attention_ref(case.query, case.k_cache, case.v_cache, case.block_tables,
                                torch.tensor([3], dtype=torch.int32), case.query_start_loc, case.scale)


def test_write_kv_ref_writes_slots_and_skips_padding():
    k_cache = torch.zeros(4, 8, 2, 4)
    v_cache = torch.zeros(4, 8, 2, 4)
    key, value = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    ref.write_kv_ref(key, value, k_cache, v_cache, torch.tensor([17, -1, 3]))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[0, 3], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # exactly two slots written


def test_write_kv_ref_into_layer_view_of_full_cache():
    kv_cache = torch.zeros(2, 2, 3, 4, 1, 2)  # [L, 2, NB, BS, Hkv, D]
    key = torch.ones(2, 1, 2)
    ref.write_kv_ref(key, -key, kv_cache[1, 0], kv_cache[1, 1], torch.tensor([0, 11]))
    assert kv_cache[1, 0, 2, 3].eq(1).all() and kv_cache[1, 1, 0, 0].eq(-1).all()
    assert kv_cache[0].eq(0).all()


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_ref(with_residual, dtype):
    x, res, w = torch.randn(5, 24).to(dtype), torch.randn(5, 24).to(dtype), torch.randn(24).to(dtype)
    out = ref.rms_norm_ref(x, w, 1e-6, res if with_residual else None)
    s = (x.double() + res.double()).to(dtype).double() if with_residual else x.double()
    expected = s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-6) * w.double()
    if with_residual:
        out, new_res = out
        assert new_res.dtype == dtype
        torch.testing.assert_close(new_res.double(), s)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("rot_dim", [16, 8])
def test_rotary_embedding_ref_rotate_half(rot_dim):
    head_dim = 16
    cache = make_cos_sin_cache(64, rot_dim)
    positions = torch.tensor([0, 5, 63, 7])
    q, k = torch.randn(4, 6, head_dim), torch.randn(4, 2, head_dim)
    q0, k0 = q.clone(), k.clone()
    ref.rotary_embedding_ref(positions, q, k, cache)

    def expected(x):
        half = rot_dim // 2
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
        ang = positions.double()[:, None] * inv_freq  # [T, half]
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
        xr = x[..., :rot_dim].double()
        rotated = torch.cat([-xr[..., half:], xr[..., :half]], -1)  # HF rotate_half
        return torch.cat([xr * cos + rotated * sin, x[..., rot_dim:].double()], -1)

    torch.testing.assert_close(q.double(), expected(q0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.double(), expected(k0), atol=1e-5, rtol=1e-5)
    assert torch.equal(q[0], q0[0])  # position 0 is the identity


def test_rotary_embedding_ref_on_strided_views():
    """q and k as views of one fused qkv row: rotated in place, v (the columns after k) untouched."""
    qkv = torch.randn(3, (4 + 2 + 2) * 8)
    q = qkv[:, :32].view(3, 4, 8)
    k = qkv[:, 32:48].view(3, 2, 8)
    q_copy, k_copy, v_before = q.clone(), k.clone(), qkv[:, 48:].clone()
    cache, positions = make_cos_sin_cache(10, 8), torch.tensor([1, 2, 3])
    ref.rotary_embedding_ref(positions, q, k, cache)
    ref.rotary_embedding_ref(positions, q_copy, k_copy, cache)
    assert torch.equal(q, q_copy) and torch.equal(qkv[:, 32:48].view(3, 2, 8), k_copy)
    assert torch.equal(qkv[:, 48:], v_before)


def test_gather_scatter_round_trip():
    kv_cache = torch.randn(3, 2, 10, 4, 2, 8)  # [L, 2, NB, BS, Hkv, D]
    ids = torch.tensor([7, 2, 5])
    staging = ref.gather_blocks_ref(kv_cache, ids)
    assert staging.shape == (3, 3, 2, 4, 2, 8) and staging.is_contiguous()
    assert torch.equal(staging[1, 2, 1], kv_cache[2, 1, 2])
    dest = torch.zeros_like(kv_cache)
    dst_ids = torch.tensor([0, 9, 4])
    ref.scatter_blocks_ref(staging, dest, dst_ids)
    assert torch.equal(dest[:, :, dst_ids], kv_cache[:, :, ids])
    untouched = [i for i in range(10) if i not in (0, 9, 4)]
    assert dest[:, :, untouched].eq(0).all()


def test_int8_round_trip_error_bound():
    staging = torch.randn(4, 2, 2, 8, 3, 16) * torch.rand(1, 1, 1, 1, 3, 1) * 5
    staging[0, 1, 0, :, 2] = 0.0  # an all-zero head
    data, scales = ref.quantize_blocks_int8_ref(staging)
    assert data.dtype == torch.int8 and data.shape == staging.shape
    assert scales.dtype == torch.float32 and scales.shape == (4, 2, 2, 3)
    assert scales[0, 1, 0, 2] == 0 and data[0, 1, 0, :, 2].eq(0).all()
    assert data.abs().amax(dim=(3, 5)).eq(127).sum() == scales.gt(0).sum()  # the absmax hits 127
    back = ref.dequantize_blocks_int8_ref(data, scales, torch.float32)
    bound = scales[:, :, :, None, :, None] / 2 + 1e-6
    assert ((back - staging).abs() <= bound).all()
