"""engine.step_batch.run_step hands the attention its batch's bounds from the host (AttentionMetadata's
max_query_len and max_seq_len): on CUDA, reading them from the device would cost a sync in every layer, and a
bound below the truth would make the Triton kernels skip tokens."""

import kernels
from engine import step_batch
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


def _last_layer_rows(monkeypatch, engine) -> list[int]:
    """Query rows the model's last layer attends, per call."""
    rows, attention = [], engine.runner.model.attention
    last = len(engine.runner.model.layers) - 1

    def recording(index, q, k, v, kv_cache, meta):
        out = attention(index, q, k, v, kv_cache, meta)
        if index == last:
            rows.append(out.shape[0])
        return out

    monkeypatch.setattr(engine.runner.model, "attention", recording)
    return rows


def _generate(engine, prompts) -> list[tuple[list[int], list]]:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [(s.output_token_ids, s.output_logprobs) for s in seqs]


def test_the_last_layer_runs_the_sampled_rows_alone_with_the_bits_of_the_whole_batch(monkeypatch):
    """A prompt step samples one row a sequence (and a chunk short of its prompt's end none): the last layer writes
    every row's K/V but attends, projects and runs its MLP for the sampled rows only. On the native int4 kernels
    (each row's result independent of the batch) the tokens and their logprobs are those of running every row, bit
    for bit."""
    prompts = [list(range(3, 40)), [5, 6, 7], list(range(50, 71))]
    kwargs = {"quantization": "int4", "cpu_matmul": "native", "max_num_batched_tokens": 16}
    pruned_engine = tiny_engine(**kwargs)
    rows = _last_layer_rows(monkeypatch, pruned_engine)
    pruned = _generate(pruned_engine, prompts)
    monkeypatch.setattr(step_batch, "_kept_rows", lambda batch, sampled, device: None)  # every row, as before
    whole = _generate(tiny_engine(**kwargs), prompts)
    assert pruned == whole
    assert all(len(tokens) == 4 for tokens, _ in pruned)
    # 16-row steps: two chunks of the first prompt (nothing sampled), then its end beside the second prompt and
    # the third's start (two sampled), then the third's end beside two decodes (three)
    assert rows[:4] == [0, 0, 2, 3]
