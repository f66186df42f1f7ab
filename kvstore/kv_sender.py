"""KvTransfer over gRPC, the sending side: the prefill worker's KvSender (the receiver is kvstore.transfer_service).

KvSender.push: the transport is the caller's explicit choice and is reported in TransferStats; there is no
fallback. grpc: manifest (digests_in_trailer), then 2 MiB chunks, then the trailer with the digests; a raw-codec
push of a contiguous CPU cache fills each chunk's message straight out of the cache's pieces, hashing each
stretch in the message as it is copied there (kvstore.paged_records, one native pass) unless the caller passed
that block's digest (a prefill worker's: engine.kv_digests), any other is encoded a
group (``group_bytes``) at a time into a reused staging buffer (kvstore.transfer.write_records), hashed there and
cut into chunks. shm: the blocks are
encoded a group at a time straight into a segment (from the sender's SegmentPool when it has one: pre-faulted
and reused; else a fresh one-shot segment), then the manifest with the digests names it; the segment goes back
to the pool only after a committed Push, and is unlinked on every other outcome. Zero copy (KvSender.data_path
decides, in one place): when the blocks are those of the engine's shared cache (raw codec) and the receiver
answered the probe, the manifest names the cache segment and the source block ids and goes at once; the sender
hashes in place meanwhile the blocks whose digests the caller did not pass (a prefill worker has those it
computed: engine.kv_digests) and sends all of them in the trailer. The caller holds the blocks until push
returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch

from kvstore.malloc_tuning import keep_freed_memory_for_reuse
from kvstore.paged_records import PagedRecords, is_paged_cache
from kvstore.shm import OutgoingSegment
from kvstore.shm_cache import SharedKvCache, block_digests_in_place
from kvstore.shm_pool import SegmentPool, SegmentPoolExhausted
from kvstore.transfer import BufferPool, iter_chunks, write_records
from kvstore.transfer_manifest import (CODECS, DEFAULT_CHUNK_BYTES, TRANSPORTS, KvLayoutSpec, TransferManifest,
                                       check_chunk_bytes, num_chunks)
from kvstore.transfer_service import GRPC_OPTIONS, encode_data_chunk, new_data_chunk, serialize_chunk
from kvstore.transfer_slices import KvSlices
from protos.convert import manifest_to_pb
from protos.pdserve.v1 import kv_transfer_pb2
from protos.tls import TlsFiles, channel_credentials, channel_options

log = logging.getLogger(__name__)

DEFAULT_GROUP_BYTES = 4 << 20
"""Blocks encoded (gathered and hashed) at a time: small enough to stay in cache between gather and hash."""


@dataclass(frozen=True)
class FaultInjection:
    """Test hook, passed explicitly to push: invert the first byte of payload chunk `corrupt_chunk_index`
    (the k-th `chunk_bytes` piece) after the digests were computed, on either transport; or the first byte of
    the trailer's digest of block `corrupt_trailer_digest` (grpc)."""
    corrupt_chunk_index: int | None = None
    corrupt_trailer_digest: int | None = None

    def trailer(self, digests: list[bytes]) -> kv_transfer_pb2.KvChunk:
        """The trailer message of a push with these block digests (one of them corrupted, if asked)."""
        i = self.corrupt_trailer_digest
        if i is not None:
            digests = digests[:i] + [bytes([digests[i][0] ^ 0xFF]) + digests[i][1:]] + digests[i + 1:]
        return kv_transfer_pb2.KvChunk(trailer=kv_transfer_pb2.KvTrailer(block_digests=digests))


@dataclass(frozen=True)
class TransferStats:
    num_bytes: int  # payload bytes (as encoded on the wire)
    elapsed_ms: float  # encode + send + receiver's verify/scatter/commit
    transport: str
    codec: str
    num_blocks: int
    reshard_bytes: int = 0  # the receiver's report (PushResult.reshard_bytes); 0 from a receiver without it
    reshard_slices: int = 0
    data_path: str = ""  # how the bytes travelled (KvSender.data_path): "grpc", "cache", "pooled", "one-shot"


class TransferFailed(Exception):
    """The receiver rejected the transfer or the RPC failed; `code` is the grpc status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class KvSender:
    """Pushes blocks of a local cache to decode workers' KvTransfer services. One cached channel per endpoint;
    thread-safe. With `tls` (the prefill worker's cluster files, read once) every channel is mutual TLS and
    accepts only a server certificate of role decode. `shm_pool_bytes` > 0: shm transfers use a SegmentPool of
    that many bytes (pre-faulted, reused; closed with the sender); 0: a fresh segment per transfer.
    `shared_cache`: the engine's KV cache when it lives in shared memory (kvstore.shm_cache; not closed here):
    shm pushes of its blocks to a receiver that answered the probe take the zero-copy path."""

    def __init__(self, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, group_bytes: int = DEFAULT_GROUP_BYTES,
                 tls: TlsFiles | None = None, shm_pool_bytes: int = 0,
                 shared_cache: SharedKvCache | None = None) -> None:
        check_chunk_bytes(chunk_bytes)
        keep_freed_memory_for_reuse()  # grpc's message buffers: no page faults per push (kvstore.malloc_tuning)
        self.chunk_bytes = chunk_bytes
        self.group_bytes = group_bytes
        self.segment_pool = SegmentPool(shm_pool_bytes) if shm_pool_bytes else None
        self.shared_cache = shared_cache
        self._cache_peers: dict[str, bool] = {}  # endpoint -> whether it answered the zero-copy probe
        self.staging = BufferPool(4 * group_bytes)
        self._credentials = channel_credentials(tls) if tls is not None else None
        self._stubs: dict[str, tuple[grpc.Channel, grpc.StreamUnaryMultiCallable]] = {}
        self._lock = threading.Lock()

    def _stub(self, endpoint: str) -> grpc.StreamUnaryMultiCallable:
        """KvTransfer.Push on `endpoint`, sending pre-encoded data chunks as they are (encode_data_chunk)."""
        with self._lock:
            if endpoint not in self._stubs:
                if self._credentials is None:
                    channel = grpc.insecure_channel(endpoint, options=GRPC_OPTIONS)
                else:  # the server must hold a decode certificate of our CA: nothing else gets a connection
                    channel = grpc.secure_channel(endpoint, self._credentials,
                                                  options=[*GRPC_OPTIONS, *channel_options("decode")])
                self._stubs[endpoint] = (channel, channel.stream_unary(
                    "/pdserve.v1.KvTransfer/Push", request_serializer=serialize_chunk,
                    response_deserializer=kv_transfer_pb2.PushResult.FromString))
            return self._stubs[endpoint][1]

    def push(self, endpoint: str, *, request_id: str, handle: str, layout: KvLayoutSpec,
             kv_cache: torch.Tensor | KvSlices,
             src_block_ids: Sequence[int], dst_block_ids: Sequence[int], transport: str, codec: str = "raw",
             timeout_s: float = 30.0, fault: FaultInjection | None = None,
             block_digests: Sequence[bytes | None] | None = None) -> TransferStats:
        """Send blocks `src_block_ids` of `kv_cache` to land in `dst_block_ids` of the receiver reservation
        `handle`, over `transport` exactly (no fallback). The source blocks must not change until push returns
        (blocks are gathered as they are sent; a change shows up as a digest rejection). `kv_cache` as KvSlices:
        a tensor-parallel sender's payload slices (kvstore.transfer_slices), sent slice by slice. Raises
        TransferFailed (the receiver's status and message) or ValueError (bad arguments). `block_digests`: the
        digest of each source block's raw record where the caller has it (engine.kv_digests: taken as prefill
        wrote the block; None where not): the zero-copy path and the grpc raw path of a contiguous CPU cache send
        those as they are and hash only the others (the receiver checks every one against what landed); the other
        paths (shm segments, a codec, tensor-parallel slices) hash as they send."""
        # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
        start = time.perf_counter()
        deadline = start + timeout_s
        sliced = isinstance(kv_cache, KvSlices)
        if sliced:
            kv_cache.check_layout(layout)
        else:
            layout.check_cache(kv_cache)
        if codec not in CODECS or transport not in TRANSPORTS:
            raise ValueError(f"codec must be one of {CODECS} and transport one of {TRANSPORTS}, got {codec!r}, "
                             f"{transport!r}")
        src_block_ids, dst_block_ids = [int(b) for b in src_block_ids], [int(b) for b in dst_block_ids]
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destination blocks")
        num_cache_blocks = kv_cache.num_blocks if sliced else kv_cache.shape[2]
        if any(not 0 <= b < num_cache_blocks for b in src_block_ids):
            raise ValueError(f"src_block_ids outside the cache of {num_cache_blocks} blocks")
        known = list(block_digests) if block_digests is not None else [None] * len(src_block_ids)
        if len(known) != len(src_block_ids) or any(d is not None and len(d) != 16 for d in known):
            raise ValueError(f"block_digests: one 16-byte digest or None per source block ({len(src_block_ids)})")
        # What goes on the wire, in order: each payload slice's blocks, a group at a time.
        units: list[tuple[torch.Tensor, list[int], int]] = []  # (cache, block ids, their records' bytes)
        for cache in (kv_cache.caches if sliced else (kv_cache,)):
            record_bytes = KvLayoutSpec.from_cache(cache, "").block_bytes(codec)
            per_group = max(1, self.group_bytes // record_bytes)
            units += [(cache, src_block_ids[i:i + per_group], len(src_block_ids[i:i + per_group]) * record_bytes)
                      for i in range(0, len(src_block_ids), per_group)]
        payload_bytes = sum(nbytes for _, _, nbytes in units)
        sender_kv_heads = kv_cache.sender_kv_heads if sliced else ()
        fault = fault or FaultInjection()
        if fault.corrupt_chunk_index is not None and not (
                0 <= fault.corrupt_chunk_index < num_chunks(payload_bytes, self.chunk_bytes)):
            raise ValueError(f"corrupt_chunk_index {fault.corrupt_chunk_index} outside the payload's "
                             f"{num_chunks(payload_bytes, self.chunk_bytes)} chunks")

        def manifest(shm_name: str = "", digests: tuple[bytes, ...] = (), **cache_fields) -> kv_transfer_pb2.KvChunk:
            return kv_transfer_pb2.KvChunk(manifest=manifest_to_pb(TransferManifest(
                request_id, handle, layout, tuple(dst_block_ids), digests, codec, transport, shm_name,
                payload_bytes, sender_kv_heads, digests_in_trailer=transport == "grpc" or bool(cache_fields),
                **cache_fields)))

        stub = self._stub(endpoint)
        path = self.data_path(endpoint, kv_cache, layout, transport, codec, deadline)
        if path == "cache":
            try:
                result = self._push_cache(stub, manifest, src_block_ids, known, layout.block_bytes(codec), fault,
                                          deadline)
            except TransferFailed as exc:
                if exc.code == grpc.StatusCode.INVALID_ARGUMENT and exc.details.startswith(("shm_name: ",
                                                                                            "transport: ")):
                    with self._lock:  # the receiver was replaced by one without the cache path: probe again
                        self._cache_peers.pop(endpoint, None)
                raise
        elif transport == "grpc":
            errors: list[BaseException] = []
            if codec == "raw" and not sliced and is_paged_cache(kv_cache):
                messages = self._paged_messages(manifest(), PagedRecords(kv_cache, src_block_ids), known, fault,
                                                errors)
            else:
                messages = self._grpc_messages(manifest(), units, codec, fault, errors)
            try:
                result = self._call(stub, messages, deadline, errors)
            except TransferFailed as exc:
                if exc.code == grpc.StatusCode.FAILED_PRECONDITION and exc.details.startswith("block_digests: 0 "):
                    raise TransferFailed(exc.code, f"{exc.details} (the receiver predates digests in a trailer, "
                                         "KvManifest.digests_in_trailer: upgrade the decode worker)") from exc
                raise
        else:
            result = self._push_shm(stub, manifest, units, codec, payload_bytes, fault, request_id, handle,
                                    deadline)
        if result.num_blocks != len(dst_block_ids) or result.bytes != payload_bytes:
            raise TransferFailed(grpc.StatusCode.INTERNAL, f"receiver reports {result.num_blocks} blocks / "
                                 f"{result.bytes} bytes, sent {len(dst_block_ids)} / {payload_bytes}")
        return TransferStats(payload_bytes, (time.perf_counter() - start) * 1e3, transport, codec,
                             len(dst_block_ids), result.reshard_bytes, result.reshard_slices, path)

    def data_path(self, endpoint: str, kv_cache, layout: KvLayoutSpec, transport: str, codec: str,
                  deadline: float) -> str:
        """The one place that decides how a push's bytes travel: "grpc" (transport grpc); "cache" (shm, raw
        codec, blocks of the shared cache, a receiver that answered the probe: zero copy, kvstore.shm_cache);
        else "pooled" (shm through the segment pool) or "one-shot" (shm without a pool). The probe goes once
        per endpoint; a transport failure of the probe is not remembered."""
        if transport == "grpc":
            return "grpc"
        segment_path = "pooled" if self.segment_pool is not None else "one-shot"
        cache = self.shared_cache
        if cache is None or codec != "raw" or not cache.holds(kv_cache):
            return segment_path
        with self._lock:
            known = self._cache_peers.get(endpoint)
        if known is None:
            probe = kv_transfer_pb2.KvChunk(manifest=manifest_to_pb(TransferManifest(
                "", "", layout, (), (), "raw", "shm", "", 0, digests_in_trailer=True, cache_segment=cache.name,
                cache_num_blocks=cache.num_blocks, sender_epoch=cache.epoch)))
            try:
                self._call(self._stub(endpoint), iter([probe]), deadline, [])
                known = True
            except TransferFailed as exc:
                if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.CANCELLED):
                    return segment_path
                log.info("KV receiver %s refused the zero-copy probe (%s): shm pushes there use the %s path",
                         endpoint, exc, segment_path)
                known = False
            with self._lock:
                self._cache_peers[endpoint] = known
        return "cache" if known else segment_path

    def _push_cache(self, stub, manifest, src_block_ids: list[int], known: list[bytes | None], block_bytes: int,
                    fault: FaultInjection, deadline: float) -> kv_transfer_pb2.PushResult:
        # The manifest goes first, so that the receiver copies while this thread hashes in place the blocks
        # whose digests it lacks; the digests follow in the trailer. The caller holds the blocks until this
        # returns.
        cache = self.shared_cache
        head = manifest(cache_segment=cache.name, src_block_ids=tuple(src_block_ids),
                        cache_num_blocks=cache.num_blocks, sender_epoch=cache.epoch)
        flipped: list[int] = []
        errors: list[BaseException] = []

        def all_digests() -> list[bytes]:
            missing = [i for i, d in enumerate(known) if d is None]
            hashed = iter(block_digests_in_place(cache.tensor, [src_block_ids[i] for i in missing]))
            return [d if d is not None else next(hashed) for d in known]

        def messages() -> Iterator[kv_transfer_pb2.KvChunk]:
            try:
                if fault.corrupt_chunk_index is None:
                    yield head
                    digests = all_digests()
                else:  # test hook: the digests, then the corruption of the source block, then the manifest
                    digests = all_digests()
                    flipped.append(src_block_ids[fault.corrupt_chunk_index * self.chunk_bytes // block_bytes])
                    cache.flip_byte(flipped[0])
                    yield head
                yield fault.trailer(digests)
            except Exception as exc:  # grpc would only report "Exception iterating requests"
                errors.append(exc)
                raise

        try:
            return self._call(stub, messages(), deadline, errors)
        finally:
            for block_id in flipped:  # the hook corrupts what the receiver reads, never the sender's own KV
                cache.flip_byte(block_id)

    def _push_shm(self, stub, manifest, units, codec, payload_bytes, fault, request_id, handle,
                  deadline) -> kv_transfer_pb2.PushResult:
        if self.segment_pool is not None:
            try:
                segment = self.segment_pool.acquire(payload_bytes, request_id=request_id, handle=handle,
                                                    timeout_s=max(0.0, deadline - time.perf_counter()))
            except (SegmentPoolExhausted, OSError, ValueError) as exc:  # full, no room in /dev/shm, too big
                raise TransferFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"shared-memory pool: {exc}") from exc
        else:
            segment = OutgoingSegment(payload_bytes, request_id=request_id, handle=handle)
        committed = False
        try:  # released on every path out: back to the pool only once the receiver committed
            payload = segment.payload(payload_bytes)  # [payload_bytes] uint8 viewing the segment
            digests, offset = [], 0
            for cache, ids, nbytes in units:
                digests.extend(write_records(cache, ids, codec, payload[offset:offset + nbytes]))
                offset += nbytes
            del payload
            if fault.corrupt_chunk_index is not None:
                segment.flip_byte(fault.corrupt_chunk_index * self.chunk_bytes)
            result = self._call(stub, iter([manifest(segment.name, tuple(digests))]), deadline, [])
            committed = True
            return result
        finally:
            segment.release(reusable=committed)

    def _paged_messages(self, manifest: kv_transfer_pb2.KvChunk, records: PagedRecords, known: list[bytes | None],
                        fault: FaultInjection,
                        errors: list[BaseException]) -> Iterator[kv_transfer_pb2.KvChunk | bytes]:
        # Runs in grpc's request-consumer thread: each chunk's message is filled straight out of the cache's
        # pieces (one copy, no staging buffer), hashing what was written there unless the caller passed that
        # block's digest (kernels.cpu_kv_copy.PieceStream); after the last one, the trailer.
        try:
            yield manifest
            with records.stream(known) as stream:
                for index, start in enumerate(range(0, records.payload_bytes, self.chunk_bytes)):
                    num_bytes = min(self.chunk_bytes, records.payload_bytes - start)
                    message, data = new_data_chunk(num_bytes)
                    stream.gather(data)
                    del data  # written: from here on the message is an ordinary bytes object
                    if index == fault.corrupt_chunk_index:
                        header = len(message) - num_bytes
                        message = message[:header] + bytes([message[header] ^ 0xFF]) + message[header + 1:]
                    yield message
            yield fault.trailer(stream.digests)
        except Exception as exc:  # grpc would only report "Exception iterating requests"
            errors.append(exc)
            raise

    def _grpc_messages(self, manifest: kv_transfer_pb2.KvChunk, units: list[tuple[torch.Tensor, list[int], int]],
                       codec: str, fault: FaultInjection,
                       errors: list[BaseException]) -> Iterator[kv_transfer_pb2.KvChunk | bytes]:
        # Runs in grpc's request-consumer thread: gather a group into the reused staging buffer, hash it, cut it
        # into chunks (each encoded, i.e. copied, before the next is cut), and after the last one, the trailer.
        try:
            yield manifest
            digests: list[bytes] = []
            staging = self.staging.take(max((nbytes for _, _, nbytes in units), default=0))
            try:
                def encoded_groups() -> Iterator[torch.Tensor]:
                    for cache, ids, nbytes in units:
                        out = staging[:nbytes]  # [nbytes] uint8
                        digests.extend(write_records(cache, ids, codec, out))
                        yield out

                for index, data in enumerate(iter_chunks(encoded_groups(), self.chunk_bytes)):
                    if index == fault.corrupt_chunk_index:
                        data = bytes([data[0] ^ 0xFF]) + data[1:]
                    yield encode_data_chunk(data)
            finally:
                self.staging.give_back(staging)
            yield fault.trailer(digests)
        except Exception as exc:  # grpc would only report "Exception iterating requests"
            errors.append(exc)
            raise

    @staticmethod
    def _call(push, messages, deadline: float, errors: list[BaseException]) -> kv_transfer_pb2.PushResult:
        try:
            return push(messages, timeout=max(0.0, deadline - time.perf_counter()))
        except grpc.RpcError as exc:
            if errors:
                raise errors[0] from exc
            raise TransferFailed(exc.code(), exc.details() or "") from exc

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()
        if self.segment_pool is not None:
            self.segment_pool.close()

    def __enter__(self) -> KvSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
