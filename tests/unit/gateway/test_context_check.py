"""The gateway refuses prompts longer than the decode workers' registered context."""

import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from gateway.orchestrator import check_context
from gateway.routing import Candidate
from gateway.validation import GenerationRequest
from kvstore.local_index import WorkerInfo


def candidate(max_model_len: int) -> Candidate:
    return Candidate(WorkerInfo("d0", "decode", "h:1", max_model_len=max_model_len), 0, 0, 0)


def request(n: int) -> GenerationRequest:
    return GenerationRequest("r", tuple(range(n)), SamplingParams(seed=1))


def test_prompt_that_fills_the_workers_context_is_refused_naming_the_field():
    with pytest.raises(InvalidRequestError) as e:
        check_context(request(100), [candidate(100), candidate(64)])
    assert e.value.field == "prompt" and "100" in str(e.value)


def test_prompt_that_fits_one_worker_or_unknown_context_passes():
    check_context(request(99), [candidate(100), candidate(64)])
    check_context(request(5000), [candidate(0)])
