"""KvTransfer over gRPC, the receiving side: the decode worker's servicer (the sender is kvstore.kv_sender).

Receiving (``KvTransferServicer``, thin; the flow is ``receive_transfer``):

    manifest ─▶ receiver.check(manifest) ─▶ ReceiveTarget(layout, reserved block ids, kv_cache)   (or refuses)
             ─▶ validate_manifest (codec, transport, layout field by field, bounds, reservation ids, digests, size)
    grpc:    raw codec, unsliced, a contiguous CPU cache: each data chunk lands straight in the destination
             blocks (kvstore.paged_records), each block's digest checked (or, with digests_in_trailer, hashed)
             as its bytes pass; a streamed transfer ends with its trailer, whose digests must all match before
             commit; on any failure the destination blocks are zeroed. Otherwise (int8, a tensor-parallel
             sender or receiver, a device cache): into a reused receive staging buffer (BufferPool), checked the
             same way, and nothing is scattered before every digest matched
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

Servers hosting the servicer, and channels to it, should be created with ``GRPC_OPTIONS`` (4 MiB chunks exceed
grpc's default 4 MiB message limit once framed; large frames and socket reads cut the receiver's copies).
"""
from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from kvstore.malloc_tuning import keep_freed_memory_for_reuse
from kvstore.paged_records import PagedRecords, is_paged_cache
from kvstore.reshard_plan import KvReshardPlan, plan_reshard
from kvstore.shm import SegmentRefused, take_segment
from kvstore.shm_cache import open_cache
from kvstore.shm_pool import PooledSegmentReader, is_pooled_name
from kvstore.transfer import BufferPool, DecodedBlocks, PayloadAssembler
from kvstore.transfer_manifest import (INVALID_ARGUMENT, KvLayoutSpec,
                                       TransferManifest, TransferRejected, validate_manifest)
from kvstore.transfer_slices import decode_slices, merge_slices, record_bounds, verify_payload
from protos.convert import manifest_from_pb
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from protos.tls import peer_identity

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 8 << 20
GRPC_OPTIONS = [("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
                # A receiver of 2 MiB messages: let the peer send each in a few large HTTP/2 frames and read the
                # socket in large pieces. Python's grpc makes one bytes object per received slice and joins them
                # into the message; fewer, larger slices cost the decode worker ~10% less CPU per KV push
                # (BENCHMARKS.md "KV over gRPC at socket speed"). The flow-control options (lookahead, BDP probe)
                # measured no better than grpc's defaults.
                ("grpc.http2.max_frame_size", (1 << 24) - 1),
                ("grpc.experimental.tcp_max_read_chunk_size", 16 << 20)]


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
    cache = target.kv_cache
    if (manifest.codec == "raw" and not manifest.sender_kv_heads and target.write is None
            and is_paged_cache(cache)):
        # Straight into the destination blocks as each chunk arrives (kvstore.paged_records): no staging copy,
        # no scatter after the last byte. Nothing commits before every digest matched; on any failure the
        # blocks are zeroed (a fresh cache's state) before the error goes on.
        try:
            _assemble(manifest, data_chunks, PayloadAssembler(
                manifest, target.layout.block_bytes("raw"), landing=PagedRecords(cache, manifest.block_ids)))
        except BaseException:
            cache[:, :, torch.as_tensor(list(manifest.block_ids), dtype=torch.int64)] = 0
            raise
        return
    staging = buffers.take(manifest.payload_bytes)
    try:
        # the records' [start, stop) in the payload: slice by slice for a tensor-parallel sender
        assembler = PayloadAssembler(manifest, record_bounds(manifest, target.layout), staging)
        _scatter_verified(_assemble(manifest, data_chunks, assembler), manifest, target, plan)
        del assembler
    finally:
        buffers.give_back(staging)


def _assemble(manifest: TransferManifest, data_chunks: Iterator[bytes | TrailerDigests],
              assembler: PayloadAssembler) -> torch.Tensor | None:
    trailer = None
    for item in data_chunks:
        if trailer is not None:
            raise TransferRejected("a message after the trailer", "trailer", INVALID_ARGUMENT)
        if isinstance(item, TrailerDigests):
            trailer = item.digests
        else:
            assembler.add(item)
    return assembler.finish(trailer)


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
    return b"".join((_DATA_TAG + _varint(len(view)), view))


def new_data_chunk(num_bytes: int) -> tuple[bytes, memoryview]:
    """A serialized KvChunk whose `num_bytes` of data are not written yet, and a writable view of them: the
    bytes object is fresh and shared with no one until the caller has filled the view (CPython's
    PyBytes_FromStringAndSize(NULL, n), whose contents the caller writes before handing the object on), so a
    chunk's data is written once, where grpc will send it from."""
    header = _DATA_TAG + _varint(num_bytes)
    message = _new_bytes(None, len(header) + num_bytes)
    address = _bytes_address(message)
    ctypes.memmove(address, header, len(header))
    return message, memoryview((ctypes.c_char * num_bytes).from_address(address + len(header))).cast("B")


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, [ctypes.c_char_p, ctypes.c_ssize_t]
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.restype, _bytes_address.argtypes = ctypes.c_void_p, [ctypes.py_object]


def serialize_chunk(message: kv_transfer_pb2.KvChunk | bytes) -> bytes:
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
        keep_freed_memory_for_reuse()  # grpc's message buffers: no page faults per push (kvstore.malloc_tuning)
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
