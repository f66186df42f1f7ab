"""Prompt logprobs of the real default model through the offline engine against Hugging Face transformers
loading the same GGUF: a prompt longer than one log-softmax chunk (engine.prompt_logprobs.CHUNK_POSITIONS), cold
and after its prefix was cached."""

import pytest
import torch

from engine.prompt_logprobs import CHUNK_POSITIONS
from engine.sampling_params import SamplingParams

# Logits agree to ~2.5e-5 (test_default_model); log-softmax moves by at most twice the largest logit difference.
LOGPROB_ATOL = 2e-3
STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman who went out every morning "
         "before the sun rose. ")


def hf_prompt_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each position: [n, vocab]."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def check(prompt_logprobs, token_ids, reference):
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(token_ids)
    got = torch.tensor([lp.logprob for lp in prompt_logprobs[1:]])
    want = reference[torch.arange(len(token_ids) - 1), torch.tensor(token_ids[1:])]
    print(f"max |prompt logprob diff| vs transformers: {(got - want).abs().max().item():.2e}")
    assert (got - want).abs().max().item() < LOGPROB_ATOL
    for p, lp in enumerate(prompt_logprobs[1:]):
        assert lp.token_id == token_ids[p + 1]
        assert lp.top[0][0] == int(torch.argmax(reference[p])) or \
            reference[p, lp.top[0][0]] >= reference[p].max() - LOGPROB_ATOL          # ties within the tolerance


@pytest.fixture(scope="module")
def long_prompt(llm) -> list[int]:
    token_ids = llm.tokenizer.encode(STORY * 8)
    assert len(token_ids) > CHUNK_POSITIONS + 16
    return token_ids


def test_prompt_logprobs_match_transformers(llm, hf_model, long_prompt):
    out = llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0]
    check(out.prompt_logprobs, long_prompt, hf_prompt_logprobs(hf_model, long_prompt))


def test_prompt_logprobs_with_a_cached_prefix_match_transformers(llm, hf_model, long_prompt):
    prefix = long_prompt[:64]
    llm.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0))          # caches 3 full blocks
    hit = llm.generate([prefix + [long_prompt[70]]], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert hit.num_cached_tokens > 0
    scored = prefix + long_prompt[64:80]
    out = llm.generate([scored], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0                                           # recomputed, not skipped
    check(out.prompt_logprobs, scored, hf_prompt_logprobs(hf_model, scored))
