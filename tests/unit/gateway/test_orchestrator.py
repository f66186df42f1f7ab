"""The orchestrator's policies against an in-memory fake of its worker client (no sockets, no Redis): retries,
local prefill fallback, aborts on every exit path, overload vs outage, the queue, deadlines, hung streams and
cancellation."""
from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason
from gateway.orchestrator import Orchestrator, OrchestratorLimits
from gateway.request_types import DeadlineExceeded, NoWorkerAvailable, Overloaded, RequestTrace, WorkerFailed
from gateway.routing import RoutingPolicy
from gateway.validation import GenerationRequest
from gateway.worker_types import (DecodeMessage, PrefillResult, TransferTarget, WorkerBusy, WorkerCallFailed,
                                   WorkerTimedOut, WorkerUnreachable)
from kvstore.local_index import PrefixMatch, WorkerInfo
from tests.unit.gateway.word_tokenizer import word_tokenizer

FP = "fp"
POLICY = RoutingPolicy(block_size=4, fingerprint=FP, local_prefill_threshold=0)
PROMPT = (7, 8, 7, 8, 7, 8, 7, 8)                      # "hello world" x 4: two full blocks
TOKENIZER = word_tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")


def worker(worker_id: str, role: str) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"{worker_id}:1", epoch=1, capacity_blocks=100, free_blocks=100,
                      block_size=4, fingerprint=FP)


class FakeWorkers:
    """The WorkerClient interface over scripted behaviours; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.reserve_errors: dict[str, list[Exception]] = {}     # endpoint -> errors raised by its next Reserves
        self.prefill_errors: dict[str, Exception] = {}           # endpoint -> error of every Prefill
        self.reserve_gate: asyncio.Event | None = None           # Reserve waits for it when set
        self.renew_errors: list[Exception] = []                  # raised by the next Renews, in order
        self.stream: list[DecodeMessage | Exception | str] = [DecodeMessage((9,)), DecodeMessage((10,)),
                                                              DecodeMessage((), (), FinishReason.LENGTH)]
        """What Decode yields; an exception is raised; "hang" waits forever."""
        self.closed_streams = 0

    def aborts(self) -> list[tuple[str, str, str]]:
        return [c[1:] for c in self.calls if c[0] == "abort"]

    async def reserve(self, endpoint, job, lease_ms, timeout):
        self.calls.append(("reserve", endpoint, job.request_id))
        if self.reserve_gate is not None:
            await self.reserve_gate.wait()
        errors = self.reserve_errors.get(endpoint)
        if errors:
            raise errors.pop(0) if len(errors) > 1 else errors[0]
        return TransferTarget(endpoint, f"h-{job.request_id}", 0)

    async def renew(self, endpoint, request_id, handle, lease_ms, timeout):
        self.calls.append(("renew", endpoint, request_id, handle, lease_ms))
        if self.renew_errors:
            raise self.renew_errors.pop(0)
        return lease_ms

    async def prefill(self, endpoint, job, target, timeout):
        self.calls.append(("prefill", endpoint, job.request_id))
        if endpoint in self.prefill_errors:
            raise self.prefill_errors[endpoint]
        return PrefillResult(8, None, 0, len(job.prompt_token_ids), 100, 1.0, "grpc", 2.0)

    async def decode(self, endpoint, request_id, handle, first, timeout):
        self.calls.append(("decode", endpoint, request_id, first is None))
        try:
            for item in self.stream:
                if item == "hang":
                    await asyncio.Event().wait()
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed_streams += 1

    async def abort(self, endpoint, role, request_id, timeout):
        self.calls.append(("abort", endpoint, role, request_id))
        return True

    async def close(self):
        pass


def make(fake: FakeWorkers, workers=(("d0", "decode"), ("p0", "prefill")), **limits):
    matches = [PrefixMatch(worker(w, role), 0) for w, role in workers]
    unreachable: list[str] = []

    async def lookup(hashes):
        return matches

    limits = {"queue_timeout_s": 0.05, **limits}
    orch = Orchestrator(POLICY, 1, TOKENIZER, lookup, fake, OrchestratorLimits(**limits),
                        on_unreachable=unreachable.append)
    return orch, unreachable


def request(request_id="r", max_tokens=16, stop=()) -> GenerationRequest:
    return GenerationRequest(request_id, PROMPT, SamplingParams(max_tokens=max_tokens, seed=1), stop)


async def run(orch, req=None, deadline=None, trace=None):
    chunks = []
    async with contextlib.aclosing(orch.generate(req or request(), deadline=deadline, arrival=time.monotonic(),
                                                 trace=trace)) as gen:
        async for chunk in gen:
            chunks.append(chunk)
    await orch.close()
    return chunks


def token_ids(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


# ------------------------------------------------------------------------------------------------ happy path
def test_remote_prefill_then_decode_streams_every_token_and_aborts_nothing():
    fake = FakeWorkers()
    orch, _ = make(fake)
    trace = RequestTrace()
    chunks = asyncio.run(run(orch, trace=trace))
    assert token_ids(chunks) == [8, 9, 10]
    assert chunks[-1].finish_reason == FinishReason.LENGTH and chunks[-1].usage.completion_tokens == 3
    assert [c[0] for c in fake.calls] == ["reserve", "prefill", "decode"]
    assert fake.aborts() == [] and trace.decode_worker == "d0" and trace.prefill_workers == ["p0"]
    assert orch.get_inflight("d0") == 0 and orch.get_inflight("p0") == 0


class DecodeHeld(FakeWorkers):
    """Decode of request "first" streams only once `release` is set: it keeps D busy meanwhile (`holding`)."""

    def __init__(self) -> None:
        super().__init__()
        self.holding, self.release = asyncio.Event(), asyncio.Event()

    async def decode(self, endpoint, request_id, handle, first, timeout):
        if request_id == "first":
            self.holding.set()
            await self.release.wait()
        async for message in super().decode(endpoint, request_id, handle, first, timeout):
            yield message


@pytest.mark.parametrize("min_tokens, second_remote", [(4, True), (0, False)])
def test_a_short_prompt_goes_to_an_idle_prefill_worker_only_while_decode_is_busy(min_tokens, second_remote):
    async def scenario():
        fake = DecodeHeld()
        orch, _ = make(fake)
        orch.policy = RoutingPolicy(block_size=4, fingerprint=FP, local_prefill_threshold=100,
                                    idle_offload_min_tokens=min_tokens)   # PROMPT: 8 tokens, short
        traces = {"first": RequestTrace(), "second": RequestTrace()}

        async def collect(request_id):
            async with contextlib.aclosing(orch.generate(request(request_id), deadline=None,
                                                         arrival=time.monotonic(), trace=traces[request_id])) as gen:
                return [chunk async for chunk in gen]

        first = asyncio.ensure_future(collect("first"))
        await fake.holding.wait()                 # D decodes "first"
        second = await collect("second")
        fake.release.set()
        first = await first
        await orch.close()
        return fake, traces, first, second

    fake, traces, first, second = asyncio.run(scenario())
    assert token_ids(first) == [9, 10] and traces["first"].local_reason == "short"   # D was idle
    prefills = [c[1:] for c in fake.calls if c[0] == "prefill"]
    if second_remote:
        assert prefills == [("p0:1", "second")] and traces["second"].prefill_workers == ["p0"]
        assert token_ids(second) == [8, 9, 10] and traces["second"].local_reason == ""
    else:
        assert prefills == [] and traces["second"].local_reason == "short" and token_ids(second) == [9, 10]


# ------------------------------------------------------------------------------------------------ prefill failures
def test_failed_prefill_aborts_both_reserves_again_under_a_new_id_and_tries_the_next_prefill_worker():
    fake = FakeWorkers()
    fake.prefill_errors["p0:1"] = WorkerUnreachable("gone")
    orch, unreachable = make(fake, workers=(("d0", "decode"), ("p0", "prefill"), ("p1", "prefill")))
    chunks = asyncio.run(run(orch))
    assert token_ids(chunks) == [8, 9, 10]
    assert [c[:3] for c in fake.calls if c[0] != "abort"] == [
        ("reserve", "d0:1", "r"), ("prefill", "p0:1", "r"), ("reserve", "d0:1", "r.retry1"),
        ("prefill", "p1:1", "r.retry1"), ("decode", "d0:1", "r.retry1")]
    assert sorted(fake.aborts()) == [("d0:1", "decode", "r"), ("p0:1", "prefill", "r")]
    assert unreachable == ["p0:1"]


def test_every_prefill_failing_falls_back_to_local_prefill_on_the_decode_worker():
    fake = FakeWorkers()
    fake.prefill_errors["p0:1"] = WorkerCallFailed("INTERNAL")
    orch, _ = make(fake, prefill_attempts=1)
    trace = RequestTrace()
    chunks = asyncio.run(run(orch, trace=trace))
    assert token_ids(chunks) == [9, 10]                     # the first token comes from D's own prefill
    assert trace.local_reason == "prefill_failed"
    assert fake.calls[-1] == ("decode", "d0:1", "r.retry1", True)


def test_no_prefill_worker_prefills_locally():
    fake = FakeWorkers()
    orch, _ = make(fake, workers=(("d0", "decode"),))
    trace = RequestTrace()
    asyncio.run(run(orch, trace=trace))
    assert trace.local_reason == "no_prefill_worker" and [c[0] for c in fake.calls] == ["reserve", "decode"]


# ------------------------------------------------------------------------------------------------ overload vs outage
def test_every_decode_worker_full_is_overloaded_with_a_retry_hint_after_the_queue():
    fake = FakeWorkers()
    fake.reserve_errors = {"d0:1": [WorkerBusy("full")], "d1:1": [WorkerBusy("full")]}
    orch, _ = make(fake, workers=(("d0", "decode"), ("d1", "decode")))
    with pytest.raises(Overloaded) as e:
        asyncio.run(run(orch))
    assert e.value.retry_after_ms > 0 and "queue" in str(e.value)
    assert sum(c[0] == "reserve" for c in fake.calls) > 2       # it tried again while queued
    assert fake.aborts() == [] and orch.num_queued == 0


def test_a_full_queue_sheds_at_once():
    fake = FakeWorkers()
    fake.reserve_errors = {"d0:1": [WorkerBusy("full")]}
    orch, _ = make(fake, workers=(("d0", "decode"),), max_queued=0)
    with pytest.raises(Overloaded, match="queue is full"):
        asyncio.run(run(orch))
    assert sum(c[0] == "reserve" for c in fake.calls) == 1


def test_a_queued_request_runs_once_a_decode_worker_has_room():
    fake = FakeWorkers()
    fake.reserve_errors = {"d0:1": [WorkerBusy("full")]}
    orch, _ = make(fake, workers=(("d0", "decode"),), queue_timeout_s=10.0)

    async def scenario():
        task = asyncio.ensure_future(run(orch))
        while orch.num_queued == 0:
            await asyncio.sleep(0)
        assert not task.done()
        fake.reserve_errors = {}
        orch.room_freed()
        return await task

    assert token_ids(asyncio.run(scenario())) == [9, 10]                # prefilled on d0 (no prefill worker)
    assert [c[2] for c in fake.calls if c[0] == "reserve"] == ["r", "r.retry1"] and orch.num_queued == 0


def test_a_slow_reserve_is_overload_not_outage_and_is_aborted():
    fake = FakeWorkers()
    fake.reserve_errors = {"d0:1": [WorkerTimedOut("slow")]}
    orch, unreachable = make(fake, workers=(("d0", "decode"),), max_queued=0)
    with pytest.raises(Overloaded):
        asyncio.run(run(orch))
    assert fake.aborts() == [("d0:1", "decode", "r")] and unreachable == []


def test_no_reachable_decode_worker_is_unavailable_and_reported():
    fake = FakeWorkers()
    fake.reserve_errors = {"d0:1": [WorkerUnreachable("refused")], "d1:1": [WorkerUnreachable("refused")]}
    orch, unreachable = make(fake, workers=(("d0", "decode"), ("d1", "decode")))
    with pytest.raises(NoWorkerAvailable):
        asyncio.run(run(orch))
    assert sorted(unreachable) == ["d0:1", "d1:1"] and fake.aborts() == []


def test_one_unreachable_and_one_full_is_overload():
    fake = FakeWorkers()
    fake.reserve_errors = {"d0:1": [WorkerUnreachable("refused")], "d1:1": [WorkerBusy("full")]}
    orch, _ = make(fake, workers=(("d0", "decode"), ("d1", "decode")), max_queued=0)
    with pytest.raises(Overloaded):
        asyncio.run(run(orch))


def test_no_registered_decode_worker_is_unavailable_without_any_call():
    fake = FakeWorkers()
    orch, _ = make(fake, workers=(("p0", "prefill"),))
    with pytest.raises(NoWorkerAvailable):
        asyncio.run(run(orch))
    assert fake.calls == []


def test_a_worker_refusing_the_request_is_invalid_argument_and_nothing_is_aborted():
    fake = FakeWorkers()
    fake.reserve_errors = {"d0:1": [InvalidRequestError("prompt", "too long")]}
    orch, _ = make(fake)
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(run(orch))
    assert e.value.field == "prompt" and fake.aborts() == []


# ------------------------------------------------------------------------------------------------ decode failures
def test_a_stream_that_breaks_fails_with_worker_failed_after_the_tokens_produced_and_aborts_d():
    fake = FakeWorkers()
    fake.stream = [DecodeMessage((9,)), WorkerUnreachable("connection reset")]
    orch, unreachable = make(fake)
    chunks = []

    async def scenario():
        with pytest.raises(WorkerFailed, match="after 2 tokens"):
            async with contextlib.aclosing(orch.generate(request(), deadline=None, arrival=time.monotonic())) as gen:
                async for chunk in gen:
                    chunks.append(chunk)
        await orch.close()

    asyncio.run(scenario())
    assert token_ids(chunks) == [8, 9]
    assert fake.aborts() == [("d0:1", "decode", "r")] and unreachable == ["d0:1"] and fake.closed_streams == 1


def test_a_hung_stream_fails_after_the_token_timeout_and_aborts_d():
    fake = FakeWorkers()
    fake.stream = [DecodeMessage((9,)), "hang"]
    orch, _ = make(fake, token_timeout_s=0.05)
    with pytest.raises(WorkerFailed, match="sent nothing"):
        asyncio.run(run(orch))
    assert fake.aborts() == [("d0:1", "decode", "r")] and fake.closed_streams == 1


def test_a_stream_ending_without_a_finish_reason_is_worker_failed():
    fake = FakeWorkers()
    fake.stream = [DecodeMessage((9,))]
    orch, _ = make(fake)
    with pytest.raises(WorkerFailed, match="without a finish reason"):
        asyncio.run(run(orch))
    assert fake.aborts() == [("d0:1", "decode", "r")]


def test_a_stream_timing_out_is_deadline_exceeded():
    fake = FakeWorkers()
    fake.stream = [WorkerTimedOut("deadline")]
    orch, _ = make(fake)
    with pytest.raises(DeadlineExceeded):
        asyncio.run(run(orch))
    assert fake.aborts() == [("d0:1", "decode", "r")]


def test_a_past_deadline_fails_before_any_call():
    fake = FakeWorkers()
    orch, _ = make(fake)
    with pytest.raises(DeadlineExceeded):
        asyncio.run(run(orch, deadline=time.monotonic() - 1))
    assert [c[0] for c in fake.calls] == []


# ------------------------------------------------------------------------------------------------ early exits
def test_a_stop_string_ends_the_request_and_aborts_d():
    fake = FakeWorkers()
    fake.stream = [DecodeMessage((9,)), DecodeMessage((10,)), "hang"]
    orch, _ = make(fake)
    chunks = asyncio.run(run(orch, request(stop=("a",))))
    assert chunks[-1].finish_reason == FinishReason.STOP
    assert fake.aborts() == [("d0:1", "decode", "r")]


def test_a_client_leaving_mid_stream_aborts_d():
    fake = FakeWorkers()
    fake.stream = [DecodeMessage((9,)), "hang"]
    orch, _ = make(fake)

    async def scenario():
        gen = orch.generate(request(), deadline=None, arrival=time.monotonic())
        assert (await anext(gen)).token_ids == (8,)
        await gen.aclose()
        await orch.close()

    asyncio.run(scenario())
    assert fake.aborts() == [("d0:1", "decode", "r")] and orch.get_inflight("d0") == 0


def test_a_cancel_landing_as_a_decode_message_arrives_is_never_lost():
    # A non-streamed HTTP completion only notices its client left by its task being cancelled, once. Messages
    # that are always ready make the cancel land, at some step, just as a message arrives: it must still end the
    # request (asyncio.wait_for on 3.11 returned the message instead and the generation ran on for nobody).
    async def flood(endpoint, request_id, handle, first, timeout):
        for _ in range(2000):
            await asyncio.sleep(0)
            yield DecodeMessage((9,))
        yield DecodeMessage((), (), FinishReason.LENGTH)

    async def trial(steps: int) -> list[tuple[str, str, str]]:
        fake = FakeWorkers()
        fake.decode = flood
        orch, _ = make(fake)

        async def collect():
            return [chunk async for chunk in orch.generate(request(), deadline=None, arrival=time.monotonic())]

        task = asyncio.ensure_future(collect())
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=5.0)
        assert done and task.cancelled(), f"cancelled after {steps} loop steps, the request ran on"
        await orch.close()
        return fake.aborts()

    for steps in range(8, 48):
        assert asyncio.run(trial(steps)) == [("d0:1", "decode", "r")], steps


def test_cancel_during_reserve_aborts_d_only_after_its_answer():
    fake = FakeWorkers()
    fake.reserve_gate = asyncio.Event()
    orch, _ = make(fake)

    async def scenario():
        task = asyncio.ensure_future(run(orch))
        while not fake.calls:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert fake.aborts() == []                          # the Reserve has not been answered yet
        fake.reserve_gate.set()
        await orch.close()

    asyncio.run(scenario())
    assert fake.aborts() == [("d0:1", "decode", "r")]


async def renewals(fake: FakeWorkers, times: int, give_up_s: float = 10.0) -> None:
    """Wait until `times` Renews were made (at most `give_up_s`: a gateway that never renews fails the test)."""
    give_up = time.monotonic() + give_up_s
    while sum(c[0] == "renew" for c in fake.calls) < times and time.monotonic() < give_up:
        await asyncio.sleep(0.001)


def prefill_until_renewed(fake: FakeWorkers, times: int):
    """A Prefill that returns once D's lease has been renewed `times` times (a prompt queued on P for longer
    than the lease)."""
    async def prefill(endpoint, job, target, timeout):
        fake.calls.append(("prefill", endpoint, job.request_id))
        await renewals(fake, times)
        return PrefillResult(8, None, 0, len(job.prompt_token_ids), 100, 1.0, "grpc", 2.0)

    return prefill


def test_the_lease_is_renewed_while_the_prefill_runs_and_no_longer():
    fake = FakeWorkers()
    fake.prefill = prefill_until_renewed(fake, 3)
    orch, _ = make(fake, lease_ms=30)
    chunks = asyncio.run(run(orch))
    assert token_ids(chunks) == [8, 9, 10] and fake.aborts() == []
    names = [c[0] for c in fake.calls]
    assert names[:2] == ["reserve", "prefill"] and names.count("renew") >= 3
    assert "renew" not in names[names.index("decode"):]
    assert {c[1:] for c in fake.calls if c[0] == "renew"} == {("d0:1", "r", "h-r", 30)}


def test_a_renew_that_times_out_is_retried_and_one_that_fails_ends_the_renewals():
    fake = FakeWorkers()
    fake.renew_errors = [WorkerTimedOut("slow"), WorkerCallFailed("FAILED_PRECONDITION: no live reservation")]
    renewed = asyncio.Event()

    async def prefill(endpoint, job, target, timeout):   # returns well after renewals would have gone on
        fake.calls.append(("prefill", endpoint, job.request_id))
        await renewals(fake, 2)
        await asyncio.sleep(0.2)
        renewed.set()
        return PrefillResult(8, None, 0, len(job.prompt_token_ids), 100, 1.0, "grpc", 2.0)

    fake.prefill = prefill
    orch, _ = make(fake, lease_ms=30)
    chunks = asyncio.run(run(orch))
    assert renewed.is_set() and token_ids(chunks) == [8, 9, 10]
    assert [c[0] for c in fake.calls].count("renew") == 2


def test_cancel_during_prefill_aborts_p_and_d():
    fake = FakeWorkers()
    gate = asyncio.Event()

    async def hanging_prefill(endpoint, job, target, timeout):
        fake.calls.append(("prefill", endpoint, job.request_id))
        await gate.wait()

    fake.prefill = hanging_prefill
    orch, _ = make(fake)

    async def scenario():
        task = asyncio.ensure_future(run(orch))
        while not any(c[0] == "prefill" for c in fake.calls):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await orch.close()

    asyncio.run(scenario())
    assert sorted(fake.aborts()) == [("d0:1", "decode", "r"), ("p0:1", "prefill", "r")]


def test_the_request_path_policy_imports_no_grpc_protobuf_redis_or_torch():
    code = ("import sys, gateway.orchestrator, gateway.discovery, gateway.routing; "
            "print(sorted(m for m in ('grpc', 'google.protobuf', 'redis', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------------ n > 1
class ChoicesWorkers(FakeWorkers):
    """Prefill samples a first token per choice; decode streams two choices interleaved."""

    async def prefill(self, endpoint, job, target, timeout):
        result = await super().prefill(endpoint, job, target, timeout)
        return dataclasses.replace(result, choice_first_tokens=((7, None),))


def test_two_choices_stream_with_their_index_each_finish_and_one_summed_usage_at_the_end():
    fake = ChoicesWorkers()
    fake.stream = [DecodeMessage((9,), choice_index=1), DecodeMessage((10,)),
                   DecodeMessage((), (), FinishReason.LENGTH, choice_index=1), DecodeMessage((9,)),
                   DecodeMessage((), (), FinishReason.STOP)]
    orch, _ = make(fake)
    req = dataclasses.replace(request(), sampling=SamplingParams(max_tokens=16, seed=1, n=2))
    chunks = asyncio.run(run(orch, req))
    by_choice = {i: [t for c in chunks if c.choice_index == i for t in c.token_ids] for i in (0, 1)}
    assert by_choice == {0: [8, 10, 9], 1: [7, 9]}
    assert [(c.choice_index, c.finish_reason) for c in chunks if c.finish_reason is not None] == \
        [(1, FinishReason.LENGTH), (0, FinishReason.STOP)]
    assert [c.usage for c in chunks if c.usage is not None] == [chunks[-1].usage]
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == len(PROMPT)
    assert fake.aborts() == []                              # D finished every choice: nothing to abort


def test_a_stream_that_ends_before_every_choice_finished_fails_and_aborts_the_decode_worker():
    fake = ChoicesWorkers()
    fake.stream = [DecodeMessage((9,)), DecodeMessage((), (), FinishReason.LENGTH)]
    orch, _ = make(fake)
    req = dataclasses.replace(request(), sampling=SamplingParams(max_tokens=16, seed=1, n=2))
    with pytest.raises(WorkerFailed):
        asyncio.run(run(orch, req))
    assert [a[1:] for a in fake.aborts()] == [("decode", "r")]
