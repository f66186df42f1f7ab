"""Triton decode and prefill attention with a sliding window and a logit softcap, against paged_attention_ref
(interpreter on CPU, small shapes; bf16/fp16 on CUDA)."""

import pytest
import torch

import kernels
from kernels import reference as ref
from kernels.triton_decode_attention import decode_attention_triton
from kernels.triton_prefill_attention import prefill_attention_triton
from kv_testutil import make_paged_case

GQA = [(4, 4), (6, 2)]
WINDOWS = [(5, None), (16, None), (None, 2.0), (7, 1.5), (1, None)]  # (sliding_window, softcap)
PREFILL_CASES = {
    "prefill": ([20, 9], [20, 9]),
    "prefix-hit": ([40, 23], [7, 23]),
    "mixed": ([30, 16, 12, 1, 50], [1, 5, 0, 1, 18]),
}


def _reference(case, window, softcap):
    return ref.paged_attention_ref(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   case.query_start_loc, case.scale, sliding_window=window, softcap=softcap)


@pytest.mark.parametrize("window,softcap", WINDOWS)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_window_softcap_matches_reference(window, softcap, num_heads, num_kv_heads, num_splits):
    case = make_paged_case([1, 17, 45, 5], [1, 1, 1, 1], num_heads, num_kv_heads, 16, 8, pad_value=10**6)
    case.scale = 0.6
    out = decode_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  case.scale, sliding_window=window, softcap=softcap, num_splits=num_splits,
                                  block_n=16)
    torch.testing.assert_close(out, _reference(case, window, softcap), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", WINDOWS)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("case_name", list(PREFILL_CASES))
def test_prefill_window_softcap_matches_reference(window, softcap, num_heads, num_kv_heads, case_name):
    seq_lens, q_lens = PREFILL_CASES[case_name]
    case = make_paged_case(seq_lens, q_lens, num_heads, num_kv_heads, 16, 8, pad_value=10**6)
    case.scale = 0.6
    # block_n 16 < the longest context, so tiles before a row's window exist and must be skipped or masked
    out = prefill_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   case.query_start_loc, case.scale, sliding_window=window, softcap=softcap,
                                   block_m=16, block_n=16)
    torch.testing.assert_close(out, _reference(case, window, softcap), atol=1e-5, rtol=1e-5)


def test_decode_never_reads_blocks_before_the_window():
    # Blocks wholly before the window hold NaN: a kernel that reads them (even masked, as 0 * NaN) returns NaN.
    case = make_paged_case([45, 30], [1, 1], 4, 2, 16, 8)
    for b, seq_len in enumerate((45, 30)):
        first_visible_block = (seq_len - 9) // 8  # window 9
        for j in range(first_visible_block):
            case.k_cache[case.block_tables[b, j]] = float("nan")
            case.v_cache[case.block_tables[b, j]] = float("nan")
    out = decode_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  case.scale, sliding_window=9, num_splits=2, block_n=8)
    assert not out.isnan().any()
    torch.testing.assert_close(out, _reference(case, 9, None), atol=1e-5, rtol=1e-5)


def test_dispatch_passes_window_and_softcap_to_triton():
    case = make_paged_case([30, 16, 12], [1, 5, 1], 6, 2, 16, 8)
    kernels.set_backend("triton")
    try:
        out = kernels.paged_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                      case.query_start_loc, case.scale, sliding_window=6, softcap=1.0)
    finally:
        kernels.set_backend("auto")
    torch.testing.assert_close(out, _reference(case, 6, 1.0), atol=1e-5, rtol=1e-5)


def test_launchers_reject_bad_window_and_softcap():
    case = make_paged_case([9, 4], [1, 1], 4, 2, 16, 8)
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    with pytest.raises(ValueError, match="sliding_window"):
        decode_attention_triton(*args, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        decode_attention_triton(*args, softcap=-1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        prefill_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                 case.query_start_loc, case.scale, sliding_window=-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 4, 256), (32, 8, 128)])
def test_window_softcap_cuda(dtype, num_heads, num_kv_heads, head_dim):
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-2
    decode = make_paged_case([1, 700, 2100, 33], [1, 1, 1, 1], num_heads, num_kv_heads, head_dim, 16,
                             dtype=dtype, device="cuda")
    for num_splits in (None, 1, 8):
        out = decode_attention_triton(decode.query, decode.k_cache, decode.v_cache, decode.block_tables,
                                      decode.seq_lens, decode.scale, sliding_window=512, softcap=50.0,
                                      num_splits=num_splits)
        torch.testing.assert_close(out, _reference(decode, 512, 50.0), atol=tol, rtol=tol)
    mixed = make_paged_case([300, 1000, 64, 5, 129], [300, 217, 1, 0, 129], num_heads, num_kv_heads, head_dim,
                            16, dtype=dtype, device="cuda")
    out = prefill_attention_triton(mixed.query, mixed.k_cache, mixed.v_cache, mixed.block_tables, mixed.seq_lens,
                                   mixed.query_start_loc, mixed.scale, sliding_window=100, softcap=50.0)
    torch.testing.assert_close(out, _reference(mixed, 100, 50.0), atol=tol, rtol=tol)
