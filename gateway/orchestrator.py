"""One request's lifecycle across the workers (DESIGN section 3, steps 2-7), over a `WorkerClient`
(gateway.worker_client: plain dataclasses and domain errors; this module imports neither grpc nor protobuf).

    lookup      block hashes of the prompt -> the index's matches (one Redis round trip; load-only if down)
    reserve     D.Reserve on the best decode worker; busy (WorkerBusy) or slow (WorkerTimedOut) -> the next
                one; unreachable -> the next one, and it is reported down (gateway.discovery).
                When every decode worker is busy or slow, the request waits in the gateway's queue (at most
                `max_queued` requests, each at most `queue_timeout_s`) and tries again whenever a request of
                this gateway releases decode blocks; then Overloaded (RESOURCE_EXHAUSTED, retry hint).
                NoWorkerAvailable (UNAVAILABLE) only when no decode worker is alive.
    prefill     plan_prefill: remote -> P.Prefill(request, D's TransferTarget) on the best prefill worker;
                  while it runs, D's lease is renewed every third of it (a prompt may wait on a busy P for
                  longer than one lease: without this its KV would find the reservation released);
                  on failure: Abort P, Abort D's reservation and wait for the answer (it is gone after a rejected
                  transfer, may be mid-transfer after a crash, and D may lack room for a second one), Reserve
                  again under a fresh worker-side id, try the next P;
                  after `prefill_attempts` failures D prefills locally. A failing P never fails a request.
                local -> no P is involved; D computes what it lacks (Decode with prefill_locally)
    decode      D.Decode streams token ids; the gateway detokenizes incrementally (UTF-8 safe), applies stop
                strings and yields `OutputChunk`s; the last one carries finish_reason, usage and timings.
                n > 1: one Reserve, one Prefill (n first tokens), one KV transfer; D forks the choices and
                streams each one's tokens with its index; each choice has its own detokenizer and stop
                strings, its last chunk its finish_reason, and the request's last chunk the usage (completion
                tokens summed over the choices) and timings.
                A stream that sends nothing for `token_timeout_s` (a hung worker), breaks or fails ends the
                request with WorkerFailed (UNAVAILABLE) after the chunks already yielded.

Every RPC carries the remaining deadline (control RPCs at most CONTROL_TIMEOUT_S). Exactly the workers still
holding something for the request are aborted when it ends early (client cancel, deadline, stop string,
error): P while its Prefill has not returned, D from a successful Reserve until its stream reports a finish.
Aborts are best effort, run as background tasks (they must outlive a cancelled handler) and are awaited by
`close()`. A Reserve in flight when the request is cancelled is left to finish and then aborted: an Abort sent
at once could overtake it on D and find nothing, leaving the reservation to its lease.
Worker-side request ids are the request's id, then "<id>.retry<n>" for later reservations, so a late transfer
from a crashed P can never land in a new reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence, Set
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.sequence import FinishReason, PromptLogprob
from engine.tokenizer import Tokenizer
from gateway.output_stream import OutputStream
from gateway.request_types import (DeadlineExceeded, NoWorkerAvailable, OutputChunk, Overloaded, RequestTrace,
                                    Timings, Usage, WorkerFailed)
from gateway.routing import (Candidate, DispatchedPrefixes, RoutingPolicy, plan_prefill, rank_decode_workers,
                             rank_prefill_workers)
from gateway.validation import GenerationRequest
from gateway.worker_types import (PrefillResult, TransferTarget, WorkerBusy, WorkerClient, WorkerError, WorkerJob,
                                  WorkerTimedOut, WorkerUnreachable)
from kvstore.hashing import hash_prompt_blocks
from kvstore.local_index import PrefixMatch

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 5.0
"""Longest wait for Reserve and Abort (they do no compute; a worker that takes longer is overloaded or unwell)."""
SUSPECT_S = 5.0
"""A worker that was unreachable is ranked last for this long (its index record outlives it by up to its TTL)."""
DISPATCHED_HOLD_S = 5.0
"""After a Prefill succeeds, its blocks count as cached on that prefill worker for this long, whatever the index
says (the worker publishes them within milliseconds; this covers a slow Redis and a publisher retrying)."""
QUEUE_POLL_S = 0.2
"""A queued request also retries this often (room may come from another gateway's requests)."""


Lookup = Callable[[Sequence[int]], Awaitable[list[PrefixMatch]]]
"""block hashes -> every live worker (both roles) with its leading cached blocks; never raises."""


@dataclass(frozen=True)
class OrchestratorLimits:
    """The orchestrator's bounds (GatewayConfig fields of the same names)."""

    lease_ms: int = 30_000
    prefill_attempts: int = 2
    max_inflight: int = 256
    max_queued: int = 256
    queue_timeout_s: float = 5.0
    token_timeout_s: float = 60.0


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


def check_context(req: GenerationRequest, decode_ranked: list[Candidate]) -> None:
    """Refuse a prompt no decode worker can hold: workers lower their context to what their KV cache fits and
    register it, which the gateway's own limit (from the model file) cannot know. 0 means not reported."""
    contexts = [c.worker.max_model_len for c in decode_ranked if c.worker.max_model_len]
    if contexts and req.num_prompt_tokens >= max(contexts):
        raise InvalidRequestError("prompt", f"has {req.num_prompt_tokens} tokens; the decode workers hold at most "
                                            f"{max(contexts)} (prompt plus at least one generated token)")


class Orchestrator:
    """Runs requests across the workers; owns the per-worker in-flight counts, the suspects list and the queue.

    `on_unreachable(endpoint)` is told of every worker found unreachable (gateway.discovery marks it down);
    `down()` names the endpoints known down now (ranked last, like suspects)."""

    def __init__(self, policy: RoutingPolicy, root_hash: int, tokenizer: Tokenizer, lookup: Lookup,
                 client: WorkerClient, limits: OrchestratorLimits = OrchestratorLimits(), *,
                 on_unreachable: Callable[[str], None] = lambda endpoint: None,
                 down: Callable[[], Set[str]] = frozenset) -> None:
        self.policy = policy
        self.root_hash = root_hash
        self.tokenizer = tokenizer
        self.lookup = lookup
        self.client = client
        self.limits = limits
        self.on_unreachable = on_unreachable
        self.down = down
        self.running_ids: set[str] = set()
        """Request ids in flight on this gateway (validation refuses a duplicate)."""
        self.num_queued = 0
        """Requests waiting for room on a decode worker."""
        self._inflight: Counter[str] = Counter()
        self._turns: Counter[str] = Counter()                    # per role, for round-robin routing
        self._suspect_until: dict[str, float] = {}
        self._room = asyncio.Event()
        self.dispatched = DispatchedPrefixes(DISPATCHED_HOLD_S)
        """Prompt blocks sent to prefill workers that the index may not know yet (routing.DispatchedPrefixes)."""
        self._background: set[asyncio.Task] = set()

    # --- admission --------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def admit(self, request_id: str):
        """Hold one of max_inflight slots and the request id for the request's whole life."""
        if len(self.running_ids) >= self.limits.max_inflight:
            raise Overloaded(f"the gateway is at its limit of {self.limits.max_inflight} requests in flight")
        self.running_ids.add(request_id)
        try:
            yield
        finally:
            self.running_ids.discard(request_id)

    async def close(self, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        """Wait (bounded) for pending aborts, then close the worker client."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)
        await self.client.close()

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
    def suspects(self, matches: Sequence[PrefixMatch] = ()) -> set[str]:
        """Worker ids ranked last: recently failed, or (among `matches`) with an endpoint known down."""
        now = time.monotonic()
        for worker_id in [w for w, until in self._suspect_until.items() if until <= now]:
            del self._suspect_until[worker_id]
        down = self.down()
        return set(self._suspect_until) | {m.worker.worker_id for m in matches if m.worker.grpc_endpoint in down}

    def take_turn(self, role: str) -> int:
        turn = self._turns[role]
        self._turns[role] += 1
        return turn

    def mark_suspect(self, candidate: Candidate, unreachable: bool) -> None:
        self._suspect_until[candidate.worker_id] = time.monotonic() + SUSPECT_S
        if unreachable:
            self.on_unreachable(candidate.endpoint)

    def room_freed(self) -> None:
        """Decode blocks of this gateway's requests were released: queued requests try again."""
        self._room.set()
        self._room = asyncio.Event()

    async def wait_for_room(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):       # not wait_for: it can lose a cancellation (see _decode)
                await self._room.wait()

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
            await asyncio.wait([reserve_call])
            error = None if reserve_call.cancelled() else reserve_call.exception()
            if isinstance(error, (WorkerBusy, WorkerUnreachable, InvalidRequestError)):
                return                           # refused: nothing was reserved
            # reserved, or failed in a way that may have reserved (e.g. answered after our timeout)
            await self._abort(candidate, "decode", worker_request_id)

        self._spawn(run())

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _abort(self, candidate: Candidate, role: str, worker_request_id: str) -> None:
        try:
            await self.client.abort(candidate.endpoint, role, worker_request_id, CONTROL_TIMEOUT_S)
        except (WorkerError, InvalidRequestError) as err:
            log.warning("Abort(%s) on %s worker %s failed: %s", worker_request_id, role, candidate.worker_id, err)
        if role == "decode":
            self.room_freed()


@dataclass
class _Reservation:
    decode: Candidate
    worker_request_id: str
    target: TransferTarget


class _Run:
    """The state of one request while it runs: what it holds on which worker, and its timings."""

    def __init__(self, orch: Orchestrator, req: GenerationRequest, deadline: float | None, arrival: float,
                 trace: RequestTrace) -> None:
        self.orch = orch
        self.req = req
        self.deadline = deadline
        self.arrival = arrival
        self.trace = trace
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

    def _job(self, worker_request_id: str) -> WorkerJob:
        return WorkerJob(worker_request_id, self.req.prompt_token_ids, self.req.sampling, self.req.cache_salt)

    # --- steps ------------------------------------------------------------------------------------------------
    async def execute(self) -> AsyncIterator[OutputChunk]:
        orch, req, policy = self.orch, self.req, self.orch.policy
        hashes = hash_prompt_blocks(req.prompt_token_ids, policy.block_size, orch.root_hash, req.cache_salt or None)
        matches, decode_ranked = await self._reserve_or_queue(hashes)

        # Ranked now, not before Reserve: with no await between ranking and _prefill counting its choice, a
        # burst of requests sees each other's prefills and spreads over the prefill workers.
        prefill_ranking = rank_prefill_workers(matches, policy, orch._inflight, orch.suspects(matches),
                                               orch.take_turn("prefill"),
                                               orch.dispatched.leading_blocks(hashes, time.monotonic()))
        num_cached_on_decode = self.reservation.target.num_cached_blocks * policy.block_size
        plan = plan_prefill(req.num_prompt_tokens, num_cached_on_decode, prefill_ranking, policy,
                            self.reservation.decode.load)
        prefill = None
        if plan.local:
            self.trace.local_reason = plan.reason
        else:
            for candidate in plan.candidates[:orch.limits.prefill_attempts]:
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

    async def _reserve_or_queue(self, hashes: Sequence[int]) -> tuple[list[PrefixMatch], list[Candidate]]:
        """Look up and Reserve; while every decode worker is busy, wait in the gateway's queue (module doc)."""
        orch, limits = self.orch, self.orch.limits
        give_up = time.monotonic() + limits.queue_timeout_s
        if self.deadline is not None:
            give_up = min(give_up, self.deadline)
        queued = False
        try:
            while True:
                matches = await orch.lookup(hashes)
                decode_ranked = rank_decode_workers(matches, orch.policy, self.req.num_prompt_tokens, orch._inflight,
                                                    orch.suspects(matches), orch.take_turn("decode"))
                if not decode_ranked:
                    raise NoWorkerAvailable("no live decode worker serves this model")
                check_context(self.req, decode_ranked)
                try:
                    await self._reserve(decode_ranked)
                    return matches, decode_ranked
                except Overloaded as exc:
                    if not queued:
                        if orch.num_queued >= limits.max_queued:
                            raise Overloaded(f"{exc}; the gateway's queue is full ({limits.max_queued})") from exc
                        orch.num_queued += 1
                        queued = True
                    left = give_up - time.monotonic()
                    if left <= 0:
                        if _is_past(self.deadline):
                            raise DeadlineExceeded("the request's deadline passed while queued") from exc
                        raise Overloaded(f"{exc}; waited {limits.queue_timeout_s:g}s in the gateway's queue") \
                            from exc
                    await orch.wait_for_room(min(left, QUEUE_POLL_S))
        finally:
            if queued:
                orch.num_queued -= 1

    async def _reserve(self, candidates: Sequence[Candidate]) -> None:
        """Reserve on the first decode worker that has room; sets self.reservation. Raises Overloaded when every
        one that answered was full or slow, NoWorkerAvailable when none could be reached."""
        worker_request_id = self.req.request_id if self.num_reservations == 0 else \
            f"{self.req.request_id}.retry{self.num_reservations}"
        self.num_reservations += 1
        job = self._job(worker_request_id)
        num_busy = 0
        for candidate in candidates:
            call = asyncio.ensure_future(self.orch.client.reserve(
                candidate.endpoint, job, self.orch.limits.lease_ms, _remaining(self.deadline, CONTROL_TIMEOUT_S)))
            self._count(candidate.worker_id, 1)      # before awaiting, so concurrent rankings see it
            try:
                # Shielded: a cancelled caller must not cancel the RPC, whose reservation is then aborted once
                # D has made it (an Abort racing ahead of the Reserve would find nothing).
                target = await asyncio.shield(call)
            except asyncio.CancelledError:
                self.orch.abort_after(call, candidate, worker_request_id)
                raise
            except InvalidRequestError:
                self._count(candidate.worker_id, -1)
                raise
            except WorkerBusy:
                self._count(candidate.worker_id, -1)
                num_busy += 1
                continue
            except WorkerError as err:
                self._count(candidate.worker_id, -1)
                if _is_past(self.deadline):
                    raise DeadlineExceeded("the request's deadline passed while reserving") from err
                if isinstance(err, WorkerUnreachable):
                    self.orch.mark_suspect(candidate, unreachable=True)
                else:   # slow (alive: overload, not outage) or failed; it may hold blocks for us
                    num_busy += isinstance(err, WorkerTimedOut)
                    self.orch.abort_later(candidate, "decode", worker_request_id)
                log.warning("Reserve on decode worker %s failed (%s); trying the next one", candidate.worker_id, err)
                continue
            self.reservation = _Reservation(candidate, worker_request_id, target)
            self.trace.decode_worker = candidate.worker_id
            self.reserved_at = time.monotonic()
            self.cached_on_decode = target.num_cached_blocks * self.orch.policy.block_size
            return
        if num_busy:
            raise Overloaded(f"no decode worker has room for {self.req.num_prompt_tokens} prompt tokens "
                             f"({num_busy} full or too slow to answer)")
        raise NoWorkerAvailable("no decode worker answered Reserve")

    async def _prefill(self, candidate: Candidate, hashes: Sequence[int]) -> tuple[PrefillResult, float]:
        """Prefill on `candidate` into the current reservation; returns (result, RPC wall ms). `hashes`: the
        prompt's block hashes, remembered as dispatched to `candidate` (no await before, see execute)."""
        res = self.reservation
        self.trace.prefill_workers.append(candidate.worker_id)
        self.prefilling = (candidate, res.worker_request_id)
        self._count(candidate.worker_id, 1)
        self.orch.dispatched.start(candidate.worker_id, hashes)
        held = False
        start = time.monotonic()
        renewing = asyncio.get_running_loop().create_task(self._keep_reserved(res))
        try:
            result = await self.orch.client.prefill(candidate.endpoint, self._job(res.worker_request_id),
                                                    res.target, _remaining(self.deadline))
        except (WorkerError, InvalidRequestError) as err:
            self.orch.abort_later(candidate, "prefill", res.worker_request_id)
            self.prefilling = None
            if _is_past(self.deadline):
                raise DeadlineExceeded("the request's deadline passed during prefill") from err
            if isinstance(err, WorkerUnreachable):
                self.orch.mark_suspect(candidate, unreachable=True)
            log.warning("Prefill of %s on %s failed (%s)", res.worker_request_id, candidate.worker_id, err)
            raise _PrefillFailed() from err
        else:
            held = True
        finally:
            renewing.cancel()
            self._count(candidate.worker_id, -1)
            self.orch.dispatched.finish(candidate.worker_id, hashes, time.monotonic(), held)
        self.prefilling = None
        return result, (time.monotonic() - start) * 1000.0

    async def _keep_reserved(self, res: _Reservation) -> None:
        """Renew D's lease every third of it until cancelled (when the Prefill returns). A Renew that times out is
        tried again at once; one that fails otherwise ends the renewals (the reservation or D is gone: the push
        fails and the prefill is retried, module doc)."""
        lease_ms = res.target.lease_ms or self.orch.limits.lease_ms
        delay_s = lease_ms / 3000
        while True:
            await asyncio.sleep(delay_s)
            try:
                lease_ms = await self.orch.client.renew(res.decode.endpoint, res.worker_request_id, res.target.handle,
                                                        self.orch.limits.lease_ms,
                                                        min(CONTROL_TIMEOUT_S, lease_ms / 3000)) or lease_ms
            except WorkerTimedOut:
                delay_s = 0.0
                continue
            except (WorkerError, InvalidRequestError) as err:
                log.warning("Renew of %s on decode worker %s failed (%s)", res.worker_request_id,
                            res.decode.worker_id, err)
                return
            delay_s = lease_ms / 3000

    async def _decode(self, prefill: tuple[PrefillResult, float] | None) -> AsyncIterator[OutputChunk]:
        """The decode stream as OutputChunks, each choice (n > 1) through its own OutputStream. A choice ends at
        its finish on D or at a stop string here; D keeps decoding a choice stopped here until the request
        ends (the request's end aborts what D still runs)."""
        res, orch = self.reservation, self.orch
        first = prefill[0] if prefill is not None else None
        decode_start = time.monotonic()
        outs = [OutputStream(orch.tokenizer, self.req, i) for i in range(self.req.sampling.n)]
        open_choices = set(range(len(outs)))         # not yet ended for the client
        num_running_on_decode = len(outs)            # not yet finished by D
        token_timeout_s = orch.limits.token_timeout_s
        stream = orch.client.decode(res.decode.endpoint, res.worker_request_id, res.target.handle, first,
                                    _remaining(self.deadline))

        def end(out: OutputStream, chunk: OutputChunk, reason: FinishReason) -> OutputChunk:
            open_choices.discard(out.choice_index)
            if open_choices:
                return dataclasses.replace(chunk, finish_reason=reason)
            return self._final(chunk, reason, prefill, decode_start, sum(o.num_tokens for o in outs))

        try:
            if first is not None:
                self.first_token_at = time.monotonic()
                firsts = [(first.first_token_id, first.first_logprob), *first.choice_first_tokens]
                for out, (token_id, logprob) in zip(outs, firsts):   # prompt logprobs: with choice 0's
                    chunk = out.add([token_id], (logprob,) if logprob is not None else (),
                                    self._prompt_logprobs(first.prompt_logprobs, self.trace.prefill_workers[-1])
                                    if out.choice_index == 0 else None)
                    yield end(out, chunk, FinishReason.STOP) if out.stopped else chunk
            while open_choices:
                try:
                    # asyncio.timeout, not wait_for: on 3.11 wait_for loses a cancellation (client disconnect) that
                    # lands as the next message arrives, and the generation would run on for nobody.
                    async with asyncio.timeout(token_timeout_s):
                        msg = await anext(stream)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if _is_past(self.deadline):
                        raise DeadlineExceeded("the request's deadline passed while decoding") from None
                    orch.mark_suspect(res.decode, unreachable=False)
                    raise WorkerFailed(f"decode worker {res.decode.worker_id} sent nothing for {token_timeout_s:g}s "
                                       f"after {sum(o.num_tokens for o in outs)} tokens") from None
                if not 0 <= msg.choice_index < len(outs):
                    raise WorkerFailed(f"decode worker {res.decode.worker_id} sent choice {msg.choice_index} of a "
                                       f"request of n={len(outs)}")
                if msg.finish_reason is not None:
                    num_running_on_decode -= 1
                    if not num_running_on_decode:
                        self.reservation = None      # D finished it: nothing left to abort there
                        orch.room_freed()
                out = outs[msg.choice_index]
                if out.choice_index not in open_choices:
                    continue                         # stopped here by a stop string
                if msg.token_ids and self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                chunk = out.add(list(msg.token_ids), msg.logprobs,
                                self._prompt_logprobs(msg.prompt_logprobs, res.decode.worker_id)
                                if first is None and msg.choice_index == 0 and msg.token_ids and out.num_tokens == 0
                                else None)
                if out.stopped:
                    yield end(out, chunk, FinishReason.STOP)
                elif msg.finish_reason is not None:
                    final = out.merge(chunk, out.finish())   # the flushed tail may complete a stop string
                    yield end(out, final, FinishReason.STOP if out.stopped else msg.finish_reason)
                elif chunk.token_ids or chunk.text:
                    yield chunk
        except InvalidRequestError:
            raise
        except WorkerError as err:
            if isinstance(err, WorkerTimedOut) or _is_past(self.deadline):
                raise DeadlineExceeded("the request's deadline passed while decoding") from err
            orch.mark_suspect(res.decode, unreachable=isinstance(err, WorkerUnreachable))
            raise WorkerFailed(f"decode worker {res.decode.worker_id} failed after "
                               f"{sum(o.num_tokens for o in outs)} tokens: {err}") from err
        finally:
            await stream.aclose()
        if open_choices:
            raise WorkerFailed(f"decode worker {res.decode.worker_id} ended the stream without a finish reason "
                               f"after {sum(o.num_tokens for o in outs)} tokens")

    def _prompt_logprobs(self, received: Sequence[PromptLogprob], worker_id: str) -> tuple[PromptLogprob, ...] | None:
        """The prompt logprobs that came with the first token, or None when the request asked for none; a worker
        that sent the wrong number fails the request (never a response silently without them)."""
        if self.req.sampling.prompt_logprobs is None:
            return None
        if len(received) != self.req.num_prompt_tokens - 1:
            raise WorkerFailed(f"worker {worker_id} sent {len(received)} prompt logprobs for a prompt of "
                               f"{self.req.num_prompt_tokens} tokens")
        return tuple(received)

    def _final(self, chunk: OutputChunk, reason: FinishReason, prefill: tuple[PrefillResult, float] | None,
               decode_start: float, num_completion_tokens: int) -> OutputChunk:
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
                              transport=response.transport, transfer_bytes=response.transfer_bytes,
                              kv_reshard_bytes=response.reshard_bytes, kv_reshard_slices=response.reshard_slices)
        usage = Usage(self.req.num_prompt_tokens, num_completion_tokens, cached)
        return OutputChunk(chunk.text, chunk.token_ids, chunk.logprobs, reason, usage, timings, chunk.choice_index,
                           chunk.prompt_logprobs)
