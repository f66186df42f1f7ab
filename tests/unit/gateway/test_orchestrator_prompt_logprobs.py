"""Prompt logprobs through the orchestrator (in-memory fake workers): shipped with the first token from the
prefill worker, or from the decode worker's first message on a local prefill; a worker that sends the wrong
number fails the request instead of answering without them."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, PromptLogprob
from gateway.orchestrator import Orchestrator
from gateway.request_types import WorkerFailed
from gateway.routing import RoutingPolicy
from gateway.validation import GenerationRequest
from gateway.worker_types import DecodeMessage
from tests.unit.gateway.test_orchestrator import POLICY, PROMPT, FakeWorkers, make, run

SCORED = tuple(PromptLogprob(t, -1.0, [], 3) for t in PROMPT[1:])


class ScoringWorkers(FakeWorkers):
    def __init__(self, prompt_logprobs=SCORED) -> None:
        super().__init__()
        self.prompt_logprobs = prompt_logprobs
        self.stream = [DecodeMessage((9,), (), None, prompt_logprobs=prompt_logprobs), DecodeMessage((10,)),
                       DecodeMessage((), (), FinishReason.LENGTH)]

    async def prefill(self, endpoint, job, target, timeout):
        result = await super().prefill(endpoint, job, target, timeout)
        return dataclasses.replace(result, prompt_logprobs=self.prompt_logprobs)


def scored_request() -> GenerationRequest:
    return GenerationRequest("r", PROMPT, SamplingParams(max_tokens=3, seed=1, prompt_logprobs=0))


def local(fake) -> Orchestrator:
    orch, _ = make(fake)
    orch.policy = RoutingPolicy(POLICY.block_size, POLICY.fingerprint, local_prefill_threshold=10_000,
                                idle_offload_min_tokens=0)
    return orch


@pytest.mark.parametrize("where", ["prefill", "local"])
def test_prompt_logprobs_come_with_the_first_chunk_only(where):
    fake = ScoringWorkers()
    orch = make(fake)[0] if where == "prefill" else local(fake)
    chunks = asyncio.run(run(orch, scored_request()))
    assert chunks[0].prompt_logprobs == SCORED
    assert all(c.prompt_logprobs is None for c in chunks[1:])
    assert [c[0] for c in fake.calls if c[0] == "prefill"] == (["prefill"] if where == "prefill" else [])


def test_none_when_not_asked_for():
    chunks = asyncio.run(run(make(ScoringWorkers())[0]))
    assert all(c.prompt_logprobs is None for c in chunks)


@pytest.mark.parametrize("where", ["prefill", "local"])
def test_a_worker_that_drops_them_fails_the_request(where):
    fake = ScoringWorkers(prompt_logprobs=SCORED[:-1])
    orch = make(fake)[0] if where == "prefill" else local(fake)
    with pytest.raises(WorkerFailed, match="prompt logprobs"):
        asyncio.run(run(orch, scored_request()))
    assert ("d0:1", "decode", "r") in fake.aborts()                    # its reservation is released
