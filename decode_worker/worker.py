"""The decode worker's request handling: reservations with leases, KV receipt, decoding in the running batch.

Lifecycle of one request (DESIGN section 3, steps 4-6):

    reserve ──▶ RESERVED (blocks held, lease running) ──KvTransfer commit──▶ COMMITTED ──decode──▶ engine batch
        │                 │                                                               ▲
        │                 └──decode(prefill_locally)──────────────────────────────────────┘
        └── lease expires / transfer rejected / abort ──▶ released (blocks freed exactly once, by the engine)

Reservation bookkeeping lives here under a lock (gRPC threads call in concurrently); every engine operation
goes through the EngineLoop, so the engine itself stays single-threaded. A transfer writes only into blocks
its reservation holds, which the engine neither reads nor writes until the request is started.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from dataclasses import dataclass

from engine.engine_loop import EngineLoop, RequestStream
from engine.llm_engine import LLMEngine
from engine.sequence import TokenLogprob
from kvstore.transfer import KvLayoutSpec, TransferManifest, TransferRejected
from kvstore.transfer_service import ReceivedBlocks, ReceiveTarget
from pdserve.worker_runtime import PreconditionError, WorkerRequestData


@dataclass
class Reservation:
    request_id: str
    handle: str
    block_ids: list[int]          # all prompt blocks, in order
    num_cached_blocks: int        # leading blocks this worker already had
    lease_deadline: float         # time.monotonic()
    lease_expiry_unix_ms: int
    receiving: bool = False
    committed: bool = False
    aborted: bool = False         # aborted while receiving: released when the transfer ends

    @property
    def missing_block_ids(self) -> list[int]:
        return self.block_ids[self.num_cached_blocks:]


class ReservationError(PreconditionError):
    """Decode was asked for a reservation that is unknown, expired, or whose KV has not arrived."""


class DecodeWorker:
    def __init__(self, loop: EngineLoop, max_lease_ms: int) -> None:
        self.loop = loop
        engine = loop.engine
        self.block_size = engine.config.block_size
        self.layout = KvLayoutSpec.from_cache(engine.runner.kv_cache, engine.fingerprint)
        self.max_lease_ms = max_lease_ms
        self._reservations: dict[str, Reservation] = {}
        self._lock = threading.Lock()
        self._handles = itertools.count()
        self.num_transfer_errors = 0
        self.num_expired = 0
        loop.add_housekeeping(self._expire_leases)

    # --- Reserve ----------------------------------------------------------------------------------------------
    def reserve(self, req: WorkerRequestData, lease_ms: int) -> Reservation:
        """Raises OverloadedError (no room) or InvalidRequestError (bad request)."""
        seq = self.loop.call(lambda e: e.reserve(req.request_id, req.prompt_token_ids, req.params,
                                                 req.cache_salt, req.seed))
        lease_ms = min(max(lease_ms, 1), self.max_lease_ms)
        res = Reservation(req.request_id, f"{next(self._handles)}-{secrets.token_hex(8)}", list(seq.block_ids),
                          seq.num_computed_tokens // self.block_size, time.monotonic() + lease_ms / 1000,
                          int(time.time() * 1000) + lease_ms)
        with self._lock:
            self._reservations[req.request_id] = res
        return res

    # --- KvReceiver -------------------------------------------------------------------------------------------
    def check(self, manifest: TransferManifest) -> ReceiveTarget:
        with self._lock:
            res = self._reservations.get(manifest.request_id)
            if res is None or res.handle != manifest.handle:
                raise TransferRejected(f"no live reservation {manifest.handle!r} for {manifest.request_id!r}",
                                       "handle")
            if res.receiving or res.committed:
                raise TransferRejected("this reservation already has a transfer", "handle")
            res.receiving = True
        return ReceiveTarget(self.layout, tuple(res.missing_block_ids), self.loop.engine.runner.kv_cache)

    def commit(self, request_id: str, handle: str, blocks: ReceivedBlocks) -> None:
        with self._lock:
            res = self._reservations.get(request_id)
            if res is None or res.handle != handle or res.aborted:
                raise TransferRejected("the request was aborted during the transfer", "handle")
            res.receiving, res.committed = False, True

    def reject(self, request_id: str, handle: str, reason: str) -> None:
        with self._lock:
            res = self._reservations.get(request_id)
            if res is None or res.handle != handle:
                return
            del self._reservations[request_id]
            if not res.aborted:
                self.num_transfer_errors += 1
        self.loop.abort(request_id)

    # --- Decode -----------------------------------------------------------------------------------------------
    def decode(self, request_id: str, handle: str, first_token_id: int | None,
               first_logprob: TokenLogprob | None = None) -> RequestStream:
        """Start a reservation: with first_token_id its KV must be committed; None prefills locally."""
        with self._lock:
            res = self._reservations.get(request_id)
            if res is None or res.handle != handle:
                raise ReservationError(f"no live reservation {handle!r} for {request_id!r} (expired or aborted)")
            if first_token_id is not None and not res.committed:
                raise ReservationError(f"the KV of {request_id!r} has not been committed")
            if res.receiving:
                raise ReservationError(f"the KV of {request_id!r} is still arriving")
            del self._reservations[request_id]
        return self.loop.open_stream(request_id, lambda e: e.start_reserved(request_id, first_token_id, first_logprob))

    def abort(self, request_id: str) -> bool:
        """Drop the request. A transfer in flight may still be writing its blocks: they are released when it
        ends (commit refuses, reject frees), never while being written."""
        with self._lock:
            res = self._reservations.get(request_id)
            if res is not None and res.receiving:
                res.aborted = True
                return True
            self._reservations.pop(request_id, None)
        return self.loop.abort(request_id)

    def stats(self) -> dict[str, int]:
        stats = self.loop.call(LLMEngine.stats)
        with self._lock:
            stats["reserved"] = len(self._reservations)
        stats["transfer_errors"] = self.num_transfer_errors
        return stats

    def _expire_leases(self, engine: LLMEngine) -> None:
        """Housekeeping on the loop thread: release reservations whose KV never came."""
        now = time.monotonic()
        with self._lock:
            expired = [r for r in self._reservations.values() if r.lease_deadline < now and not r.receiving]
            for r in expired:
                del self._reservations[r.request_id]
        for r in expired:
            self.num_expired += 1
            engine.abort(r.request_id)
