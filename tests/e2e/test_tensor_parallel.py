"""The default model (9 query / 3 KV heads) under tensor parallelism on CPU with gloo: TP=2 (uneven,
group-aligned heads: 6 + 3) and TP=3 (one KV head per rank) give TP=1's greedy tokens, logprobs within 1e-3."""

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is"]
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, logprobs=5)


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_gives_tp1_greedy_tokens_and_logprobs(default_model_path, default_model, reference, tp):
    llm = LLM(model=str(default_model_path), dtype="float32", kv_cache_memory=16 * 2**20, progress=False,
              loaded=default_model, tensor_parallel_size=tp)
    try:
        got = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.engine.close()
    for want, have in zip(reference, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].text == want.outputs[0].text
        for a, b in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-3)
            assert [v for _, v in b.top] == pytest.approx([v for _, v in a.top], abs=1e-3)
