"""One request's lifecycle across the workers (DESIGN section 3, steps 2-7), over grpc.aio stubs.

    lookup      block hashes of the prompt -> the index's matches (one Redis round trip; load-only if down)
    reserve     D.Reserve on the best decode worker; RESOURCE_EXHAUSTED / UNAVAILABLE -> the next one
    prefill     plan_prefill: remote -> P.Prefill(request, D's TransferTarget) on the best prefill worker;
                  on failure: Abort P, Abort D's reservation and wait for the answer (it is gone after a rejected
                  transfer, may be mid-transfer after a crash, and D may lack room for a second one), Reserve
                  again under a fresh worker-side id, try the next P;
                  after `prefill_attempts` failures D prefills locally. A failing P never fails a request.
                local -> no P is involved; D computes what it lacks (Decode with prefill_locally)
    decode      D.Decode streams token ids; the gateway detokenizes incrementally (UTF-8 safe), applies stop
                strings and yields `OutputChunk`s; the last one carries finish_reason, usage and timings.

Every RPC carries the remaining deadline (control RPCs at most CONTROL_TIMEOUT_S). Exactly the workers still
holding something for the request are aborted when it ends early (client cancel, deadline, stop string,
error): P while its Prefill has not returned, D from a successful Reserve until its stream reports a finish.
Aborts are best effort, run as background tasks (they must outlive a cancelled handler) and are awaited by
`close()`. A Reserve in flight when the request is cancelled is left to finish and then aborted: an Abort sent
at once could overtake it on D and find nothing, leaving the reservation to its lease.
Worker-side request ids are the request's id, then "<id>.retry<n>" for later reservations, so a late transfer
from a crashed P can never land in a new reservation.

Protobuf stays on the worker side of this module; callers get plain `OutputChunk`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from engine.errors import InvalidRequestError
from engine.sequence import FinishReason, TokenLogprob
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from gateway.routing import (Candidate, DispatchedPrefixes, RoutingPolicy, plan_prefill, rank_decode_workers,
                             rank_prefill_workers)
from gateway.request_types import (DeadlineExceeded, NoWorkerAvailable, OutputChunk, Overloaded, RequestTrace,
                                    Timings, Usage, WorkerFailed)
from gateway.stop_strings import StopStringMatcher
from gateway.validation import GenerationRequest
from kvstore.hashing import hash_prompt_blocks
from kvstore.local_index import PrefixMatch
from protos.convert import finish_reason_from_pb, logprob_from_pb, sampling_to_pb
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 5.0
"""Longest wait for Reserve, Abort and Stats (they do no compute; a worker that takes longer is unwell)."""
SUSPECT_S = 5.0
"""A worker that was unreachable is ranked last for this long (its index record outlives it by up to its TTL)."""
DISPATCHED_HOLD_S = 5.0
"""After a Prefill succeeds, its blocks count as cached on that prefill worker for this long, whatever the index
says (the worker publishes them within milliseconds; this covers a slow Redis and a publisher retrying)."""
CHANNEL_OPTIONS = [
    # Reconnect quickly to a restarted worker instead of grpc's default back-off of up to 2 minutes.
    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 8 << 20),
]


# ------------------------------------------------------------------------------------------------------ channels
class ChannelPool:
    """One grpc.aio channel per worker endpoint, shared by every request (channels multiplex calls)."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        return channel

    def decode(self, endpoint: str) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channel(endpoint))

    def prefill(self, endpoint: str) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self.channel(endpoint))

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


# ------------------------------------------------------------------------------------------------------ lifecycle
Lookup = Callable[[Sequence[int]], Awaitable[list[PrefixMatch]]]
"""block hashes -> every live worker (both roles) with its leading cached blocks; never raises."""


class _PrefillFailed(Exception):
    """A prefill attempt failed before committing anything the request can use (retry elsewhere or locally)."""


def _remaining(deadline: float | None, cap: float | None = None) -> float | None:
    """Seconds left before `deadline` (monotonic), at most `cap`; raises DeadlineExceeded when none is left."""
    if deadline is None:
        return cap
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the request's deadline passed")
    return left if cap is None else min(left, cap)


def _is_past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _invalid_from_status(err: grpc.aio.AioRpcError) -> InvalidRequestError:
    field_name, sep, message = (err.details() or "").partition(": ")
    return InvalidRequestError(field_name, message) if sep else InvalidRequestError("request", err.details() or "")


def check_context(req: GenerationRequest, decode_ranked: list[Candidate]) -> None:
    """Refuse a prompt no decode worker can hold: workers lower their context to what their KV cache fits and
    register it, which the gateway's own limit (from the model file) cannot know."""
    contexts = [int(c.worker.endpoints["max_model_len"]) for c in decode_ranked if "max_model_len" in c.worker.endpoints]
    if contexts and req.num_prompt_tokens >= max(contexts):
        raise InvalidRequestError("prompt", f"has {req.num_prompt_tokens} tokens; the decode workers hold at most "
                                            f"{max(contexts)} (prompt plus at least one generated token)")


class Orchestrator:
    """Runs requests across the workers; owns the per-worker in-flight counts and the suspects list."""

    def __init__(self, policy: RoutingPolicy, root_hash: int, tokenizer: Tokenizer, lookup: Lookup,
                 channels: ChannelPool, *, lease_ms: int, prefill_attempts: int, max_inflight: int) -> None:
        self.policy = policy
        self.root_hash = root_hash
        self.tokenizer = tokenizer
        self.lookup = lookup
        self.channels = channels
        self.lease_ms = lease_ms
        self.prefill_attempts = prefill_attempts
        self.max_inflight = max_inflight
        self.running_ids: set[str] = set()
        """Request ids in flight on this gateway (validation refuses a duplicate)."""
        self._inflight: Counter[str] = Counter()
        self._turns: Counter[str] = Counter()                    # per role, for round-robin routing
        self._suspect_until: dict[str, float] = {}
        self.dispatched = DispatchedPrefixes(DISPATCHED_HOLD_S)
        """Prompt blocks sent to prefill workers that the index may not know yet (routing.DispatchedPrefixes)."""
        self._background: set[asyncio.Task] = set()

    # --- admission --------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def admit(self, request_id: str):
        """Hold one of max_inflight slots and the request id for the request's whole life."""
        if len(self.running_ids) >= self.max_inflight:
            raise Overloaded(f"the gateway is at its limit of {self.max_inflight} requests in flight")
        self.running_ids.add(request_id)
        try:
            yield
        finally:
            self.running_ids.discard(request_id)

    async def close(self, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        """Wait (bounded) for pending aborts, then close the channels."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)
        await self.channels.close()

    # --- one request ------------------------------------------------------------------------------------------
    async def generate(self, req: GenerationRequest, *, deadline: float | None, arrival: float,
                       trace: RequestTrace | None = None) -> AsyncIterator[OutputChunk]:
        """Run `req`; `deadline` and `arrival` are time.monotonic() values. Raises NoWorkerAvailable,
        Overloaded, DeadlineExceeded, WorkerFailed or InvalidRequestError (a worker refused the request)."""
        trace = trace if trace is not None else RequestTrace()
        run = _Run(self, req, deadline, arrival, trace)
        try:
            async for chunk in run.execute():
                yield chunk
        finally:
            run.release()

    def get_inflight(self, worker_id: str) -> int:
        """Requests of this gateway on a worker: decode from Reserve to the end, prefill during Prefill."""
        return self._inflight.get(worker_id, 0)

    # --- helpers used by _Run ---------------------------------------------------------------------------------
    def suspects(self) -> set[str]:
        now = time.monotonic()
        for worker_id in [w for w, until in self._suspect_until.items() if until <= now]:
            del self._suspect_until[worker_id]
        return set(self._suspect_until)

    def take_turn(self, role: str) -> int:
        turn = self._turns[role]
        self._turns[role] += 1
        return turn

    def mark_suspect(self, worker_id: str) -> None:
        self._suspect_until[worker_id] = time.monotonic() + SUSPECT_S

    def abort_later(self, candidate: Candidate, role: str, worker_request_id: str) -> None:
        """Best-effort Abort in a background task (it must run even when the request's task is cancelled)."""
        self._spawn(self._abort(candidate, role, worker_request_id))

    async def abort_now(self, candidate: Candidate, role: str, worker_request_id: str) -> None:
        """Abort and wait for the answer (at most CONTROL_TIMEOUT_S); it completes even if the caller is
        cancelled meanwhile."""
        await asyncio.shield(self._spawn(self._abort(candidate, role, worker_request_id)))

    def abort_after(self, reserve_call: asyncio.Future, candidate: Candidate, worker_request_id: str) -> None:
        """Abort on decode worker `candidate` once its pending Reserve has been answered, unless it refused."""
        async def run() -> None:
            try:
                await reserve_call
            except grpc.aio.AioRpcError as err:
                if err.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.UNAVAILABLE):
                    return                           # nothing was reserved
            await self._abort(candidate, "decode", worker_request_id)

        self._spawn(run())

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _abort(self, candidate: Candidate, role: str, worker_request_id: str) -> None:
        stub = self.channels.decode(candidate.endpoint) if role == "decode" else \
            self.channels.prefill(candidate.endpoint)
        try:
            await stub.Abort(worker_pb2.AbortRequest(request_id=worker_request_id), timeout=CONTROL_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            log.warning("Abort(%s) on %s worker %s failed: %s %s", worker_request_id, role, candidate.worker_id,
                        err.code().name, err.details())


@dataclass
class _Reservation:
    decode: Candidate
    worker_request_id: str
    target: worker_pb2.TransferTarget


class _Run:
    """The state of one request while it runs: what it holds on which worker, and its timings."""

    def __init__(self, orch: Orchestrator, req: GenerationRequest, deadline: float | None, arrival: float,
                 trace: RequestTrace) -> None:
        self.orch = orch
        self.req = req
        self.deadline = deadline
        self.arrival = arrival
        self.trace = trace
        self.sampling_pb = sampling_to_pb(req.sampling)          # stop strings stay here
        self.reservation: _Reservation | None = None             # live on D until its stream finishes
        self.prefilling: tuple[Candidate, str] | None = None     # P and worker-side id while Prefill runs
        self.num_reservations = 0
        self.counted: Counter[str] = Counter()                   # this request's share of orch._inflight
        self.reserved_at = arrival                               # when the (last) reservation succeeded
        self.cached_on_decode = 0                                # prompt tokens D already held at Reserve
        self.first_token_at: float | None = None

    # --- bookkeeping ------------------------------------------------------------------------------------------
    def _count(self, worker_id: str, delta: int) -> None:
        self.orch._inflight[worker_id] += delta
        self.counted[worker_id] += delta

    def release(self) -> None:
        """Abort whatever the request still holds on a worker; drop its in-flight counts."""
        if self.prefilling is not None:
            self.orch.abort_later(self.prefilling[0], "prefill", self.prefilling[1])
            self.prefilling = None
        if self.reservation is not None:
            self.orch.abort_later(self.reservation.decode, "decode", self.reservation.worker_request_id)
            self.reservation = None
        for worker_id, n in self.counted.items():
            self.orch._inflight[worker_id] -= n
            if self.orch._inflight[worker_id] <= 0:
                self.orch._inflight.pop(worker_id)
        self.counted.clear()

    def _ms(self, t: float) -> float:
        return (t - self.arrival) * 1000.0

    def _worker_request(self, worker_request_id: str) -> worker_pb2.WorkerRequest:
        return worker_pb2.WorkerRequest(request_id=worker_request_id, prompt_token_ids=self.req.prompt_token_ids,
                                        sampling=self.sampling_pb, cache_salt=self.req.cache_salt,
                                        seed=self.req.sampling.seed)

    # --- steps ------------------------------------------------------------------------------------------------
    async def execute(self) -> AsyncIterator[OutputChunk]:
        orch, req, policy = self.orch, self.req, self.orch.policy
        hashes = hash_prompt_blocks(req.prompt_token_ids, policy.block_size, orch.root_hash, req.cache_salt or None)
        matches = await orch.lookup(hashes)
        suspects = orch.suspects()
        decode_ranked = rank_decode_workers(matches, policy, req.num_prompt_tokens, orch._inflight, suspects,
                                            orch.take_turn("decode"))
        if not decode_ranked:
            raise NoWorkerAvailable("no live decode worker serves this model")
        check_context(req, decode_ranked)
        await self._reserve(decode_ranked)

        # Ranked now, not before Reserve: with no await between ranking and _prefill counting its choice, a
        # burst of requests sees each other's prefills and spreads over the prefill workers.
        prefill_ranking = rank_prefill_workers(matches, policy, orch._inflight, orch.suspects(),
                                               orch.take_turn("prefill"),
                                               orch.dispatched.leading_blocks(hashes, time.monotonic()))
        num_cached_on_decode = self.reservation.target.num_cached_blocks * policy.block_size
        plan = plan_prefill(req.num_prompt_tokens, num_cached_on_decode, prefill_ranking, policy)
        prefill = None
        if plan.local:
            self.trace.local_reason = plan.reason
        else:
            for candidate in plan.candidates[:orch.prefill_attempts]:
                try:
                    prefill = await self._prefill(candidate, hashes)
                    break
                except _PrefillFailed:
                    # The reservation is gone (rejected transfer) or may still be receiving (P crashed): replace it.
                    # Its blocks are freed before new ones are asked for: D may not have room for both.
                    old = self.reservation
                    self.reservation = None
                    self._count(old.decode.worker_id, -1)
                    await orch.abort_now(old.decode, "decode", old.worker_request_id)
                    await self._reserve([old.decode] + [c for c in decode_ranked if c is not old.decode])
            if prefill is None:
                self.trace.local_reason = "prefill_failed"
        async for chunk in self._decode(prefill):
            yield chunk

    async def _reserve(self, candidates: Sequence[Candidate]) -> None:
        """Reserve on the first decode worker that has room; sets self.reservation."""
        worker_request_id = self.req.request_id if self.num_reservations == 0 else \
            f"{self.req.request_id}.retry{self.num_reservations}"
        self.num_reservations += 1
        request = worker_pb2.ReserveRequest(request=self._worker_request(worker_request_id),
                                            lease_ms=self.orch.lease_ms)
        num_full = 0
        for candidate in candidates:
            call = asyncio.ensure_future(self.orch.channels.decode(candidate.endpoint).Reserve(
                request, timeout=_remaining(self.deadline, CONTROL_TIMEOUT_S)))
            self._count(candidate.worker_id, 1)      # before awaiting, so concurrent rankings see it
            try:
                # Shielded: a cancelled caller must not cancel the RPC, whose reservation is then aborted once
                # D has made it (an Abort racing ahead of the Reserve would find nothing).
                response = await asyncio.shield(call)
            except asyncio.CancelledError:
                self.orch.abort_after(call, candidate, worker_request_id)
                raise
            except grpc.aio.AioRpcError as err:
                self._count(candidate.worker_id, -1)
                code = err.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise _invalid_from_status(err) from err
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    num_full += 1
                    continue
                if _is_past(self.deadline):
                    raise DeadlineExceeded("the request's deadline passed while reserving") from err
                if code == grpc.StatusCode.UNAVAILABLE:
                    self.orch.mark_suspect(candidate.worker_id)
                else:  # it may hold blocks for us (e.g. it answered after our timeout)
                    self.orch.abort_later(candidate, "decode", worker_request_id)
                log.warning("Reserve on decode worker %s failed (%s: %s); trying the next one",
                            candidate.worker_id, code.name, err.details())
                continue
            self.reservation = _Reservation(candidate, worker_request_id, response.target)
            self.trace.decode_worker = candidate.worker_id
            self.reserved_at = time.monotonic()
            self.cached_on_decode = response.target.num_cached_blocks * self.orch.policy.block_size
            return
        if num_full:
            raise Overloaded(f"no decode worker has room for {self.req.num_prompt_tokens} prompt tokens "
                             f"({num_full} full)")
        raise NoWorkerAvailable("no decode worker answered Reserve")

    async def _prefill(self, candidate: Candidate,
                       hashes: Sequence[int]) -> tuple[worker_pb2.PrefillResponse, float]:
        """Prefill on `candidate` into the current reservation; returns (response, RPC wall ms). `hashes`: the
        prompt's block hashes, remembered as dispatched to `candidate` (no await before, see execute)."""
        res = self.reservation
        self.trace.prefill_workers.append(candidate.worker_id)
        self.prefilling = (candidate, res.worker_request_id)
        self._count(candidate.worker_id, 1)
        self.orch.dispatched.start(candidate.worker_id, hashes)
        held = False
        start = time.monotonic()
        try:
            response = await self.orch.channels.prefill(candidate.endpoint).Prefill(
                worker_pb2.PrefillRequest(request=self._worker_request(res.worker_request_id), target=res.target),
                timeout=_remaining(self.deadline))
        except grpc.aio.AioRpcError as err:
            self.orch.abort_later(candidate, "prefill", res.worker_request_id)
            self.prefilling = None
            if _is_past(self.deadline):
                raise DeadlineExceeded("the request's deadline passed during prefill") from err
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self.orch.mark_suspect(candidate.worker_id)
            log.warning("Prefill of %s on %s failed (%s: %s)", res.worker_request_id, candidate.worker_id,
                        err.code().name, err.details())
            raise _PrefillFailed() from err
        else:
            held = True
        finally:
            self._count(candidate.worker_id, -1)
            self.orch.dispatched.finish(candidate.worker_id, hashes, time.monotonic(), held)
        self.prefilling = None
        return response, (time.monotonic() - start) * 1000.0

    async def _decode(self, prefill: tuple[worker_pb2.PrefillResponse, float] | None
                      ) -> AsyncIterator[OutputChunk]:
        res = self.reservation
        local = prefill is None
        request = worker_pb2.DecodeRequest(request_id=res.worker_request_id, handle=res.target.handle,
                                           prefill_locally=local)
        if not local:
            response = prefill[0]
            request.first_token_id = response.first_token_id
            if response.HasField("first_logprob"):
                request.first_logprob.CopyFrom(response.first_logprob)
        decode_start = time.monotonic()
        call = self.orch.channels.decode(res.decode.endpoint).Decode(request, timeout=_remaining(self.deadline))
        out = _Output(self.orch.tokenizer, self.req)
        try:
            if not local:
                first_lp = (logprob_from_pb(response.first_logprob),) if response.HasField("first_logprob") else ()
                chunk = out.add([response.first_token_id], first_lp)
                self.first_token_at = time.monotonic()
                if out.stopped:
                    yield self._final(out, chunk, FinishReason.STOP, prefill, decode_start)
                    return
                yield chunk
            async for msg in call:
                if msg.token_ids and self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                chunk = out.add(list(msg.token_ids), tuple(logprob_from_pb(lp) for lp in msg.logprobs))
                if out.stopped:
                    yield self._final(out, chunk, FinishReason.STOP, prefill, decode_start)
                    return
                reason = finish_reason_from_pb(msg.finish_reason)
                if reason is not None:
                    self.reservation = None          # D finished it: nothing left to abort there
                    final = out.merge(chunk, out.finish())   # the flushed tail may complete a stop string
                    yield self._final(out, final, FinishReason.STOP if out.stopped else reason, prefill,
                                      decode_start)
                    return
                if chunk.token_ids or chunk.text:
                    yield chunk
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED or _is_past(self.deadline):
                raise DeadlineExceeded("the request's deadline passed while decoding") from err
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise _invalid_from_status(err) from err
            if code == grpc.StatusCode.UNAVAILABLE:
                self.orch.mark_suspect(res.decode.worker_id)
            raise WorkerFailed(f"decode worker {res.decode.worker_id} failed after {out.num_tokens} tokens: "
                               f"{code.name}: {err.details()}") from err
        finally:
            call.cancel()                            # no-op when the stream already ended
        raise WorkerFailed(f"decode worker {res.decode.worker_id} ended the stream without a finish reason")

    def _final(self, out: _Output, chunk: OutputChunk, reason: FinishReason,
               prefill: tuple[worker_pb2.PrefillResponse, float] | None, decode_start: float) -> OutputChunk:
        first_token_at = self.first_token_at or time.monotonic()
        reserved_at = self.reserved_at
        if prefill is None:
            cached = self.cached_on_decode
            timings = Timings(queue_ms=self._ms(reserved_at), prefill_ms=(first_token_at - decode_start) * 1000.0,
                              transfer_ms=0.0, ttft_ms=self._ms(first_token_at), transport="local",
                              transfer_bytes=0)
        else:
            response, wall_ms = prefill
            cached = response.cached_tokens
            worker_queue_ms = max(wall_ms - response.prefill_ms - response.transfer_ms, 0.0)
            timings = Timings(queue_ms=self._ms(reserved_at) + worker_queue_ms, prefill_ms=response.prefill_ms,
                              transfer_ms=response.transfer_ms, ttft_ms=self._ms(first_token_at),
                              transport=response.transport, transfer_bytes=response.transfer_bytes)
        usage = Usage(self.req.num_prompt_tokens, out.num_tokens, cached)
        return OutputChunk(chunk.text, chunk.token_ids, chunk.logprobs, reason, usage, timings)


class _Output:
    """Token ids -> text deltas (UTF-8 safe) -> stop strings."""

    def __init__(self, tokenizer: Tokenizer, req: GenerationRequest) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, req.prompt_token_ids)
        self._stop = StopStringMatcher(req.stop)
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def add(self, token_ids: list[int], logprobs: tuple[TokenLogprob, ...]) -> OutputChunk:
        self.num_tokens += len(token_ids)
        text, _ = self._stop.add(self._detokenizer.add(token_ids)) if token_ids else ("", False)
        return OutputChunk(text, tuple(token_ids), logprobs)

    def finish(self) -> OutputChunk:
        """The end of the stream: text held back by the detokenizer or the stop-string matcher."""
        text, _ = self._stop.add(self._detokenizer.flush())
        return OutputChunk(text + self._stop.flush(), ())

    @staticmethod
    def merge(a: OutputChunk, b: OutputChunk) -> OutputChunk:
        return OutputChunk(a.text + b.text, a.token_ids + b.token_ids, a.logprobs + b.logprobs)
