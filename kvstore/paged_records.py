"""Raw block records as pieces of a paged KV cache, so that the grpc transport needs no staging buffer on either
side: the sender fills each data chunk straight out of its cache, the receiver lands each chunk straight in its
cache (kvstore.kv_sender and kvstore.transfer_service use it for raw-codec transfers of a contiguous CPU cache).

A cache ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (contiguous) holds block b of layer l,
K (kv 0) or V (kv 1) as the *piece* of ``piece_bytes = block_size * num_kv_heads * head_dim * itemsize`` bytes at
``((l * 2 + kv) * num_blocks + b) * piece_bytes`` (the layout of kvstore.shm_cache, without its header). A block's
raw record (kvstore.transfer) is its ``2 * num_layers`` pieces in (layer, kv) order, so a payload of raw records
is the sequence of its blocks' pieces, and a cut of the payload into chunks anywhere is a cut of that sequence:

    payload  | block 0: piece (0,K) (0,V) (1,K) ... (L-1,V) | block 1: ... |
    chunks   |<-- chunk 0 -->|<-- chunk 1 -->|<-- ...      (chunk_bytes each, boundaries anywhere)

``PagedRecords.stream()`` moves that payload in order, cut anywhere, out of the blocks or into them, and hashes
each stretch right where it was written (one native pass over the bytes: kernels.cpu_kv_copy.PieceStream), so the
sender's digests are of what it sent and the receiver's of what landed. ``RecordDigests`` hashes records as their
bytes stream past in payload order, for a payload that lands in a staging buffer instead. Both give xxh3-128
streamed over each record: the same digest as kvstore.transfer.block_digest of the whole record, whatever the
chunking.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

from kernels.cpu_kv_copy import PieceStream, PlaneHasher, hash_pieces


def is_paged_cache(kv_cache) -> bool:
    """Whether `kv_cache` can be read or written piece by piece here: a contiguous CPU tensor."""
    return isinstance(kv_cache, torch.Tensor) and kv_cache.device.type == "cpu" and kv_cache.is_contiguous()


class PagedRecords:
    """The raw records of blocks `block_ids` of `kv_cache` (in that order), as byte ranges of the cache itself."""

    def __init__(self, kv_cache: torch.Tensor, block_ids: Sequence[int]) -> None:
        # kv_cache: [L, 2, num_blocks, block_size, Hkv, D], contiguous, CPU
        if not is_paged_cache(kv_cache) or kv_cache.dim() != 6:
            raise ValueError("PagedRecords needs a contiguous CPU cache [L, 2, num_blocks, block_size, Hkv, D]")
        num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        self.piece_bytes = block_size * num_kv_heads * head_dim * kv_cache.element_size()
        self.num_pieces = 2 * num_layers
        self.record_bytes = self.num_pieces * self.piece_bytes
        self.payload_bytes = len(block_ids) * self.record_bytes
        self._stride = num_blocks * self.piece_bytes  # from piece (l, kv) of a block to piece (l, kv) + 1
        self._bases = [int(b) * self.piece_bytes for b in block_ids]
        self._cache = kv_cache

    def _view(self) -> memoryview:
        return memoryview(self._cache.reshape(-1).view(torch.uint8).numpy())

    def stream(self, known: Sequence[bytes | None] | None = None) -> PieceStream:
        """The payload, moved in order out of the blocks (gather: the sender's chunks) or into them (land: the
        receiver's), each stretch hashed where it was written (kernels.cpu_kv_copy.PieceStream); `known`: the
        digests the sender already has, one or None per block (those blocks are gathered without hashing)."""
        return PieceStream(self._view(), self._bases, self._stride, self.num_pieces, self.piece_bytes, known=known)

    def digests_in_place(self) -> list[bytes]:
        """Each record's digest, hashed where its pieces are (kernels.cpu_kv_copy.hash_pieces): no gather."""
        return hash_pieces(self._view(), self._bases, self._stride, self.num_pieces, self.piece_bytes)

    def plane_hasher(self) -> PlaneHasher:
        """The records' digests taken a few planes (layer, K/V) at a time, as they are written
        (kernels.cpu_kv_copy.PlaneHasher: engine.kv_digests)."""
        return PlaneHasher(self._view(), self._bases, self._stride, self.num_pieces, self.piece_bytes)


class RecordDigests:
    """Digests of consecutive records (`bounds`: each record's [start, stop) in the payload, back to back from 0;
    an int: that many bytes each, `num_records` of them) from the payload's bytes fed in order, in any pieces."""

    def __init__(self, bounds: int | Sequence[tuple[int, int]], num_records: int = 0) -> None:
        if isinstance(bounds, int):
            bounds = [(i * bounds, (i + 1) * bounds) for i in range(num_records)]
        self._stops = [hi for _, hi in bounds]
        self.num_records = len(self._stops)
        self._fed = 0
        self._hasher = xxhash.xxh3_128()
        self.digests: list[bytes] = []

    def update(self, data) -> int:
        """Feed the next bytes of the payload; returns how many records are complete so far."""
        data, pos = memoryview(data).cast("B"), 0
        end = self._fed + len(data)
        while len(self.digests) < self.num_records and pos < len(data):
            take = min(self._stops[len(self.digests)], end) - self._fed
            self._hasher.update(data[pos:pos + take])
            pos += take
            self._fed += take
            if self._fed == self._stops[len(self.digests)]:
                self.digests.append(self._hasher.digest())
                self._hasher.reset()
        return len(self.digests)
