"""The runner against an in-memory backend (no sockets): concurrency cap, session order, failures recorded;
and the SSE parsing of the OpenAI backend."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.bench.backends import Backend, carries_output, parse_sse_line
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.runner import RunConfig, run
from pdserve.bench.workloads import BenchRequest, multi_turn_workload, random_workload


class FakeBackend(Backend):
    """Answers every request with max_tokens single-token chunks after yielding to the loop; fails on demand."""

    name = "fake"

    def __init__(self, fail_ids: frozenset[str] = frozenset(), crash_ids: frozenset[str] = frozenset()) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.order: list[str] = []
        self.finished: set[str] = set()
        self.fail_ids = fail_ids
        self.crash_ids = crash_ids
        self.started = self.closed = False

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def send(self, request: BenchRequest) -> RequestRecord:
        if request.request_id in self.crash_ids:
            raise RuntimeError("backend bug")
        self.order.append(request.request_id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        record = RequestRecord(prompt_len=request.prompt_len, start_s=time.perf_counter(),
                               request_id=request.request_id)
        for _ in range(request.max_tokens):
            await asyncio.sleep(0)
            record.chunk_times_s.append(time.perf_counter())
        record.output_len = request.max_tokens
        record.success = request.request_id not in self.fail_ids
        record.error = "" if record.success else "refused"
        self.in_flight -= 1
        self.finished.add(request.request_id)
        return record


def test_concurrency_cap_and_all_records_in_request_order():
    requests = random_workload(20, 8, 3, seed=0)
    backend = FakeBackend()
    result = run(backend, requests, RunConfig(max_concurrency=4, progress=False))
    assert backend.started and backend.closed
    assert 1 < backend.max_in_flight <= 4
    assert [r.request_id for r in result.records] == [r.request_id for r in requests]
    assert result.summary.completed == 20 and result.summary.total_output_tokens == 60
    assert backend.order[0] == "warmup"  # the warm-up goes first and is not recorded
    assert "warmup" not in {r.request_id for r in result.records}


def test_all_at_once_without_cap_overlaps_everything():
    backend = FakeBackend()
    run(backend, random_workload(10, 8, 5, seed=0), RunConfig(progress=False, warmup=False))
    assert backend.max_in_flight == 10


def test_session_turns_are_sequential():
    requests = multi_turn_workload(3, 4, 5, 2, seed=0)
    backend = FakeBackend()
    seen_finished_before: dict[str, set[str]] = {}
    original = backend.send

    async def send(request: BenchRequest) -> RequestRecord:
        seen_finished_before[request.request_id] = set(backend.finished)
        return await original(request)

    backend.send = send  # type: ignore[method-assign]
    run(backend, requests, RunConfig(progress=False, warmup=False))
    for c in range(3):
        for t in range(1, 4):
            assert f"chat-{c}-{t - 1}" in seen_finished_before[f"chat-{c}-{t}"]
    assert backend.max_in_flight == 3  # one turn per conversation at a time, conversations in parallel


def test_failures_and_backend_errors_are_recorded_not_raised():
    requests = random_workload(6, 8, 2, seed=0)
    backend = FakeBackend(fail_ids=frozenset({requests[1].request_id}),
                          crash_ids=frozenset({requests[2].request_id}))
    result = run(backend, requests, RunConfig(progress=False, warmup=False))
    assert result.summary.completed == 4 and result.summary.failed == 2
    assert result.records[2].error == "RuntimeError: backend bug"


def test_failed_warmup_stops_the_run():
    requests = random_workload(2, 8, 2, seed=0)
    with pytest.raises(RuntimeError, match="warm-up"):
        run(FakeBackend(fail_ids=frozenset({"warmup"})), requests, RunConfig(progress=False))


def test_duplicate_request_ids_are_rejected():
    request = random_workload(1, 8, 2, seed=0)[0]
    with pytest.raises(ValueError, match="unique"):
        run(FakeBackend(), [request, request], RunConfig(progress=False, warmup=False))


def test_sse_parsing():
    assert parse_sse_line(b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n') == {
        "choices": [{"text": "a", "finish_reason": None}]}
    assert parse_sse_line(b"data: [DONE]\n") == "[DONE]"
    assert parse_sse_line(b"\n") is None
    assert parse_sse_line(b": keep-alive\n") is None


def test_which_chunks_carry_output():
    assert carries_output({"choices": [{"text": " Paris", "finish_reason": None}]})
    assert carries_output({"choices": [{"text": "", "finish_reason": None}]})  # a token still held back (UTF-8)
    assert carries_output({"choices": [{"text": "!", "finish_reason": "length"}]})
    assert not carries_output({"choices": [{"text": "", "finish_reason": "length"}], "usage": {}})
    assert not carries_output({"choices": [], "usage": {"completion_tokens": 3}})
