"""Batch invariance, checked the way a user sees it: the same greedy tokens and logprobs alone as in a batch."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams

# Two copies of a near tie ("def fibonacci(n):" has its top two logits 0.04 apart in float32) among others.
PROMPTS = ["def fibonacci(n):", "The capital of France is", "def fibonacci(n):", "Water boils at"]


def assert_same_alone_as_batched(llm, max_tokens: int = 16, prompts: list[str] = PROMPTS) -> None:
    """Every prompt's greedy tokens and logprobs (values and top alternatives, bit for bit) are the same when
    `llm` generates it alone as when it generates all `prompts` together, on one thread (torch's CPU attention
    splits its work by batch size on more)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = {p: llm.generate(p, params)[0].outputs[0] for p in set(prompts)}
        together = [o.outputs[0] for o in llm.generate(prompts, params)]
    finally:
        torch.set_num_threads(threads)
    for prompt, out in zip(prompts, together):
        assert out.token_ids == alone[prompt].token_ids, prompt
        assert out.logprobs == alone[prompt].logprobs, prompt
