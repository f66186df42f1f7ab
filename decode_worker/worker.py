"""The decode worker's request handling: reservations with leases, KV receipt, decoding in the running batch.

Lifecycle of one request (DESIGN section 3, steps 4-6), as states of its blocks' lease (engine.block_lease):

    reserve ──▶ RESERVED ──KvTransfer check (pin)──▶ RECEIVING ──commit (unpin)──▶ COMMITTED ──decode──▶ RUNNING
                   │                                     └──reject (unpin)──▶ RESERVED ──▶ released
                   └──decode(prefill locally)──────────────────────────────────────────────────────▶ RUNNING
    lease expiry (RESERVED / COMMITTED), abort, rejected transfer ──▶ released, once, by the engine

A lease runs from Reserve; the gateway renews it (Renew) while the prompt waits for and runs on a prefill worker,
which can take longer than one lease when prefill queues; a commit starts it afresh, so KV that arrived just
before the deadline is not released before its Decode comes.

A request with n > 1 choices is reserved, transferred and committed once, for its prompt; Decode hands the prefill
worker's other first tokens to the engine, which forks the choices on the committed blocks (each choice its own
lease; engine.llm_engine), and the one stream carries every choice's tokens with its index.

The lease is the one owner of the blocks; a `Reservation` adds what the gateway was told (handle, lease
deadline). gRPC threads pin and unpin the lease themselves (it has its own lock); every release goes through
the EngineLoop, so the engine and its pool stay single-threaded. An abort while the KV is arriving only marks
the lease: the transfer's commit is then refused and its reject releases the blocks, after the last write.

Limits and trust (DESIGN section 10): a lease is capped at max_lease_ms whatever the caller asks; one caller
(the peer's certificate name, or its address over plaintext) holds at most its share of the pool in
reservations whose KV has not been committed. Received KV enters the prefix cache only from a sender
`trusts` accepts; with verify_kv it is first compared with a recomputation (engine.kv_verify).
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from dataclasses import dataclass

from engine.block_lease import BlockLease, IllegalTransition, LeaseState
from engine.engine_loop import EngineLoop, RequestStream
from engine.errors import OverloadedError, PreconditionError
from engine.kv_verify import KvMismatch, verify_received_kv
from engine.llm_engine import EngineStats, LLMEngine
from engine.sequence import TokenLogprob
from kvstore.transfer_manifest import KvLayoutSpec, TransferManifest, TransferRejected
from kvstore.transfer_service import ReceivedBlocks, ReceiveTarget
from protos.convert import WorkerRequestData

_EXPIRABLE = (LeaseState.RESERVED, LeaseState.COMMITTED)
_UNCOMMITTED = (LeaseState.RESERVED, LeaseState.RECEIVING)
RETRY_AFTER_MS = 1000
"""Longest retry hint for a caller past its share (sooner when one of its leases ends sooner)."""


@dataclass
class Reservation:
    """A reservation as the gateway knows it: the lease of its blocks, the transfer handle and the deadline.
    The lease fields change (renew, commit) under DecodeWorker's lock only."""

    lease: BlockLease
    handle: str
    block_ids: tuple[int, ...]    # all prompt blocks, in order
    num_cached_blocks: int        # leading blocks this worker already had
    lease_ms: int                 # granted: the asked lease capped at max_lease_ms
    lease_deadline: float         # time.monotonic()
    lease_expiry_unix_ms: int
    caller: str = ""              # who reserved it (protos.service_runtime.caller_of)

    def extend(self) -> None:
        """Start the lease afresh from now."""
        self.lease_deadline = time.monotonic() + self.lease_ms / 1000
        self.lease_expiry_unix_ms = int(time.time() * 1000) + self.lease_ms

    @property
    def missing_block_ids(self) -> list[int]:
        return list(self.block_ids[self.num_cached_blocks:])


class DecodeWorker:
    def __init__(self, loop: EngineLoop, max_lease_ms: int, *, trust_plaintext_kv: bool = False,
                 verify_kv: str = "off", max_reserved_fraction_per_caller: float = 1.0) -> None:
        self.loop = loop
        engine = loop.engine
        if verify_kv != "off" and engine.runner.tp is not None:
            raise ValueError("verify_kv recomputes layer 0 on rank 0 alone: it needs tensor_parallel_size 1")
        self.layout = KvLayoutSpec.from_cache(engine.runner.transfer_cache(), engine.fingerprint)
        self.max_lease_ms = max_lease_ms
        self.trust_plaintext_kv = trust_plaintext_kv
        self.verify_kv = verify_kv
        self.max_reserved_blocks_per_caller = max(1, int(max_reserved_fraction_per_caller *
                                                         engine.kv.pool.num_blocks))
        self._reservations: dict[str, Reservation] = {}
        self._reserving: dict[str, int] = {}  # caller -> blocks of its Reserve calls in flight
        self._lock = threading.Lock()
        self._handles = itertools.count()
        self.num_transfer_errors = 0
        loop.add_housekeeping(self._expire_leases)

    # --- Reserve ----------------------------------------------------------------------------------------------
    def reserve(self, req: WorkerRequestData, lease_ms: int, caller: str = "") -> Reservation:
        """Raises OverloadedError (no room, or `caller` holds its share of uncommitted reservations: with a
        retry hint) or InvalidRequestError (bad request). The lease is capped at max_lease_ms."""
        needed = -(-len(req.prompt_token_ids) // self.loop.engine.config.block_size)
        with self._lock:
            self._admit(caller, needed)
            self._reserving[caller] = self._reserving.get(caller, 0) + needed
        try:
            seq = self.loop.call(lambda e: e.reserve(req.request_id, req.prompt_token_ids, req.params,
                                                     req.cache_salt, req.seed))
        except BaseException:
            with self._lock:
                self._done_reserving(caller, needed)
            raise
        res = Reservation(seq.lease, f"{next(self._handles)}-{secrets.token_hex(8)}", tuple(seq.block_ids),
                          seq.num_computed_tokens // self.loop.engine.config.block_size, self._granted(lease_ms),
                          0.0, 0, caller)
        res.extend()
        with self._lock:  # one step: from in flight to held, never counted twice
            self._done_reserving(caller, needed)
            self._reservations[req.request_id] = res
        return res

    def renew(self, request_id: str, handle: str, lease_ms: int, caller: str = "") -> Reservation:
        """Extend a reservation that has not started decoding to `lease_ms` (capped) from now, for the caller that
        made it. Raises PreconditionError when there is none (expired, aborted, decoding, another caller's)."""
        with self._lock:
            res = self._live(request_id, handle)
            if res is None or res.caller != caller:
                raise PreconditionError(f"no live reservation {handle!r} for {request_id!r} (expired or aborted)")
            res.lease_ms = self._granted(lease_ms)
            res.extend()
        return res

    def _granted(self, lease_ms: int) -> int:
        return min(max(lease_ms, 1), self.max_lease_ms)

    def _done_reserving(self, caller: str, needed: int) -> None:
        self._reserving[caller] -= needed
        if not self._reserving[caller]:
            del self._reserving[caller]

    def _admit(self, caller: str, needed: int) -> None:
        """Under the lock: OverloadedError when `caller`'s uncommitted reservations (in flight included) plus
        `needed` blocks pass its share. A caller holding nothing may always take one reservation (a prompt
        longer than the share still fits once), so the share bounds what one caller keeps from the others."""
        mine = [r for r in self._reservations.values() if r.caller == caller and r.lease.state in _UNCOMMITTED]
        held = sum(len(r.block_ids) for r in mine) + self._reserving.get(caller, 0)
        if held and held + needed > self.max_reserved_blocks_per_caller:
            now = time.monotonic()
            soonest_ms = min((int((r.lease_deadline - now) * 1000) for r in mine), default=RETRY_AFTER_MS)
            retry_ms = max(1, min(RETRY_AFTER_MS, soonest_ms))
            raise OverloadedError(f"caller {caller!r} holds {held} reserved blocks whose KV has not arrived; "
                                  f"{needed} more would pass its share of {self.max_reserved_blocks_per_caller} "
                                  f"blocks; retry after {retry_ms} ms", retry_after_ms=retry_ms)

    # --- KvReceiver -------------------------------------------------------------------------------------------
    def check(self, manifest: TransferManifest) -> ReceiveTarget:
        with self._lock:
            res = self._live(manifest.request_id, manifest.handle)
            if res is None:
                raise TransferRejected(f"no live reservation {manifest.handle!r} for {manifest.request_id!r}",
                                       "handle")
            try:
                res.lease.pin(LeaseState.RESERVED, LeaseState.RECEIVING)
            except IllegalTransition:
                raise TransferRejected(f"this reservation is {res.lease.state.value}, not waiting for its KV",
                                       "handle") from None
        runner = self.loop.engine.runner
        if runner.tp is None:
            return ReceiveTarget(self.layout, tuple(res.missing_block_ids), runner.kv_cache)
        # Every KV head arrives once; rank 0 hands each rank its own as the plan says (ModelRunner.write_received).
        return ReceiveTarget(self.layout, tuple(res.missing_block_ids), runner.transfer_cache(), runner.write_received,
                             runner.rank_kv_heads())

    def commit(self, request_id: str, handle: str, blocks: ReceivedBlocks) -> None:
        """Verify the received KV when verify_kv asks (TransferRejected on a mismatch: never decode on bad KV),
        mark it uncacheable unless its sender is trusted, and let the request decode."""
        with self._lock:
            res = self._live(request_id, handle)
        assert res is not None and res.lease.state is LeaseState.RECEIVING, "commit without a checked transfer"
        seq = res.lease.seq
        if self.verify_kv != "off" and not res.lease.release_requested:
            try:
                self.loop.call(lambda e: verify_received_kv(
                    e.runner.model, e.runner.kv_cache, seq.prompt_token_ids, res.num_cached_blocks,
                    res.missing_block_ids, self.verify_kv, blocks.codec))
            except KvMismatch as exc:
                raise TransferRejected(str(exc), f"block_digests[{exc.block_index}]") from None
        if not self.trusts(blocks.sender_role):
            seq.cacheable = False  # the engine does not touch a RECEIVING sequence: safe from this thread
        with self._lock:  # before COMMITTED makes it expirable: a transfer that began near the deadline
            res.extend()  # must not lose its KV before the Decode that follows the commit
        if res.lease.unpin(LeaseState.COMMITTED):
            raise TransferRejected("the request was aborted during the transfer", "handle")

    def trusts(self, sender_role: str | None) -> bool:
        """Whether KV from this sender may enter the prefix cache: a prefill worker proven by its mutual-TLS
        certificate, or anyone over plaintext when the operator chose to trust it (insecure internal)."""
        return sender_role == "prefill" or (sender_role is None and self.trust_plaintext_kv)

    def reject(self, request_id: str, handle: str, reason: str) -> None:
        with self._lock:
            res = self._live(request_id, handle)
            if res is None:
                return
            del self._reservations[request_id]
            if res.lease.state is LeaseState.RECEIVING:  # this transfer's own pin: only its thread moves it
                res.lease.unpin(LeaseState.RESERVED)
            if not res.lease.release_requested:          # an aborted request's refused commit is no error
                self.num_transfer_errors += 1
        self.loop.abort(request_id)

    # --- Decode -----------------------------------------------------------------------------------------------
    def decode(self, request_id: str, handle: str, first_token_id: int | None,
               first_logprob: TokenLogprob | None = None,
               choice_first_tokens: list[tuple[int, TokenLogprob | None]] = ()) -> RequestStream:
        """Start a reservation: with first_token_id its KV must be committed (and `choice_first_tokens`, one per
        further choice of an n > 1 request, fork on it); None prefills locally. Raises PreconditionError
        (unknown, expired, aborted, or KV not committed) or InvalidRequestError (first tokens not one per
        choice)."""
        with self._lock:
            res = self._live(request_id, handle)
        if res is None:
            raise PreconditionError(f"no live reservation {handle!r} for {request_id!r} (expired or aborted)")
        stream = self.loop.open_stream(request_id, lambda e: e.start_reserved(request_id, first_token_id,
                                                                              first_logprob, choice_first_tokens))
        with self._lock:
            if self._reservations.get(request_id) is res:
                del self._reservations[request_id]
        return stream

    def abort(self, request_id: str) -> bool:
        """Drop the request. A transfer in flight keeps the lease pinned: the engine only marks it, the
        transfer's commit is refused and its reject releases the blocks after the last write."""
        with self._lock:
            res = self._reservations.get(request_id)
            if res is not None and res.lease.state is not LeaseState.RECEIVING:
                del self._reservations[request_id]
        return self.loop.abort(request_id)

    def stats(self) -> EngineStats:
        return self.loop.call(LLMEngine.stats)

    def _live(self, request_id: str, handle: str) -> Reservation | None:
        res = self._reservations.get(request_id)
        return res if res is not None and res.handle == handle else None

    def _expire_leases(self, engine: LLMEngine) -> None:
        """Housekeeping on the loop thread: release reservations whose KV never came, or that never started."""
        now = time.monotonic()
        with self._lock:
            expired = [r for r in self._reservations.values()
                       if r.lease_deadline < now and r.lease.state in _EXPIRABLE]
            for r in expired:
                del self._reservations[r.lease.request_id]
        for r in expired:
            engine.abort(r.lease.request_id)
