"""KvTransfer over gRPC: the decode worker's servicer and the prefill worker's sender.

Receiving (``KvTransferServicer``, thin; the flow is ``receive_transfer``):

    manifest ─▶ receiver.check(manifest) ─▶ ReceiveTarget(layout, reserved block ids, kv_cache)   (or refuses)
             ─▶ validate_manifest (codec, transport, layout field by field, bounds, reservation ids, digests, size)
    grpc:    data chunks ─▶ a reused receive staging buffer (BufferPool), each block's digest checked (or, with
             digests_in_trailer, hashed) once its last byte is in; a streamed transfer ends with its trailer, whose
             digests must all match before anything is scattered
    shm:     one-shot segment: take it (kvstore.shm.take_segment: one this host's sender made for this
             reservation, else rejected naming shm_name); pooled segment: map it once and keep the mapping
             (kvstore.shm_pool.PooledSegmentReader: the header must name this reservation); check every digest
             on the mapped bytes
             ─▶ decode + scatter into kv_cache straight from the buffer or the mapping (only after every digest
                passed) ─▶ receiver.commit
    shm, zero copy (manifest.cache_segment, kvstore.shm_cache): map the sender's KV cache segment once (kept
             while name and epoch stay), copy each source block into its destination hashing it as it lands, then
             the trailer's digests must all match (else the destination blocks are zeroed and it is rejected)
             ─▶ receiver.commit. A probe (cache_segment without a request) is answered OK when the segment maps:
             that is how a sender learns this receiver has the path (an older one refuses it at check).
    any failure after check ─▶ receiver.reject(request_id, handle, reason), once; the RPC fails with the
                   rejection's code (FAILED_PRECONDITION: layout/fingerprint, digest, size, shm segment;
                   INVALID_ARGUMENT: bounds, reservation ids, codec/transport, malformed stream; INTERNAL:
                   anything else) and a message "<field>: <what mismatched>".

Sending (``KvSender.push``): the transport is the caller's explicit choice and is reported in TransferStats;
there is no fallback. Blocks are encoded a group (``group_bytes``) at a time straight into the memory that
carries them (kvstore.transfer.write_records) and hashed there. grpc: manifest (digests_in_trailer), then 2 MiB
chunks cut from a reused staging buffer as each group is gathered, then the trailer with the digests. shm: the
groups land in a segment (from the sender's SegmentPool when it has one: pre-faulted and reused; else a fresh
one-shot segment), then the manifest with the digests names it; the segment goes back to the pool only after a
committed Push, and is unlinked on every other outcome. Zero copy (KvSender.data_path decides, in one place):
when the blocks are those of the engine's shared cache (raw codec) and the receiver answered the probe, the
manifest names the cache segment and the source block ids and goes at once; the sender hashes the blocks in
place meanwhile and sends the digests in the trailer. The caller holds the blocks until push returns.

Servers hosting the servicer should be created with ``GRPC_OPTIONS`` (4 MiB chunks exceed grpc's default
4 MiB message limit once framed); the default 2 MiB chunks work without.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from kvstore.reshard_plan import KvReshardPlan, plan_reshard
from kvstore.shm import OutgoingSegment, SegmentRefused, take_segment
from kvstore.shm_cache import SharedKvCache, block_digests_in_place, open_cache
from kvstore.shm_pool import PooledSegmentReader, SegmentPool, SegmentPoolExhausted, is_pooled_name
from kvstore.transfer import BufferPool, DecodedBlocks, PayloadAssembler, iter_chunks, write_records
from kvstore.transfer_manifest import (CODECS, DEFAULT_CHUNK_BYTES, INVALID_ARGUMENT, TRANSPORTS, KvLayoutSpec,
                                       TransferManifest, TransferRejected, check_chunk_bytes, num_chunks,
                                       validate_manifest)
from kvstore.transfer_slices import KvSlices, decode_slices, merge_slices, record_bounds, verify_payload
from protos.convert import manifest_from_pb, manifest_to_pb
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from protos.tls import TlsFiles, channel_credentials, channel_options, peer_identity

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 8 << 20
GRPC_OPTIONS = [("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES)]
DEFAULT_GROUP_BYTES = 4 << 20
"""Blocks encoded (gathered and hashed) at a time: small enough to stay in cache between gather and hash."""


# ----------------------------------------------------------------------------------------------- receiving
@dataclass(frozen=True)
class ReceiveTarget:
    """Where a checked transfer may land: the receiver's layout, the ids it reserved (in send order) and its cache."""
    layout: KvLayoutSpec
    block_ids: tuple[int, ...]
    kv_cache: torch.Tensor  # [L, 2, num_blocks, block_size, Hkv, D]; a meta tensor of that shape when `write` is set
    write: Callable[[KvReshardPlan, tuple[tuple[range, DecodedBlocks], ...], tuple[int, ...]], None] | None = None
    """Places verified blocks itself, following the plan: a tensor-parallel receiver hands each rank its heads
    from the payload slices (kvstore.transfer_slices.decode_slices) that carry them."""
    rank_kv_heads: tuple[range, ...] = ()
    """The receiver's ranks' KV heads; () for one rank holding every head."""


@dataclass(frozen=True)
class ReceivedBlocks:
    """What a committed transfer wrote, and who sent it."""
    block_ids: tuple[int, ...]
    num_bytes: int
    codec: str
    transport: str
    sender_role: str | None = None  # the pusher's role as its mutual-TLS certificate proves it; None: plaintext
    reshard_bytes: int = 0  # what the re-sharding plan handed the receiver's ranks (kvstore.reshard_plan)
    reshard_slices: int = 0


class KvReceiver(Protocol):
    """The decode worker's side of a transfer. Called from grpc server threads, concurrently for different
    transfers; one transfer's calls come from one thread, in the order check, then commit or reject."""

    def check(self, manifest: TransferManifest) -> ReceiveTarget:
        """Find the reservation behind (request_id, handle) and say where its blocks go. Raise TransferRejected
        (e.g. field "handle", unknown, expired or already receiving) to refuse; then neither commit nor reject
        follows. Must not hand the same reservation to two concurrent transfers. The servicer writes only
        `block_ids` of `kv_cache`, only after every digest passed."""
        ...

    def commit(self, request_id: str, handle: str, blocks: ReceivedBlocks) -> None:
        """Every block is verified and written: the request may decode. May raise TransferRejected (e.g. the
        lease expired meanwhile), which turns into reject + a failed RPC."""
        ...

    def reject(self, request_id: str, handle: str, reason: str) -> None:
        """The transfer failed after check succeeded (bad manifest, digest, size, stream cut, commit refused):
        release the reservation. Called at most once per successful check."""
        ...


def _scatter_verified(buffer: torch.Tensor, manifest: TransferManifest, target: ReceiveTarget,
                      plan: KvReshardPlan) -> None:
    slices = decode_slices(buffer, target.layout, manifest)
    if target.write is not None:
        target.write(plan, slices, tuple(manifest.block_ids))
        return
    merge_slices(slices).scatter_into(target.kv_cache, manifest.block_ids)
    if target.kv_cache.is_cuda:  # the blocks must be in place before commit lets decode read them
        torch.cuda.current_stream(target.kv_cache.device).synchronize()


def _receive_shm(manifest: TransferManifest, target: ReceiveTarget, plan: KvReshardPlan,
                 segments: PooledSegmentReader) -> None:
    try:  # only a segment this host's sender made for this reservation (kvstore.shm, kvstore.shm_pool)
        if is_pooled_name(manifest.shm_name):
            segment = segments.open(manifest.shm_name, request_id=manifest.request_id, handle=manifest.handle,
                                    payload_bytes=manifest.payload_bytes)
        else:
            segment = take_segment(manifest.shm_name, request_id=manifest.request_id, handle=manifest.handle)
    except SegmentRefused as exc:
        raise TransferRejected(str(exc), "shm_name") from None
    except FileNotFoundError:
        raise TransferRejected(f"no shared-memory segment {manifest.shm_name!r} on this host (sender on another "
                               "host, or already unlinked)", "shm_name") from None
    with segment:
        if len(segment.buf) < manifest.payload_bytes:
            raise TransferRejected(f"segment holds {len(segment.buf)} bytes, manifest announces "
                                   f"{manifest.payload_bytes}", "payload_bytes")
        with segment.buf[:manifest.payload_bytes] as view:
            verify_payload(view, manifest, target.layout)
        if manifest.payload_bytes:
            # Zero copy: the kernels read the mapped pages. The sender does not write after sending the manifest.
            buffer = torch.frombuffer(segment.buf, dtype=torch.uint8, count=manifest.payload_bytes)
            _scatter_verified(buffer, manifest, target, plan)
            del buffer  # release the mapping's export before the segment closes


def _receive_grpc(manifest: TransferManifest, data_chunks: Iterator[bytes | TrailerDigests],
                  target: ReceiveTarget, plan: KvReshardPlan, buffers: BufferPool) -> None:
    staging = buffers.take(manifest.payload_bytes)
    try:
        # the records' [start, stop) in the payload: slice by slice for a tensor-parallel sender
        bounds = record_bounds(manifest, target.layout)
        assembler = PayloadAssembler(manifest, bounds, staging)
        trailer = None
        for item in data_chunks:
            if trailer is not None:
                raise TransferRejected("a message after the trailer", "trailer", INVALID_ARGUMENT)
            if isinstance(item, TrailerDigests):
                trailer = item.digests
            else:
                assembler.add(item)
        _scatter_verified(assembler.finish(trailer), manifest, target, plan)
        del assembler
    finally:
        buffers.give_back(staging)


def _cache_segment_error(manifest: TransferManifest, exc: FileNotFoundError) -> TransferRejected:
    if isinstance(exc, SegmentRefused):
        return TransferRejected(str(exc), "cache_segment")
    return TransferRejected(f"no shared-memory segment {manifest.cache_segment!r} on this host (sender on another "
                            "host, or it exited)", "cache_segment")


def _trailer_of(data_chunks: Iterator[bytes | TrailerDigests]) -> tuple[bytes, ...]:
    """The one message after a cache-path manifest: its trailer."""
    trailer = None
    for item in data_chunks:
        if not isinstance(item, TrailerDigests):
            raise TransferRejected("data chunks on an shm transfer", "data", INVALID_ARGUMENT)
        if trailer is not None:
            raise TransferRejected("a message after the trailer", "trailer", INVALID_ARGUMENT)
        trailer = item.digests
    if trailer is None:
        raise TransferRejected("the stream ended without the trailer its manifest announced", "trailer",
                               INVALID_ARGUMENT)
    return trailer


def _receive_cache(manifest: TransferManifest, data_chunks: Iterator[bytes | TrailerDigests],
                   target: ReceiveTarget, plan: KvReshardPlan, segments: PooledSegmentReader,
                   buffers: BufferPool) -> None:
    """The zero-copy path (kvstore.shm_cache): copy each block out of the sender's mapped cache into its
    destination, hashing it as it lands; then the trailer's digests must all match. A cache of this process
    (CPU, contiguous, one rank) is the destination itself; any other goes through a staging buffer and the
    usual scatter."""
    try:
        read = open_cache(segments, manifest, target.layout)
    except FileNotFoundError as exc:
        raise _cache_segment_error(manifest, exc) from None
    cache = target.kv_cache
    with read:
        if target.write is None and cache.device.type == "cpu" and cache.is_contiguous():
            read.copy_verified(cache, manifest.block_ids, lambda: _trailer_of(data_chunks))
            return
        staging = buffers.take(manifest.payload_bytes)
        try:
            payload = staging[:manifest.payload_bytes]  # [payload_bytes] uint8: raw records, in block order
            read.check_landed(read.copy_records(payload), _trailer_of(data_chunks))
            _scatter_verified(payload, manifest, target, plan)
            del payload
        finally:
            buffers.give_back(staging)


def answer_probe(manifest: TransferManifest, segments: PooledSegmentReader) -> None:
    """A sender's probe (a cache-path manifest without a request): TransferRejected unless this receiver can
    map the cache segment it names; its mapping is kept for the pushes that follow."""
    try:
        with open_cache(segments, manifest, manifest.layout):
            pass
    except FileNotFoundError as exc:
        raise _cache_segment_error(manifest, exc) from None


def is_probe(manifest: TransferManifest) -> bool:
    return bool(manifest.cache_segment) and not manifest.request_id and not manifest.handle


@dataclass(frozen=True)
class TrailerDigests:
    """The trailer of a streamed transfer, as the servicer hands it on after the data chunks."""
    digests: tuple[bytes, ...]


def receive_transfer(manifest: TransferManifest, data_chunks: Iterator[bytes | TrailerDigests],
                     receiver: KvReceiver, sender_role: str | None = None, *, buffers: BufferPool | None = None,
                     segments: PooledSegmentReader | None = None) -> ReceivedBlocks:
    """One whole transfer after its manifest: check, receive, verify, scatter, commit; reject on any failure
    after check handed out the reservation (a refused check is the receiver's own decision: nothing to release,
    and a busy reservation must stay with the transfer that holds it). `sender_role`: the pusher's
    authenticated role (None over plaintext), handed to commit with the blocks. `buffers` / `segments`: the
    servicer's reused receive buffers and pooled-segment mappings (fresh ones when not given)."""
    target = receiver.check(manifest)
    try:
        validate_manifest(manifest, target.layout, target.block_ids, target.kv_cache.shape[2])
        target.layout.check_cache(target.kv_cache)
        every_head = (range(target.layout.num_kv_heads),)
        plan = plan_reshard(manifest.sender_kv_heads or every_head, target.rank_kv_heads or every_head)
        if manifest.transport == "grpc":
            _receive_grpc(manifest, data_chunks, target, plan, buffers or BufferPool(0))
        elif manifest.cache_segment:
            _receive_cache(manifest, data_chunks, target, plan, segments or PooledSegmentReader(0),
                           buffers or BufferPool(0))
        else:
            if next(data_chunks, None) is not None:
                raise TransferRejected("data chunks on an shm transfer", "data", INVALID_ARGUMENT)
            _receive_shm(manifest, target, plan, segments or PooledSegmentReader(0))
        received = ReceivedBlocks(tuple(manifest.block_ids), manifest.payload_bytes, manifest.codec,
                                  manifest.transport, sender_role, plan.delivered_bytes(manifest.payload_bytes),
                                  len(plan.slices))
        receiver.commit(manifest.request_id, manifest.handle, received)
        return received
    except Exception as exc:
        try:
            receiver.reject(manifest.request_id, manifest.handle, str(exc))
        except Exception:
            log.exception("reject(%s, %s) failed", manifest.request_id, manifest.handle)
        raise


def _read_manifest(request_iterator: Iterator[kv_transfer_pb2.KvChunk | memoryview]) -> TransferManifest:
    first = next(request_iterator, None)
    if first is None or isinstance(first, memoryview) or first.WhichOneof("body") != "manifest":
        raise TransferRejected("the first message of a Push must be the manifest", "manifest", INVALID_ARGUMENT)
    return manifest_from_pb(first.manifest)


# --- the data chunks' wire form, without a protobuf object per chunk ---
# A KvChunk holding only `data` is, on the wire, the tag byte of field 2 (length-delimited), a varint length and
# the bytes. The sender writes that form itself (one copy out of its staging buffer, instead of bytes(), the
# message and its serialization) and the servicer's deserializer hands the bytes on as a view of the received
# message (no parse, no copy); anything else goes through KvChunk as before. Same bytes on the wire either way.
_DATA_TAG = b"\x12"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_data_chunk(data) -> bytes:
    """The serialized KvChunk(data=data), built in one copy."""
    view = memoryview(data).cast("B")
    return b"".join((_DATA_TAG, _varint(len(view)), view))


def _serialize_chunk(message: kv_transfer_pb2.KvChunk | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _deserialize_chunk(raw: bytes) -> kv_transfer_pb2.KvChunk | memoryview:
    """A data chunk as a view of its payload bytes; any other message (or a data chunk in another valid form)
    as a KvChunk."""
    if raw[:1] == _DATA_TAG:
        length, shift, pos = 0, 0, 1
        while pos < len(raw) and pos <= 10:
            byte = raw[pos]
            length |= (byte & 0x7F) << shift
            pos += 1
            shift += 7
            if not byte & 0x80:
                if pos + length == len(raw):
                    return memoryview(raw)[pos:]
                break
    return kv_transfer_pb2.KvChunk.FromString(raw)


def add_kv_transfer_servicer(servicer: KvTransferServicer, server: grpc.Server) -> None:
    """kv_transfer_pb2_grpc.add_KvTransferServicer_to_server with the data chunks' fast deserializer."""
    handler = grpc.stream_unary_rpc_method_handler(servicer.Push, request_deserializer=_deserialize_chunk,
                                                   response_serializer=kv_transfer_pb2.PushResult.SerializeToString)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("pdserve.v1.KvTransfer",
                                                                          {"Push": handler})])


def _data_of(request_iterator: Iterator[kv_transfer_pb2.KvChunk | memoryview]) -> Iterator[bytes | TrailerDigests]:
    try:
        yield from _messages_of(request_iterator)
    except grpc.RpcError:  # grpc's own error here has no message
        raise TransferRejected("the Push stream was cut before its end (the sender cancelled, timed out or "
                               "died)", "data", "CANCELLED") from None


def _messages_of(request_iterator):
    for message in request_iterator:
        if isinstance(message, memoryview):
            yield message
            continue
        body = message.WhichOneof("body")
        if body == "data":
            yield message.data
        elif body == "trailer":
            yield TrailerDigests(tuple(message.trailer.block_digests))
        else:
            raise TransferRejected("a second manifest inside one Push", "manifest", INVALID_ARGUMENT)


class KvTransferServicer(kv_transfer_pb2_grpc.KvTransferServicer):
    """Thin: unpack the stream, run receive_transfer, map TransferRejected to its status. Owns the receive
    buffers and pooled-segment mappings its transfers reuse."""

    def __init__(self, receiver: KvReceiver, *, max_idle_buffer_bytes: int = 1 << 30) -> None:
        self._receiver = receiver
        self.buffers = BufferPool(max_idle_buffer_bytes)
        self.segments = PooledSegmentReader()

    def Push(self, request_iterator, context):
        try:
            manifest = _read_manifest(request_iterator)
            if is_probe(manifest):
                answer_probe(manifest, self.segments)
                return kv_transfer_pb2.PushResult()
            sender = peer_identity(context.auth_context())
            received = receive_transfer(manifest, _data_of(request_iterator), self._receiver,
                                        sender.role if sender is not None else None, buffers=self.buffers,
                                        segments=self.segments)
        except TransferRejected as exc:
            context.abort(grpc.StatusCode[exc.code], str(exc))
        except Exception as exc:
            log.exception("KV transfer failed")
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        return kv_transfer_pb2.PushResult(bytes=received.num_bytes, num_blocks=len(received.block_ids),
                                          reshard_bytes=received.reshard_bytes,
                                          reshard_slices=received.reshard_slices)


# ----------------------------------------------------------------------------------------------- sending
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
                    "/pdserve.v1.KvTransfer/Push", request_serializer=_serialize_chunk,
                    response_deserializer=kv_transfer_pb2.PushResult.FromString))
            return self._stubs[endpoint][1]

    def push(self, endpoint: str, *, request_id: str, handle: str, layout: KvLayoutSpec,
             kv_cache: torch.Tensor | KvSlices,
             src_block_ids: Sequence[int], dst_block_ids: Sequence[int], transport: str, codec: str = "raw",
             timeout_s: float = 30.0, fault: FaultInjection | None = None) -> TransferStats:
        """Send blocks `src_block_ids` of `kv_cache` to land in `dst_block_ids` of the receiver reservation
        `handle`, over `transport` exactly (no fallback). The source blocks must not change until push returns
        (blocks are gathered as they are sent; a change shows up as a digest rejection). `kv_cache` as KvSlices:
        a tensor-parallel sender's payload slices (kvstore.transfer_slices), sent slice by slice. Raises
        TransferFailed (the receiver's status and message) or ValueError (bad arguments)."""
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
                result = self._push_cache(stub, manifest, src_block_ids, layout.block_bytes(codec), fault, deadline)
            except TransferFailed as exc:
                if exc.code == grpc.StatusCode.INVALID_ARGUMENT and exc.details.startswith(("shm_name: ",
                                                                                            "transport: ")):
                    with self._lock:  # the receiver was replaced by one without the cache path: probe again
                        self._cache_peers.pop(endpoint, None)
                raise
        elif transport == "grpc":
            errors: list[BaseException] = []
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

    def _push_cache(self, stub, manifest, src_block_ids: list[int], block_bytes: int, fault: FaultInjection,
                    deadline: float) -> kv_transfer_pb2.PushResult:
        # The manifest goes first, so that the receiver copies while this thread hashes the same blocks in place;
        # the digests follow in the trailer. The caller holds the blocks until this returns.
        cache = self.shared_cache
        head = manifest(cache_segment=cache.name, src_block_ids=tuple(src_block_ids),
                        cache_num_blocks=cache.num_blocks, sender_epoch=cache.epoch)
        flipped: list[int] = []
        errors: list[BaseException] = []

        def messages() -> Iterator[kv_transfer_pb2.KvChunk]:
            try:
                if fault.corrupt_chunk_index is None:
                    yield head
                    digests = list(block_digests_in_place(cache.tensor, src_block_ids))
                else:  # test hook: the digests, then the corruption of the source block, then the manifest
                    digests = list(block_digests_in_place(cache.tensor, src_block_ids))
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
