"""Triton decode and prefill attention against paged_attention_ref (interpreter on CPU; bf16/fp16 on CUDA)."""

import pytest
import torch

import kernels
from kernels import reference as ref
from kernels.triton_decode_attention import decode_attention_triton
from kernels.triton_prefill_attention import prefill_attention_triton
from kv_testutil import make_paged_case

GQA = [(4, 4), (6, 2), (8, 1)]  # (num_heads, num_kv_heads): ratios 1, 3, 8
PREFILL_CASES = {
    "prefill": ([20, 9], [20, 9]),
    "prefix-hit": ([40, 23], [7, 23]),  # seq 0: 33 cached tokens, 7 new
    "mixed": ([30, 16, 12, 1, 50], [1, 5, 0, 1, 18]),  # decode, chunk, idle (q_len 0), single token, chunk
    "all-idle-but-one": ([5, 9], [0, 1]),
}


def _reference(case):
    return ref.paged_attention_ref(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   case.query_start_loc, case.scale)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_attention_matches_reference(block_size, num_heads, num_kv_heads, num_splits):
    case = make_paged_case([1, 17, 45, 5], [1, 1, 1, 1], num_heads, num_kv_heads, 16, block_size,
                           pad_value=10**6)
    out = decode_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  case.scale, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, _reference(case), atol=1e-5, rtol=1e-5)


def test_decode_attention_many_splits_some_empty():
    # 8 splits over 1..130 tokens: the 1-token sequence leaves 7 splits empty, the merge must ignore them.
    case = make_paged_case([1, 130, 37], [1, 1, 1], 6, 2, 32, 16, pad_value=-1)
    out = decode_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  case.scale, num_splits=8, block_n=16)
    torch.testing.assert_close(out, _reference(case), atol=1e-5, rtol=1e-5)


def test_decode_attention_head_dim_not_pow2_and_default_heuristics():
    case = make_paged_case([3, 21], [1, 1], 4, 2, 24, 8)
    out = decode_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  case.scale)
    torch.testing.assert_close(out, _reference(case), atol=1e-5, rtol=1e-5)


def test_decode_attention_empty_batch():
    case = make_paged_case([4], [1], 2, 1, 16, 8)
    out = decode_attention_triton(case.query[:0], case.k_cache, case.v_cache, case.block_tables[:0],
                                  case.seq_lens[:0], case.scale)
    assert out.shape == (0, 2, 16)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("case_name", list(PREFILL_CASES))
def test_prefill_attention_matches_reference(block_size, num_heads, num_kv_heads, case_name):
    seq_lens, q_lens = PREFILL_CASES[case_name]
    case = make_paged_case(seq_lens, q_lens, num_heads, num_kv_heads, 16, block_size, pad_value=10**6)
    out = prefill_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   case.query_start_loc, case.scale, block_m=16, block_n=16)
    torch.testing.assert_close(out, _reference(case), atol=1e-5, rtol=1e-5)


def test_prefill_attention_empty_query():
    case = make_paged_case([5], [0], 4, 2, 16, 8)
    out = prefill_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   case.query_start_loc, case.scale)
    assert out.shape == (0, 4, 16)


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [4, 1, 0]], ids=["decode", "mixed"])
def test_dispatch_routes_to_triton_when_forced(q_lens, monkeypatch):
    case = make_paged_case([9, 3, 17], q_lens, 6, 2, 16, 8)
    calls = []
    import kernels.triton_decode_attention as dec
    import kernels.triton_prefill_attention as pre
    monkeypatch.setattr(dec, "decode_attention_triton",
                        lambda *a, **k: calls.append("decode") or decode_attention_triton(*a, **k))
    monkeypatch.setattr(pre, "prefill_attention_triton",
                        lambda *a, **k: calls.append("prefill") or prefill_attention_triton(*a, **k))
    kernels.set_backend("triton")
    try:
        out = kernels.paged_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                      case.query_start_loc, case.scale)
    finally:
        kernels.set_backend("auto")
    assert calls == (["decode"] if q_lens == [1, 1, 1] else ["prefill"])
    torch.testing.assert_close(out, _reference(case), atol=1e-5, rtol=1e-5)


def test_dispatch_uses_reference_for_cpu_tensors(monkeypatch):
    case = make_paged_case([9], [1], 2, 1, 16, 8)
    import kernels.triton_decode_attention as dec
    monkeypatch.setattr(dec, "decode_attention_triton", lambda *a, **k: pytest.fail("Triton used on CPU"))
    assert kernels.get_backend() == "auto"
    out = kernels.paged_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  case.query_start_loc, case.scale)
    torch.testing.assert_close(out, _reference(case))


def test_set_backend_rejects_unknown_name():
    with pytest.raises(ValueError, match="backend"):
        kernels.set_backend("cuda")


def test_launchers_reject_bad_arguments():
    case = make_paged_case([9, 4], [1, 1], 4, 2, 16, 8)
    args = (case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    with pytest.raises(ValueError, match="query"):
        decode_attention_triton(case.query[:, :, :8], *args)
    with pytest.raises(ValueError, match="query"):
        decode_attention_triton(case.query.double(), *args)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention_triton(case.query[:, :3], *args)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens.float(),
                                case.scale)
    strided_k = case.k_cache.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, last-dim stride 2
    with pytest.raises(ValueError, match="k_cache must be contiguous in its last dim"):
        decode_attention_triton(case.query, strided_k, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                 case.query_start_loc[:-1], case.scale)
    with pytest.raises(ValueError, match="block_tables"):
        prefill_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables[:1], case.seq_lens,
                                 case.query_start_loc, case.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (8, 1, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_attention_cuda(dtype, num_heads, num_kv_heads, head_dim, block_size):
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-2
    decode = make_paged_case([1, 700, 2100, 33], [1, 1, 1, 1], num_heads, num_kv_heads, head_dim, block_size,
                             dtype=dtype, device="cuda")
    for num_splits in (None, 1, 16):
        out = decode_attention_triton(decode.query, decode.k_cache, decode.v_cache, decode.block_tables,
                                      decode.seq_lens, decode.scale, num_splits=num_splits)
        torch.testing.assert_close(out, _reference(decode), atol=tol, rtol=tol)
    mixed = make_paged_case([300, 1000, 64, 5, 129], [300, 217, 1, 0, 129], num_heads, num_kv_heads, head_dim,
                            block_size, dtype=dtype, device="cuda")
    out = prefill_attention_triton(mixed.query, mixed.k_cache, mixed.v_cache, mixed.block_tables, mixed.seq_lens,
                                   mixed.query_start_loc, mixed.scale)
    torch.testing.assert_close(out, _reference(mixed), atol=tol, rtol=tol)
    out = kernels.paged_attention(mixed.query, mixed.k_cache, mixed.v_cache, mixed.block_tables, mixed.seq_lens,
                                  mixed.query_start_loc, mixed.scale)  # dispatch picks Triton on CUDA
    torch.testing.assert_close(out, _reference(mixed), atol=tol, rtol=tol)
