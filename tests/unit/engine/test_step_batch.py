"""engine.step_batch.run_step hands the attention its batch's bounds from the host (AttentionMetadata's
max_query_len and max_seq_len): on CUDA, reading them from the device would cost a sync in every layer, and a
bound below the truth would make the Triton kernels skip tokens."""

import kernels
from engine.sampling_params import SamplingParams
from tiny_model import run, tiny_engine


def test_attention_gets_the_batch_bounds_from_the_host(monkeypatch):
    calls = []
    paged_attention = kernels.paged_attention

    def recording(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, **kwargs):
        lengths = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
        calls.append((kwargs["max_query_len"], max(lengths), kwargs["max_seq_len"], int(seq_lens.max())))
        return paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, **kwargs)

    monkeypatch.setattr(kernels, "paged_attention", recording)
    engine = tiny_engine(max_num_batched_tokens=24)  # the 40-token prompt runs in chunks beside the decodes
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens = run(engine, [[5, 6, 7], list(range(10, 50)), [9]], [params] * 3)
    assert [len(t) for t in tokens] == [5, 5, 5]
    assert calls
    hints = {max_query_len for max_query_len, *_ in calls}
    assert 1 in hints and max(hints) > 1  # decode-only steps, and prompt chunks (beside decodes)
    for max_query_len, true_query_len, max_seq_len, true_seq_len in calls:
        assert (max_query_len, max_seq_len) == (true_query_len, true_seq_len)
