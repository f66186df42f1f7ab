"""KV transfer codec: what the bytes of a transfer are, how they are checked, chunked and scattered.

No grpc here (kvstore/transfer_service.py is the wire, kvstore/shm.py the same-host data path); the manifest,
layout and their checks are plain data in kvstore/transfer_manifest.py.

Payload byte layout (all multi-byte values in the machine's native order, little-endian on every platform
torch supports). A payload is ``num_blocks`` fixed-size *block records*, in the manifest's ``block_ids`` order,
back to back with no header or padding, so block i is ``payload[i * block_bytes:(i + 1) * block_bytes]``:

    raw   record = staging[i]: [num_layers, 2, block_size, num_kv_heads, head_dim] in the cache dtype
                   (exactly the bytes of kernels.gather_blocks' staging, K before V)
          block_bytes = num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize
    int8  record = data[i]:   [num_layers, 2, block_size, num_kv_heads, head_dim] int8
                   then scales[i]: [num_layers, 2, num_kv_heads] float32
                   (kernels.quantize_blocks_int8: symmetric, one scale per block, layer, K/V and kv head)
          block_bytes = num_layers * 2 * block_size * num_kv_heads * head_dim + num_layers * 2 * num_kv_heads * 4

Digests: ``block_digest(record) = xxhash.xxh3_128(record, seed=0).digest()`` (16 bytes, big-endian as xxhash
writes it), one per block over the record's bytes exactly as sent. The receiver verifies every digest before
it scatters anything, so a rejected transfer leaves its destination blocks untouched.

Chunks: the grpc transport cuts the payload into pieces of ``chunk_bytes`` (1-4 MiB, default 2 MiB; the last may
be shorter), ignoring record boundaries. The receiver hashes each block as its bytes arrive, and puts them either
straight into the destination blocks (raw codec into a contiguous CPU cache: kvstore.paged_records) or into one
receive staging buffer (reused across transfers: ``BufferPool``) that is scattered once every digest passed.

No staging copies, no hashing ahead: ``write_records`` encodes a group of blocks straight into the memory that
carries it (a pooled shared-memory segment, or the sender's reused grpc staging buffer; from a CPU cache the raw
codec gathers there with kernels.gather_blocks(out=), the int8 one with kernels.gather_blocks_int8(out=), and the
receiver scatters int8 records from where they landed) and hashes the group while it is still in cache. Over grpc
the digests therefore travel in a trailer after the data (manifest.digests_in_trailer), and the first byte leaves as
soon as the first group is gathered; over shm the manifest is sent once the segment is complete and carries them.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
import threading
from dataclasses import dataclass

import torch
import xxhash

from kernels import gather_blocks, gather_blocks_int8, scatter_blocks, scatter_blocks_int8
from kvstore.paged_records import RecordDigests
from kvstore.transfer_manifest import (CODECS, DEFAULT_CHUNK_BYTES, INVALID_ARGUMENT, KvLayoutSpec,
                                       TransferManifest, TransferRejected, check_chunk_bytes, check_trailer_digests)

MIN_BUFFER_BYTES = 4 << 20


def block_digest(data) -> bytes:
    """xxh3-128 (seed 0) of one block record: 16 bytes. `data` is any bytes-like object."""
    return xxhash.xxh3_128_digest(data)


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")


def _as_index(block_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1).to(device)


def encode_records(kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, codec: str) -> torch.Tensor:
    """Gather `block_ids` with the kernels and lay them out as block records: [n * block_bytes] uint8 on CPU."""
    _check_codec(codec)
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
    ids = _as_index(block_ids, kv_cache.device)  # [n]
    n = ids.numel()
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    block_elems = num_layers * 2 * block_size * num_kv_heads * head_dim
    if n == 0:
        return torch.empty(0, dtype=torch.uint8)
    if codec == "raw":
        staging = gather_blocks(kv_cache, ids)  # [n, L, 2, block_size, Hkv, D], contiguous
        records = staging.reshape(n, block_elems).view(torch.uint8)  # [n, block_bytes]
    else:
        data, scales = gather_blocks_int8(kv_cache, ids)  # int8 [n, L, 2, block_size, Hkv, D]; fp32 [n, L, 2, Hkv]
        scale_bytes = scales.reshape(n, -1).contiguous().view(torch.uint8)  # [n, L * 2 * Hkv * 4]
        records = torch.empty(n, block_elems + scale_bytes.shape[1], dtype=torch.uint8, device=kv_cache.device)
        records[:, :block_elems] = data.reshape(n, block_elems).view(torch.uint8)
        records[:, block_elems:] = scale_bytes
    return records.reshape(-1).contiguous().cpu()


def _digest_records(view: memoryview, block_bytes: int, num_blocks: int) -> tuple[bytes, ...]:
    return tuple(block_digest(view[i * block_bytes:(i + 1) * block_bytes]) for i in range(num_blocks))


def write_records(kv_cache: torch.Tensor, block_ids: Sequence[int], codec: str, out: torch.Tensor) -> tuple[bytes, ...]:
    """Encode `block_ids` as block records straight into `out` ([n * block_bytes] uint8 CPU memory: a pooled
    shared-memory segment's payload, a reused staging buffer) and return their digests, hashed while the records
    are still in cache. On a CPU cache the kernels' gather (raw) or gather-and-quantize (int8) writes `out` itself,
    no staging tensor."""
    _check_codec(codec)
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]; out: [n * block_bytes] uint8
    n = len(block_ids)
    layout = KvLayoutSpec.from_cache(kv_cache, "")
    block_bytes, block_elems = layout.block_bytes(codec), layout.block_elems
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != n * block_bytes or out.device.type != "cpu":
        raise ValueError(f"out must be a [{n * block_bytes}] uint8 CPU tensor, got {tuple(out.shape)} {out.dtype} "
                         f"on {out.device}")
    if n == 0:
        return ()
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    shape = (n, num_layers, 2, block_size, num_kv_heads, head_dim)
    if codec == "raw" and kv_cache.device.type == "cpu":
        gather_blocks(kv_cache, _as_index(block_ids, kv_cache.device), out=out.view(kv_cache.dtype).view(shape))
    elif kv_cache.device.type == "cpu" and (out.storage_offset() + block_elems) % 4 == 0 and block_bytes % 4 == 0:
        records = out.view(n, block_bytes)  # each record's codes, then its scales (4-byte aligned: viewable as fp32)
        gather_blocks_int8(kv_cache, _as_index(block_ids, kv_cache.device),
                           out=(records[:, :block_elems].view(torch.int8).view(shape),
                                records[:, block_elems:].view(torch.float32).view(shape[:3] + (num_kv_heads,))))
    else:  # a device cache (or unaligned int8 records): encode, then one copy to host memory
        out.copy_(encode_records(kv_cache, block_ids, codec))
    return _digest_records(memoryview(out.numpy()), block_bytes, n)


def iter_chunks(buffers: Iterable, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes | memoryview]:
    """Cut the concatenation of `buffers` (bytes-like objects or 1-D uint8 CPU tensors) into pieces of exactly
    `chunk_bytes`, the last one possibly shorter. Pieces span buffer boundaries. A piece inside one buffer is a
    view of it (valid while that buffer is unchanged: the sender encodes each piece before it asks for the next);
    one that spans buffers is a copy."""
    check_chunk_bytes(chunk_bytes)
    pending = bytearray()
    for buffer in buffers:
        view = memoryview(buffer.numpy() if isinstance(buffer, torch.Tensor) else buffer).cast("B")
        pos = 0
        if pending:
            pos = min(chunk_bytes - len(pending), len(view))
            pending += view[:pos]
            if len(pending) == chunk_bytes:
                yield bytes(pending)
                pending = bytearray()
        while len(view) - pos >= chunk_bytes:
            yield view[pos:pos + chunk_bytes]
            pos += chunk_bytes
        pending += view[pos:]
    if pending:
        yield bytes(pending)


def _reject_block(manifest: TransferManifest, k: int) -> None:
    n = len(manifest.block_ids)
    where = f"block {k % n} of payload slice {k // n}" if manifest.sender_kv_heads else f"block {k}"
    raise TransferRejected(f"{where} (destination block {manifest.block_ids[k % n]}) does not match its digest",
                           f"block_digests[{k}]")


class PayloadAssembler:
    """Reassembles grpc data chunks, in one of two places: a receive staging buffer (`buffer`, e.g. a reused
    one, at least payload_bytes long; else a fresh one), or, with `landing` (kvstore.paged_records.PagedRecords
    of the destination blocks: a raw, unsliced payload into a contiguous CPU cache), the destination blocks of
    the cache themselves, each chunk as it arrives (no staging copy, no scatter afterwards). `records`: the
    block records' [start, stop) in the payload, in digest order (kvstore.transfer_slices.record_bounds), or the
    record size of an unsliced payload. Each record is hashed as its bytes arrive; with the digests in the
    manifest each is checked once its last byte is in, with the digests in the trailer all of them are compared
    in finish(). Nothing is scattered from a staging buffer before finish() passed; a landing caller must undo
    the landed blocks when add() or finish() raises. The manifest must have passed validate_manifest."""

    def __init__(self, manifest: TransferManifest, records: int | Sequence[tuple[int, int]],
                 buffer: torch.Tensor | None = None, *, landing=None) -> None:
        self._manifest = manifest
        self._landing = landing
        if landing is not None:
            if landing.payload_bytes != manifest.payload_bytes:
                raise ValueError(f"landing holds {landing.payload_bytes} bytes, the payload {manifest.payload_bytes}")
            self._digests = landing.stream()
            self.buffer = None
        else:
            self._digests = RecordDigests(records, len(manifest.block_ids))
            if buffer is None:
                buffer = torch.empty(manifest.payload_bytes, dtype=torch.uint8)
            if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < manifest.payload_bytes:
                raise ValueError(f"buffer must be a 1-D uint8 tensor of >= {manifest.payload_bytes} bytes")
            self.buffer = buffer[:manifest.payload_bytes]  # [payload_bytes]
            self._view = memoryview(self.buffer.numpy())
        self._received = 0
        self._checked = 0  # digests in the manifest: records checked so far

    def add(self, data) -> None:
        end = self._received + len(data)
        if end > self._manifest.payload_bytes:
            raise TransferRejected(f"more than the announced {self._manifest.payload_bytes} bytes arrived",
                                   "payload_bytes")
        if self._landing is not None:
            done = self._digests.land(data)  # landed and hashed where it landed, in one pass
        else:
            self._view[self._received:end] = data
            done = self._digests.update(data)
        self._received = end
        if not self._manifest.digests_in_trailer:
            for k in range(self._checked, done):
                if self._digests.digests[k] != self._manifest.block_digests[k]:
                    _reject_block(self._manifest, k)
            self._checked = done

    def finish(self, trailer_digests: Sequence[bytes] | None = None) -> torch.Tensor | None:
        """The whole payload, every digest verified: [payload_bytes] uint8 (None with a landing: it is in the
        cache). `trailer_digests`: the trailer's digests, required exactly when the manifest says
        digests_in_trailer."""
        if self._received != self._manifest.payload_bytes:
            raise TransferRejected(f"stream ended after {self._received} of {self._manifest.payload_bytes} bytes",
                                   "payload_bytes")
        assert len(self._digests.digests) == self._digests.num_records
        if self._landing is not None:
            self._digests.close()  # every byte landed: the native stream's state is done with
        if self._manifest.digests_in_trailer:
            if trailer_digests is None:
                raise TransferRejected("the stream ended without the trailer its manifest announced", "trailer",
                                       INVALID_ARGUMENT)
            check_trailer_digests(self._manifest, trailer_digests)
            for k, (got, sent) in enumerate(zip(self._digests.digests, trailer_digests, strict=True)):
                if got != sent:
                    _reject_block(self._manifest, k)
        elif trailer_digests is not None:
            raise TransferRejected("a trailer on a transfer whose manifest carries the digests", "trailer",
                                   INVALID_ARGUMENT)
        return self.buffer


class BufferPool:
    """Reused host staging buffers ([capacity] uint8 tensors): a fresh buffer pays a page fault per 4 KiB page
    on first write, which cost more than the copy itself. take() hands out the smallest idle buffer that fits
    (else a new one, capacity rounded up to a power of two >= 4 MiB); give_back() keeps at most
    `max_idle_bytes` idle. Thread-safe; a buffer belongs to its taker until given back."""

    def __init__(self, max_idle_bytes: int = 1 << 30) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.num_allocated = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fitting = [i for i, b in enumerate(self._idle) if b.numel() >= nbytes]  # (tensors compare by value)
            if fitting:
                return self._idle.pop(min(fitting, key=lambda i: self._idle[i].numel()))
            self.num_allocated += 1
        return torch.empty(max(MIN_BUFFER_BYTES, 1 << max(0, (nbytes - 1).bit_length())), dtype=torch.uint8)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._idle.append(buffer)
            while sum(b.numel() for b in self._idle) > self.max_idle_bytes:
                self._idle.pop(min(range(len(self._idle)), key=lambda i: self._idle[i].numel()))

    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._idle)


@dataclass(frozen=True)
class DecodedBlocks:
    """A verified payload viewed as tensors, ready to scatter (views of the payload buffer where possible)."""
    codec: str
    data: torch.Tensor  # raw: [n, L, 2, block_size, Hkv, D] cache dtype; int8: same shape, int8
    scales: torch.Tensor | None  # int8 only: [n, L, 2, Hkv] fp32

    def scatter_into(self, kv_cache: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Write block i into kv_cache block block_ids[i] of every layer."""
        # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
        if self.data.shape[0] == 0:
            return
        ids = _as_index(block_ids, kv_cache.device)  # [n]
        data = self.data.to(kv_cache.device)
        if self.codec == "raw":
            scatter_blocks(data, kv_cache, ids)
        else:
            scatter_blocks_int8(data, self.scales.to(kv_cache.device), kv_cache, ids)


def decode_payload(buffer: torch.Tensor, layout: KvLayoutSpec, codec: str, num_blocks: int) -> DecodedBlocks:
    """View a verified payload ([num_blocks * block_bytes] uint8, CPU) as the blocks it encodes."""
    _check_codec(codec)
    block_bytes = layout.block_bytes(codec)
    if buffer.numel() != num_blocks * block_bytes:
        raise ValueError(f"payload has {buffer.numel()} bytes, {num_blocks} {codec} blocks need "
                         f"{num_blocks * block_bytes}")
    shape = (num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if codec == "raw":
        # buffer: [n * block_bytes] uint8 -> [n, L, 2, block_size, Hkv, D] cache dtype, no copy
        return DecodedBlocks(codec, buffer.view(getattr(torch, layout.dtype)).view(shape), None)
    records = buffer.view(num_blocks, block_bytes)  # [n, block_elems + L * 2 * Hkv * 4]
    data = records[:, :layout.block_elems].view(torch.int8).reshape(shape)  # [n, L, 2, block_size, Hkv, D]
    scales = (records[:, layout.block_elems:].contiguous().view(torch.float32)
              .view(num_blocks, layout.num_layers, 2, layout.num_kv_heads))  # [n, L, 2, Hkv]
    return DecodedBlocks(codec, data, scales)
