"""A KV payload in slices of KV heads: what a tensor-parallel sender puts on the wire, and how a receiver checks
and reads it (kvstore.reshard_plan says which slices there are; the manifest's sender_kv_heads names them).

Payload: the manifest's payload slices in order (`TransferManifest.payload_slices()`), slice j holding heads
[a_j, b_j); slice j is ``num_blocks`` block records of the layout restricted to its heads (kvstore.transfer's
record format with num_kv_heads = b_j - a_j), back to back. Digest j * num_blocks + i is block i's record in
slice j. A payload of one slice of every head is exactly kvstore.transfer's unsliced payload, so a sender
without tensor parallelism (no sender_kv_heads) is the one-slice case. Slices sum to the unsliced payload's size.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.reshard_plan import payload_slices
from kvstore.transfer import DecodedBlocks, block_digest, decode_payload
from kvstore.transfer_manifest import KvLayoutSpec, TransferManifest, TransferRejected

__all__ = ["KvSlices", "decode_slices", "merge_slices", "record_bounds", "take_heads", "verify_payload"]


@dataclass(frozen=True)
class KvSlices:
    """A tensor-parallel sender's blocks: its ranks' KV heads and, per payload slice, the blocks gathered from
    the rank that sends it ([L, 2, n, block_size, that slice's heads, D] each, blocks 0..n-1 in send order)."""
    sender_kv_heads: tuple[range, ...]
    caches: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        heads = [len(w.kv_heads) for w in payload_slices(self.sender_kv_heads)]
        if [c.shape[4] for c in self.caches] != heads or len({c.shape[2] for c in self.caches}) != 1:
            raise ValueError(f"slice caches {[tuple(c.shape) for c in self.caches]} do not hold the payload "
                             f"slices' {heads} heads for one number of blocks")

    @property
    def num_blocks(self) -> int:
        return self.caches[0].shape[2]

    def check_layout(self, layout: KvLayoutSpec) -> None:
        """ValueError unless every slice cache is `layout` restricted to its heads."""
        for cache in self.caches:
            dataclasses.replace(layout, num_kv_heads=cache.shape[4]).check_cache(cache)


def record_bounds(manifest: TransferManifest, layout: KvLayoutSpec) -> list[tuple[int, int]]:
    """[start, stop) of each block record in the payload, in digest order."""
    n = len(manifest.block_ids)
    bounds, offset = [], 0
    for heads in manifest.payload_slices():
        record = dataclasses.replace(layout, num_kv_heads=len(heads)).block_bytes(manifest.codec)
        bounds += [(offset + i * record, offset + (i + 1) * record) for i in range(n)]
        offset += n * record
    return bounds


def _verify(view: memoryview, manifest: TransferManifest, bounds: list[tuple[int, int]], start: int,
            stop: int) -> None:
    n = len(manifest.block_ids)
    for k in range(start, stop):
        lo, hi = bounds[k]
        if block_digest(view[lo:hi]) != manifest.block_digests[k]:
            raise TransferRejected(f"block {k % n} of payload slice {k // n} (destination block "
                                   f"{manifest.block_ids[k % n]}) does not match its digest", f"block_digests[{k}]")


def verify_payload(view: memoryview, manifest: TransferManifest, layout: KvLayoutSpec) -> None:
    """Check every record of a whole received payload against the manifest's digests."""
    _verify(view, manifest, record_bounds(manifest, layout), 0, len(manifest.block_digests))


def decode_slices(buffer: torch.Tensor, layout: KvLayoutSpec,
                  manifest: TransferManifest) -> tuple[tuple[range, DecodedBlocks], ...]:
    """A verified payload ([payload_bytes] uint8, CPU) as (heads, blocks of those heads) per payload slice
    (views of the buffer where the codec allows)."""
    n = len(manifest.block_ids)
    out, offset = [], 0
    for heads in manifest.payload_slices():
        sub = dataclasses.replace(layout, num_kv_heads=len(heads))
        size = n * sub.block_bytes(manifest.codec)
        out.append((heads, decode_payload(buffer[offset:offset + size], sub, manifest.codec, n)))
        offset += size
    return tuple(out)


def merge_slices(slices: Sequence[tuple[range, DecodedBlocks]]) -> DecodedBlocks:
    """The blocks of every head from slices that cover them in order (one slice: itself, no copy)."""
    if len(slices) == 1:
        return slices[0][1]
    # data: [n, L, 2, block_size, heads, D] per slice; scales: [n, L, 2, heads]
    blocks = [b for _, b in slices]
    scales = None if blocks[0].scales is None else torch.cat([b.scales for b in blocks], dim=3)
    return DecodedBlocks(blocks[0].codec, torch.cat([b.data for b in blocks], dim=4), scales)


def take_heads(slices: Sequence[tuple[range, DecodedBlocks]], heads: range) -> DecodedBlocks:
    """Blocks of KV heads `heads` (contiguous) cut from the slices that carry them, heads in order."""
    parts = []
    for carried, blocks in slices:
        lo, hi = max(heads.start, carried.start), min(heads.stop, carried.stop)
        if lo < hi:
            a, b = lo - carried.start, hi - carried.start
            if (a, b) != (0, len(carried)):  # a cut of the heads axis: contiguous again for the kernels
                scales = None if blocks.scales is None else blocks.scales[:, :, :, a:b].contiguous()
                blocks = DecodedBlocks(blocks.codec, blocks.data[:, :, :, :, a:b].contiguous(), scales)
            parts.append((range(lo, hi), blocks))
    if sum(len(h) for h, _ in parts) != len(heads):
        raise ValueError(f"the payload slices do not carry KV heads {heads}")
    return merge_slices(parts)
