"""paged_attention_ref with a sliding window and a logit softcap, against dense fp64 attention written here."""

import pytest
import torch

import kernels
from kernels import reference as ref
from kv_testutil import PagedCase, make_paged_case

# (seq_lens, q_lens): decode only (batched and batch 1), prefill, chunks over a cached prefix, mixed
CASES = {
    "decode": ([1, 17, 45, 5], [1, 1, 1, 1]),
    "decode-batch-1": ([45], [1]),
    "prefill": ([20, 9], [20, 9]),
    "prefix-hit": ([40, 23], [7, 23]),
    "mixed": ([30, 16, 12, 1, 50], [1, 5, 0, 1, 18]),
}


def windowed_attention(case: PagedCase, window: int | None, softcap: float | None) -> torch.Tensor:
    """Dense attention per sequence in fp64: position p sees p - window + 1 .. p; scores soft-capped first."""
    num_heads = case.query.shape[1]
    out = torch.zeros(case.query.shape, dtype=torch.float64)
    start = 0
    for k, v, q_len in zip(case.keys, case.values, case.q_lens):
        seq_len, group = k.shape[0], num_heads // k.shape[1]
        q = case.query[start:start + q_len].double()
        kk, vv = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * case.scale  # [Hq, q_len, seq_len]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos = (torch.arange(q_len) + seq_len - q_len)[:, None]
        kv_pos = torch.arange(seq_len)[None, :]
        hidden = kv_pos > pos
        if window is not None:
            hidden |= kv_pos <= pos - window
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1),
                                                vv)
        start += q_len
    return out


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("window,softcap", [(4, None), (16, None), (None, 2.0), (7, 1.5), (1, None)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_window_and_softcap_match_dense_attention(case_name, window, softcap, num_heads, num_kv_heads):
    seq_lens, q_lens = CASES[case_name]
    case = make_paged_case(seq_lens, q_lens, num_heads, num_kv_heads, 16, 8, pad_value=10**6)
    case.scale = 0.6  # scores of a few units: the softcap bends them
    out = ref.paged_attention_ref(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  case.query_start_loc, case.scale, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), windowed_attention(case, window, softcap), atol=1e-5, rtol=1e-5)


def test_window_changes_the_result_and_a_wide_window_does_not():
    case = make_paged_case([40, 23], [7, 23], 4, 2, 16, 8)
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc,
            case.scale)
    full = kernels.paged_attention(*args)
    assert torch.equal(kernels.paged_attention(*args, sliding_window=40), full)  # every position within the window
    assert not torch.allclose(kernels.paged_attention(*args, sliding_window=8), full, atol=1e-3)


def test_reference_rejects_an_empty_window():
    case = make_paged_case([5], [5], 2, 1, 16, 8)
    with pytest.raises(ValueError, match="sliding_window"):
        ref.paged_attention_ref(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                case.query_start_loc, case.scale, sliding_window=0)


@pytest.mark.parametrize("case_name", ["decode", "decode-batch-1", "prefix-hit", "mixed"])
def test_blocks_before_the_window_are_never_read(case_name):
    # Blocks wholly before every new token's window hold NaN: reading them (even masked, 0 * NaN) shows as NaN.
    # Those blocks may be freed and reused by other sequences while this one decodes. Physical block 0 stays
    # finite: the batched path points block-table padding at it (masked, and the engine's cache is never NaN).
    seq_lens, q_lens = CASES[case_name]
    window, block_size = 6, 4
    case = make_paged_case(seq_lens, q_lens, 4, 2, 16, block_size)
    expected = windowed_attention(case, window, None)
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        for j in range(max(0, seq_len - q_len - window + 1) // block_size):
            if case.block_tables[b, j] == 0:
                continue
            case.k_cache[case.block_tables[b, j]] = float("nan")
            case.v_cache[case.block_tables[b, j]] = float("nan")
    out = ref.paged_attention_ref(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  case.query_start_loc, case.scale, sliding_window=window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
