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
be shorter), ignoring record boundaries. The receiver copies them into one receive staging buffer and checks
each block's digest as soon as its last byte has arrived.

Overlap: the manifest travels first and carries every digest, so every block must be hashed before the first
data byte leaves. ``encode_stream`` keeps that cheap for the common case (raw codec, dense CPU cache): it hashes
the blocks in place (one read pass, no copy) and gathers each group of blocks only when the sender reaches it,
so the gather of group k+1 can overlap the send of group k. For int8 (the digest needs the quantized bytes) and
CUDA caches (the digest needs host bytes) every group is encoded up front.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import xxhash

from kernels import gather_blocks, gather_blocks_int8, scatter_blocks, scatter_blocks_int8
from kvstore.transfer_manifest import (CODECS, DEFAULT_CHUNK_BYTES, KvLayoutSpec, TransferManifest,
                                       TransferRejected, check_chunk_bytes)

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


def digest_blocks_in_place(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> tuple[bytes, ...]:
    """Raw-codec digests read straight from a dense CPU cache, without gathering: equal to the digests of the
    gathered records, encode_records(kv_cache, block_ids, "raw")."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        raise ValueError("digest_blocks_in_place needs a contiguous CPU kv_cache")
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]; block b's raw record is kv_cache[l, kv, b] for l, then kv
    num_layers, _, num_blocks = kv_cache.shape[:3]
    pieces = kv_cache.reshape(num_layers, 2, num_blocks, -1).view(torch.uint8).numpy()  # [L, 2, num_blocks, bytes]
    digests = []
    for block_id in block_ids:
        hasher = xxhash.xxh3_128()
        for layer in range(num_layers):
            hasher.update(pieces[layer, 0, block_id])
            hasher.update(pieces[layer, 1, block_id])
        digests.append(hasher.digest())
    return tuple(digests)


@dataclass
class EncodedStream:
    """A payload produced group by group. `digests` is complete from the start; `groups` yields the
    payload's bytes in order, as [k * block_bytes] uint8 CPU tensors, and can be consumed once."""
    codec: str
    block_bytes: int
    digests: tuple[bytes, ...]
    groups: Iterator[torch.Tensor]
    lazy: bool  # True when groups are gathered only as they are consumed

    @property
    def num_blocks(self) -> int:
        return len(self.digests)

    @property
    def payload_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def encode_stream(kv_cache: torch.Tensor, block_ids: Sequence[int], codec: str,
                  blocks_per_group: int) -> EncodedStream:
    """Encode `block_ids` as groups of `blocks_per_group` blocks. Raw codec on a dense CPU cache: digests are
    hashed in place now and each group is gathered lazily. Otherwise every group is encoded now."""
    _check_codec(codec)
    if blocks_per_group <= 0:
        raise ValueError(f"blocks_per_group must be positive, got {blocks_per_group}")
    block_ids = [int(b) for b in block_ids]
    block_bytes = KvLayoutSpec.from_cache(kv_cache, "").block_bytes(codec)
    id_groups = [block_ids[i:i + blocks_per_group] for i in range(0, len(block_ids), blocks_per_group)]
    if codec == "raw" and kv_cache.device.type == "cpu" and kv_cache.is_contiguous():
        digests = digest_blocks_in_place(kv_cache, block_ids)
        groups = (encode_records(kv_cache, ids, codec) for ids in id_groups)
        return EncodedStream(codec, block_bytes, digests, groups, lazy=True)
    encoded = [encode_records(kv_cache, ids, codec) for ids in id_groups]
    digests = tuple(d for records, ids in zip(encoded, id_groups)
                    for d in _digest_records(memoryview(records.numpy()), block_bytes, len(ids)))
    return EncodedStream(codec, block_bytes, digests, iter(encoded), lazy=False)


def iter_chunks(buffers: Iterable, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """Cut the concatenation of `buffers` (bytes-like objects or 1-D uint8 CPU tensors) into pieces of exactly
    `chunk_bytes`, the last one possibly shorter. Pieces span buffer boundaries."""
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
            yield bytes(view[pos:pos + chunk_bytes])
            pos += chunk_bytes
        pending += view[pos:]
    if pending:
        yield bytes(pending)


def verify_digests(view: memoryview, block_bytes: int, manifest: TransferManifest, start: int, stop: int) -> None:
    """Check blocks [start, stop) of a received payload against the manifest's digests."""
    for i in range(start, stop):
        if block_digest(view[i * block_bytes:(i + 1) * block_bytes]) != manifest.block_digests[i]:
            raise TransferRejected(f"block {i} (destination block {manifest.block_ids[i]}) does not match its "
                                   "digest", f"block_digests[{i}]")


class PayloadAssembler:
    """Reassembles grpc data chunks into one receive staging buffer, checking each block's digest as soon as
    its last byte arrives. The manifest must have passed validate_manifest."""

    def __init__(self, manifest: TransferManifest, block_bytes: int) -> None:
        self._manifest = manifest
        self._block_bytes = block_bytes
        self.buffer = torch.empty(manifest.payload_bytes, dtype=torch.uint8)  # [payload_bytes]
        self._view = memoryview(self.buffer.numpy())
        self._received = 0
        self._verified_blocks = 0

    def add(self, data) -> None:
        end = self._received + len(data)
        if end > self._manifest.payload_bytes:
            raise TransferRejected(f"more than the announced {self._manifest.payload_bytes} bytes arrived",
                                   "payload_bytes")
        self._view[self._received:end] = data
        self._received = end
        complete = end // self._block_bytes if self._block_bytes else 0
        verify_digests(self._view, self._block_bytes, self._manifest, self._verified_blocks, complete)
        self._verified_blocks = complete

    def finish(self) -> torch.Tensor:
        """The whole payload, every digest verified: [payload_bytes] uint8."""
        if self._received != self._manifest.payload_bytes:
            raise TransferRejected(f"stream ended after {self._received} of {self._manifest.payload_bytes} bytes",
                                   "payload_bytes")
        assert self._verified_blocks == len(self._manifest.block_ids)
        return self.buffer


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
