"""The prefill worker's request handling: prefill in the batched engine, push the KV the decode worker lacks.

One request (DESIGN section 3, step 5):

    target.endpoint checked first (prefill_worker.destinations: a live decode worker of this cluster, or
    PERMISSION_DENIED before anything is computed)
    add_request(max_tokens=1, hold_blocks) ─▶ engine batch (chunked, prefix cache) ─▶ first token sampled
       (n > 1: one first token per choice, from the same logits; the choices fork on the decode worker)
    ─▶ lease HELD ─pin─▶ PUSHING: push blocks [num_cached_blocks:] of the prompt to the decode worker's
       reservation (shm or grpc) ─unpin─▶ HELD
    ─▶ released by the engine (always, exactly once: success, rejected transfer or abort)

The push runs on the gRPC handler's thread while the engine keeps stepping other requests; it reads only
blocks this request's lease holds, and only while it holds the lease's pin (engine.block_lease): an Abort
that arrives before the pin releases the blocks and the pin is refused (no push); one that arrives during the
push is deferred until the push ends. On the same host the engine's KV cache itself lives in shared memory
(LLMEngine(kv_cache_in_shm=True), which the server asks for unless the transport is grpc) and the decode
worker copies the blocks straight out of it (kvstore.shm_cache: one copy; the pin is what keeps them from being
reused under the reader, and the digests of what landed catch a push that ended early). The digests every
push sends were taken as the prefill steps wrote the blocks (engine.kv_digests: each layer's pieces hashed while
still in the caches, whichever the transport), so the push hashes only prefix-cache hits; else the sender
gathers each group of blocks straight into what carries it (a pooled, pre-faulted shared-memory segment, or
chunks of a streamed grpc Push whose digests follow in a trailer). Sending layer by layer during the forward
pass is not done (see BENCHMARKS.md, issue 16).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

from engine.block_lease import IllegalTransition, LeaseState
from engine.engine_loop import EngineLoop
from engine.errors import InvalidRequestError, PreconditionError, RequestAborted
from engine.llm_engine import EngineStats
from engine.sequence import PromptLogprob, TokenLogprob
from kvstore.shm import host_id
from kvstore.transfer_manifest import KvLayoutSpec
from kvstore.kv_sender import FaultInjection, KvSender, TransferFailed
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.destinations import DecodeDestinations
from protos.convert import TransferTargetData, WorkerRequestData


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_logprob: TokenLogprob | None
    choice_first_tokens: list[tuple[int, TokenLogprob | None]]   # choices 1..n-1 (n > 1)
    cached_tokens: int
    computed_tokens: int
    transfer_bytes: int
    transfer_ms: float
    transport: str
    prefill_ms: float
    prompt_logprobs: list[PromptLogprob] | None = None
    """With params.prompt_logprobs: prompt tokens 1..n-1 (engine Sequence.prompt_logprobs)."""
    reshard_bytes: int = 0
    """What the push's re-sharding plan handed the decode worker's ranks (kvstore.reshard_plan)."""
    reshard_slices: int = 0


class PrefillWorker:
    def __init__(self, loop: EngineLoop, config: PrefillWorkerConfig, destinations: DecodeDestinations) -> None:
        self.loop = loop
        self.config = config
        self.destinations = destinations
        engine = loop.engine
        self.layout = KvLayoutSpec.from_cache(engine.runner.transfer_cache(), engine.fingerprint)
        self.sender = KvSender(chunk_bytes=config.chunk_bytes, tls=config.tls_files,
                               shm_pool_bytes=config.shm_pool_bytes, shared_cache=engine.runner.kv_segment)
        self.host_id = host_id()
        self._lock = threading.Lock()
        self._faults_left = config.fault_corrupt_transfers
        self.num_transfer_failures = 0

    def prefill(self, req: WorkerRequestData, target: TransferTargetData, timeout_s: float) -> PrefillResult:
        """Raises DestinationRefused (the target is not a decode worker of this cluster: nothing is computed or
        sent), RequestAborted, PreconditionError (the decode worker refused the KV; nothing was committed
        there), InvalidRequestError, or RequestFailedError (this request failed in the engine)."""
        start = time.perf_counter()
        self.destinations.check(target.endpoint)
        params = dataclasses.replace(req.params, max_tokens=1)
        rid = req.request_id
        stream = self.loop.open_stream(rid, lambda e: e.add_request(rid, req.prompt_token_ids, params,
                                                                    req.cache_salt, req.seed, hold_blocks=True))
        try:
            out = stream.get()
            if out is None:
                raise RequestAborted(f"request {rid!r} was aborted during prefill")
            seq = out.seq
            # compute only: from the step that first scheduled it (queueing on this worker excluded)
            prefill_ms = (time.perf_counter() - (seq.first_scheduled_s or start)) * 1000
            try:
                seq.lease.pin(LeaseState.HELD, LeaseState.PUSHING)
            except IllegalTransition:
                raise RequestAborted(f"request {rid!r} was aborted before its KV push") from None
            try:
                src = seq.block_ids[target.num_cached_blocks:]
                stats = self._push(rid, src, [seq.kv_digests.get(b) for b in src], target, start, timeout_s)
            finally:
                aborted = seq.lease.unpin(LeaseState.HELD)
            if aborted:
                raise RequestAborted(f"request {rid!r} was aborted during its KV push")
        finally:
            stream.close()  # aborts the finished request: the engine releases its lease here, exactly once
        return PrefillResult(out.new_token_ids[0], out.new_logprobs[0] if out.new_logprobs else None,
                             list(seq.choice_first_tokens), seq.num_cached_tokens,
                             seq.num_prompt_tokens - seq.num_cached_tokens, stats.num_bytes, stats.elapsed_ms,
                             stats.transport, prefill_ms, out.prompt_logprobs, stats.reshard_bytes,
                             stats.reshard_slices)

    def _push(self, rid: str, src_block_ids: list[int], digests: list[bytes | None], target: TransferTargetData,
              start: float, timeout_s: float):
        """Send `src_block_ids` (pinned by the caller; `digests`: those the engine took as it wrote them) to the
        target reservation; returns TransferStats."""
        if len(src_block_ids) != len(target.block_ids):
            raise InvalidRequestError("target.block_ids", f"{len(target.block_ids)} destination blocks for "
                                      f"{len(src_block_ids)} blocks the decode worker lacks")
        with self._lock:
            fault = FaultInjection(0) if self._faults_left > 0 and src_block_ids else None
            self._faults_left -= fault is not None
        try:
            # Every KV head on the wire once: a tensor-parallel worker gathers the payload's slices from its ranks.
            kv_cache, src_block_ids = self.loop.engine.runner.blocks_to_send(src_block_ids)
            return self.sender.push(
                target.endpoint, request_id=rid, handle=target.handle, layout=self.layout,
                kv_cache=kv_cache, src_block_ids=src_block_ids,
                dst_block_ids=target.block_ids, transport=self._transport(target), codec=self.config.codec,
                timeout_s=max(timeout_s - (time.perf_counter() - start), 0.001), fault=fault, block_digests=digests)
        except TransferFailed as exc:
            with self._lock:
                self.num_transfer_failures += 1
            raise PreconditionError(f"KV transfer to {target.endpoint} failed: {exc}") from exc

    def abort(self, request_id: str) -> bool:
        """Drop the request. During its push the lease is pinned: the release waits until the push ends."""
        return self.loop.abort(request_id)

    def close(self) -> None:
        """Close the sender (its channels, its pooled segments) and unlink the engine's shared-memory KV cache:
        the worker is shutting down, the engine loop has stopped."""
        self.sender.close()
        if self.loop.engine.runner.kv_segment is not None:
            self.loop.engine.runner.kv_segment.close()

    def stats(self) -> EngineStats:
        return self.loop.call(lambda e: e.stats())

    def _transport(self, target: TransferTargetData) -> str:
        if self.config.transport != "auto":
            return self.config.transport
        return "shm" if target.host_id == self.host_id else "grpc"
