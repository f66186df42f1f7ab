"""KvTransfer over gRPC: the decode worker's servicer and the prefill worker's sender.

Receiving (``KvTransferServicer``, thin; the flow is ``receive_transfer``):

    manifest ─▶ receiver.check(manifest) ─▶ ReceiveTarget(layout, reserved block ids, kv_cache)   (or refuses)
             ─▶ validate_manifest (codec, transport, layout field by field, bounds, reservation ids, digests, size)
    grpc:    data chunks ─▶ receive staging buffer, each block's digest checked once its last byte is in
    shm:     take the named segment (kvstore.shm.take_segment: one this host's sender made for this
             reservation, else rejected naming shm_name), check every digest on the mapped bytes
             ─▶ decode + scatter into kv_cache (only after every digest passed) ─▶ receiver.commit
    any failure after check ─▶ receiver.reject(request_id, handle, reason); the RPC fails with the rejection's code
                   (FAILED_PRECONDITION: layout/fingerprint, digest, size, shm segment; INVALID_ARGUMENT: bounds,
                   reservation ids, codec/transport, malformed stream; INTERNAL: anything else) and a message
                   "<field>: <what mismatched>".

Sending (``KvSender.push``): the transport is the caller's explicit choice and is reported in TransferStats;
there is no fallback. grpc: the request iterator (consumed by a grpc thread) yields the manifest, then 2 MiB
chunks, while a helper thread gathers the next group of blocks (see encode_stream for when gathering is lazy).
shm: the payload goes into a fresh segment, the stream carries only the manifest, and the segment is unlinked
when the RPC returns or fails.

Servers hosting the servicer should be created with ``GRPC_OPTIONS`` (4 MiB chunks exceed grpc's default
4 MiB message limit once framed); the default 2 MiB chunks work without.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc
import torch

from kvstore.reshard_plan import KvReshardPlan, plan_reshard
from kvstore.shm import OutgoingSegment, SegmentRefused, take_segment
from kvstore.transfer import DecodedBlocks, PayloadAssembler, encode_stream, iter_chunks
from kvstore.transfer_manifest import (CODECS, DEFAULT_CHUNK_BYTES, INVALID_ARGUMENT, TRANSPORTS, KvLayoutSpec,
                                       TransferManifest, TransferRejected, check_chunk_bytes, num_chunks,
                                       validate_manifest)
from kvstore.transfer_slices import KvSlices, SlicedAssembler, decode_slices, merge_slices, verify_payload
from protos.convert import manifest_from_pb, manifest_to_pb
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from protos.tls import TlsFiles, channel_credentials, channel_options, peer_identity

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 8 << 20
GRPC_OPTIONS = [("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES)]
DEFAULT_GROUP_BYTES = 4 << 20

T = TypeVar("T")


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


def _receive_shm(manifest: TransferManifest, target: ReceiveTarget, plan: KvReshardPlan) -> None:
    try:  # only a segment this host's sender made for this reservation (kvstore.shm), unlinked once taken
        segment = take_segment(manifest.shm_name, request_id=manifest.request_id, handle=manifest.handle)
    except SegmentRefused as exc:
        raise TransferRejected(str(exc), "shm_name") from None
    except FileNotFoundError:
        raise TransferRejected(f"no shared-memory segment {manifest.shm_name!r} on this host (sender on another "
                               "host, or already unlinked)", "shm_name") from None
    with segment:
        if segment.size < manifest.payload_bytes:
            raise TransferRejected(f"segment holds {segment.size} bytes, manifest announces {manifest.payload_bytes}",
                                   "payload_bytes")
        with segment.buf[:manifest.payload_bytes] as view:
            verify_payload(view, manifest, target.layout)
        if manifest.payload_bytes:
            # Zero copy: the kernels read the mapped pages. The sender does not write after sending the manifest.
            buffer = torch.frombuffer(segment.buf, dtype=torch.uint8, count=manifest.payload_bytes)
            _scatter_verified(buffer, manifest, target, plan)
            del buffer  # release the mapping's export before the segment closes


def receive_transfer(manifest: TransferManifest, data_chunks: Iterator[bytes], receiver: KvReceiver,
                     sender_role: str | None = None) -> ReceivedBlocks:
    """One whole transfer after its manifest: check, receive, verify, scatter, commit; reject on any failure
    after check handed out the reservation (a refused check is the receiver's own decision: nothing to release,
    and a busy reservation must stay with the transfer that holds it). `sender_role`: the pusher's
    authenticated role (None over plaintext), handed to commit with the blocks."""
    target = receiver.check(manifest)
    try:
        validate_manifest(manifest, target.layout, target.block_ids, target.kv_cache.shape[2])
        target.layout.check_cache(target.kv_cache)
        block_bytes = target.layout.block_bytes(manifest.codec)
        every_head = (range(target.layout.num_kv_heads),)
        plan = plan_reshard(manifest.sender_kv_heads or every_head, target.rank_kv_heads or every_head)
        if manifest.transport == "grpc":
            assembler = (SlicedAssembler(manifest, target.layout) if manifest.sender_kv_heads
                         else PayloadAssembler(manifest, block_bytes))
            for data in data_chunks:
                assembler.add(data)
            _scatter_verified(assembler.finish(), manifest, target, plan)
        else:
            if next(data_chunks, None) is not None:
                raise TransferRejected("data chunks on an shm transfer", "data", INVALID_ARGUMENT)
            _receive_shm(manifest, target, plan)
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


def _read_manifest(request_iterator: Iterator[kv_transfer_pb2.KvChunk]) -> TransferManifest:
    first = next(request_iterator, None)
    if first is None or first.WhichOneof("body") != "manifest":
        raise TransferRejected("the first message of a Push must be the manifest", "manifest", INVALID_ARGUMENT)
    return manifest_from_pb(first.manifest)


def _data_of(request_iterator: Iterator[kv_transfer_pb2.KvChunk]) -> Iterator[bytes]:
    for message in request_iterator:
        if message.WhichOneof("body") != "data":
            raise TransferRejected("a second manifest inside one Push", "manifest", INVALID_ARGUMENT)
        yield message.data


class KvTransferServicer(kv_transfer_pb2_grpc.KvTransferServicer):
    """Thin: unpack the stream, run receive_transfer, map TransferRejected to its status."""

    def __init__(self, receiver: KvReceiver) -> None:
        self._receiver = receiver

    def Push(self, request_iterator, context):
        try:
            manifest = _read_manifest(request_iterator)
            sender = peer_identity(context.auth_context())
            received = receive_transfer(manifest, _data_of(request_iterator), self._receiver,
                                        sender.role if sender is not None else None)
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
    (the k-th `chunk_bytes` piece) after the digests were computed, on either transport."""
    corrupt_chunk_index: int | None = None


@dataclass(frozen=True)
class TransferStats:
    num_bytes: int  # payload bytes (as encoded on the wire)
    elapsed_ms: float  # encode + send + receiver's verify/scatter/commit
    transport: str
    codec: str
    num_blocks: int
    reshard_bytes: int = 0  # the receiver's report (PushResult.reshard_bytes); 0 from a receiver without it
    reshard_slices: int = 0


class TransferFailed(Exception):
    """The receiver rejected the transfer or the RPC failed; `code` is the grpc status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def _prefetch(items: Iterator[T], depth: int = 1) -> Iterator[T]:
    """Produce `items` in a helper thread, at most `depth` ahead of the consumer (torch ops drop the GIL)."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def produce() -> None:
        torch.set_num_threads(1)  # memory-bound copies; no OpenMP team beside the engine loop's
        try:
            for item in items:
                slots.put((item, None))
                if stop.is_set():
                    return
            slots.put((end, None))
        except BaseException as exc:  # handed to the consumer
            slots.put((end, exc))

    producer = threading.Thread(target=produce, name="kv-transfer-gather", daemon=True)
    producer.start()
    try:
        while True:
            item, exc = slots.get()
            if item is end:
                if exc is not None:
                    raise exc
                return
            yield item
    finally:
        # Free the slots so a pending put completes; the producer returns after its next put.
        stop.set()
        while True:
            try:
                slots.get_nowait()
            except queue.Empty:
                break
        producer.join()


class KvSender:
    """Pushes blocks of a local cache to decode workers' KvTransfer services. One cached channel per endpoint;
    thread-safe. With `tls` (the prefill worker's cluster files, read once) every channel is mutual TLS and
    accepts only a server certificate of role decode."""

    def __init__(self, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, group_bytes: int = DEFAULT_GROUP_BYTES,
                 tls: TlsFiles | None = None) -> None:
        check_chunk_bytes(chunk_bytes)
        self.chunk_bytes = chunk_bytes
        self.group_bytes = group_bytes
        self._credentials = channel_credentials(tls) if tls is not None else None
        self._stubs: dict[str, tuple[grpc.Channel, kv_transfer_pb2_grpc.KvTransferStub]] = {}
        self._lock = threading.Lock()

    def _stub(self, endpoint: str) -> kv_transfer_pb2_grpc.KvTransferStub:
        with self._lock:
            if endpoint not in self._stubs:
                if self._credentials is None:
                    channel = grpc.insecure_channel(endpoint, options=GRPC_OPTIONS)
                else:  # the server must hold a decode certificate of our CA: nothing else gets a connection
                    channel = grpc.secure_channel(endpoint, self._credentials,
                                                  options=[*GRPC_OPTIONS, *channel_options("decode")])
                self._stubs[endpoint] = (channel, kv_transfer_pb2_grpc.KvTransferStub(channel))
            return self._stubs[endpoint][1]

    def push(self, endpoint: str, *, request_id: str, handle: str, layout: KvLayoutSpec,
             kv_cache: torch.Tensor | KvSlices,
             src_block_ids: Sequence[int], dst_block_ids: Sequence[int], transport: str, codec: str = "raw",
             timeout_s: float = 30.0, fault: FaultInjection | None = None) -> TransferStats:
        """Send blocks `src_block_ids` of `kv_cache` to land in `dst_block_ids` of the receiver reservation
        `handle`, over `transport` exactly (no fallback). The source blocks must not change until push returns
        (with lazy gathering a change shows up as a digest rejection). `kv_cache` as KvSlices: a tensor-parallel
        sender's payload slices (kvstore.transfer_slices). Raises TransferFailed (the receiver's status and
        message) or ValueError (bad arguments)."""
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
        blocks_per_group = max(1, self.group_bytes // layout.block_bytes(codec))
        stream = (kv_cache.encode(src_block_ids, codec, blocks_per_group) if sliced
                  else encode_stream(kv_cache, src_block_ids, codec, blocks_per_group))
        sender_kv_heads = kv_cache.sender_kv_heads if sliced else ()
        corrupt = fault.corrupt_chunk_index if fault is not None else None
        if corrupt is not None and not 0 <= corrupt < num_chunks(stream.payload_bytes, self.chunk_bytes):
            raise ValueError(f"corrupt_chunk_index {corrupt} outside the payload's "
                             f"{num_chunks(stream.payload_bytes, self.chunk_bytes)} chunks")

        def manifest(shm_name: str = "") -> kv_transfer_pb2.KvChunk:
            return kv_transfer_pb2.KvChunk(manifest=manifest_to_pb(TransferManifest(
                request_id, handle, layout, tuple(dst_block_ids), stream.digests, codec, transport, shm_name,
                stream.payload_bytes, sender_kv_heads)))

        stub = self._stub(endpoint)
        if transport == "grpc":
            errors: list[BaseException] = []
            result = self._call(stub, self._grpc_messages(manifest(), stream, corrupt, errors), deadline, errors)
        else:
            with OutgoingSegment(stream.payload_bytes, request_id=request_id,
                                 handle=handle) as segment:  # unlinked on every path out
                offset = 0
                for group in stream.groups:
                    segment.write(offset, group)
                    offset += group.numel()
                if corrupt is not None:
                    segment.flip_byte(corrupt * self.chunk_bytes)
                result = self._call(stub, iter([manifest(segment.name)]), deadline, [])
        if result.num_blocks != len(dst_block_ids) or result.bytes != stream.payload_bytes:
            raise TransferFailed(grpc.StatusCode.INTERNAL, f"receiver reports {result.num_blocks} blocks / "
                                 f"{result.bytes} bytes, sent {len(dst_block_ids)} / {stream.payload_bytes}")
        return TransferStats(stream.payload_bytes, (time.perf_counter() - start) * 1e3, transport, codec,
                             len(dst_block_ids), result.reshard_bytes, result.reshard_slices)

    def _grpc_messages(self, manifest: kv_transfer_pb2.KvChunk, stream, corrupt: int | None,
                       errors: list[BaseException]) -> Iterator[kv_transfer_pb2.KvChunk]:
        # Runs in grpc's request-consumer thread; _prefetch gathers group k+1 meanwhile.
        try:
            yield manifest
            groups = _prefetch(stream.groups) if stream.lazy else stream.groups
            for index, data in enumerate(iter_chunks(groups, self.chunk_bytes)):
                if index == corrupt:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                yield kv_transfer_pb2.KvChunk(data=data)
        except Exception as exc:  # grpc would only report "Exception iterating requests"
            errors.append(exc)
            raise

    @staticmethod
    def _call(stub, messages, deadline: float, errors: list[BaseException]) -> kv_transfer_pb2.PushResult:
        try:
            return stub.Push(messages, timeout=max(0.0, deadline - time.perf_counter()))
        except grpc.RpcError as exc:
            if errors:
                raise errors[0] from exc
            raise TransferFailed(exc.code(), exc.details() or "") from exc

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()

    def __enter__(self) -> KvSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
