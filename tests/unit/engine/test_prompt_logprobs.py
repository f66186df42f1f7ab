"""Prompt logprobs in the engine: the log-softmax of the model's logits at every prompt position, equal to Hugging
Face transformers on the same (tiny, random) weights, across chunked prefill, small log-softmax chunks, a
prefix-cached prompt and a preemption."""

import pytest
import torch
from tiny_model import TINY, tiny_engine, tiny_hf_model

from engine.prompt_logprobs import compute_prompt_logprobs
from engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers", reason="the dev extra provides transformers")

PROMPT = [(7 * i + 3) % TINY.vocab_size for i in range(37)]


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    """transformers' log-softmax of the logits at each position of PROMPT: [len(PROMPT), vocab]."""
    with torch.no_grad():
        logits = tiny_hf_model()(torch.tensor([PROMPT])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check(prompt_logprobs, reference, num_top):
    assert len(prompt_logprobs) == len(PROMPT) - 1
    for p, lp in enumerate(prompt_logprobs):
        row = reference[p]
        assert lp.token_id == PROMPT[p + 1]
        assert lp.logprob == pytest.approx(float(row[PROMPT[p + 1]]), abs=1e-4)
        assert lp.rank == int((row > row[PROMPT[p + 1]]).sum()) + 1
        assert [t for t, _ in lp.top] == torch.topk(row, num_top).indices.tolist()


def test_chunked_prefill_gives_transformers_logprobs(reference):
    engine = tiny_engine(max_num_batched_tokens=8)          # the prompt spans 5 steps
    seq = engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    _check(seq.prompt_logprobs, reference, 3)
    assert [o.prompt_logprobs is not None for o in outs] == [True, False]   # shipped with the first token
    assert outs[0].prompt_logprobs == seq.prompt_logprobs


def test_small_logsoftmax_chunks_give_the_same_result(reference):
    engine = tiny_engine()
    hidden = torch.randn(10, TINY.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = compute_prompt_logprobs(engine.runner.model.compute_logits, hidden, list(range(10)), 2, 128)
    chunked = compute_prompt_logprobs(engine.runner.model.compute_logits, hidden, list(range(10)), 2, 3)
    assert [(a.token_id, a.rank, [t for t, _ in a.top]) for a in whole] == \
        [(b.token_id, b.rank, [t for t, _ in b.top]) for b in chunked]
    assert [a.logprob for a in whole] == pytest.approx([b.logprob for b in chunked], abs=1e-4)


def test_cached_prefix_is_recomputed_for_prompt_logprobs(reference):
    engine = tiny_engine()
    plain = engine.add_request("warm", PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    again = engine.add_request("hit", PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    scored = engine.add_request("scored", PROMPT, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    while engine.has_unfinished():
        engine.step()
    assert again.num_cached_tokens > 0                      # the prefix is cached
    assert scored.num_cached_tokens == 0                    # ... and not used by a request that scores it
    _check(scored.prompt_logprobs, reference, 0)
    assert scored.output_token_ids == plain.output_token_ids


def test_preempted_request_scores_each_position_once(reference):
    engine = tiny_engine(num_kv_blocks=14, max_num_batched_tokens=16)    # 56 slots: two 37-token prompts don't fit
    a = engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=1))
    b = engine.add_request("b", PROMPT[::-1], SamplingParams(temperature=0.0, max_tokens=12))
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    _check(a.prompt_logprobs, reference, 1)
    assert len(b.output_token_ids) == 12
