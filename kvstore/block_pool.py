"""KV block pool: ref counts, prefix caching by block hash, LRU eviction, and the events the index consumes.

A block is a local slot id in ``[0, num_blocks)``. Each block has a ref count and, once full and
registered with ``cache_block``, a content hash (see kvstore/hashing.py). States:

    used    ref_count > 0                    not in the free list
    free    ref_count == 0, with a hash      in the free list, still reusable by a prefix hit (``touch``)
    free    ref_count == 0, no hash          in the free list, garbage contents

Free list (an OrderedDict used as an O(1) doubly linked list), eviction order:

    HEAD (evicted first) ... TAIL (evicted last)
    - at start: 0, 1, ..., N-1
    - ``allocate`` takes from the HEAD; a taken block that had a hash forgets it (BlockRemoved)
    - ``free`` appends blocks reaching ref 0 at the TAIL, in the order given. Callers pass a
      sequence's blocks in reverse, so its tail blocks (least likely shared) are evicted first.
    - ``touch`` on a free cached block removes it from the list wherever it is (prefix hit)

Invariants (asserted on the paths that could break them): ref_count >= 0; a block is in the free
list iff its ref_count is 0; ``hash -> block`` and ``block -> hash`` are inverse maps; one hash maps
to at most one block (a duplicate full block stays unhashed, and its content is not cached).

Events (drained by ``take_events``, in order; consecutive events of one kind are merged):
BlockStored when a hash is registered, BlockRemoved when a hash is forgotten by eviction,
AllBlocksCleared when ``clear_cache`` succeeds. With caching disabled no hash is ever registered
and no event is emitted. Not thread-safe: one owner (the engine loop) drives it.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Full blocks newly cached: each hash now maps to a block of this pool."""
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks evicted: each hash is forgotten by this pool."""
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every hash of this pool is forgotten."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Pending events as [kind, hashes]; merged while the kind repeats, materialized on take.
        self._events: list[tuple[type, list[int]]] = []

    def get_num_free_blocks(self) -> int:
        """Blocks with ref_count 0, cached-but-evictable ones included."""
        return len(self._free)

    def get_num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the HEAD of the free list, each at ref_count 1.

        A taken block that was cached is evicted: its hash is forgotten (one BlockRemoved per call).
        Raises ValueError when fewer than ``num_blocks`` blocks are free; nothing changes then.
        """
        if not self.can_allocate(num_blocks):
            raise ValueError(f"cannot allocate {num_blocks} blocks: {len(self._free)} free")
        block_ids: list[int] = []
        evicted: list[int] = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            assert self._ref_counts[block_id] == 0, f"free block {block_id} has refs"
            block_hash = self._block_hashes[block_id]
            if block_hash is not None:
                self._block_hashes[block_id] = None
                del self._hash_to_block[block_hash]
                evicted.append(block_hash)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        if evicted:
            self._emit(BlockRemoved, evicted)
        return block_ids

    def get_cached_block(self, block_hash: int) -> int | None:
        """Block holding ``block_hash``, used or free; None when not cached. No side effects."""
        return self._hash_to_block.get(block_hash)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (a prefix-cache hit); a free block leaves the free list.

        A free block must be cached (its contents are garbage otherwise): ValueError, nothing changed.
        """
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0 and self._block_hashes[block_id] is None:
                raise ValueError(f"touch of free uncached block {block_id}")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the free list TAIL in this order.

        Cached blocks keep their hash until evicted. Dropping below 0 (a double free) raises
        ValueError before anything changes.
        """
        for block_id, num_drops in Counter(block_ids).items():
            if self._ref_counts[block_id] < num_drops:
                raise ValueError(f"block {block_id} freed more times than referenced "
                                 f"(ref_count {self._ref_counts[block_id]})")
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                assert block_id not in self._free, f"block {block_id} already free"
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Register a full, in-use block under ``block_hash`` and emit BlockStored.

        If another block already holds ``block_hash`` it stays the cached one (this block stays
        unhashed, no event). A block has one content: re-caching it under the same hash is a no-op,
        under a different hash a ValueError. No-op when caching is disabled.
        """
        if not self.enable_caching:
            return
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cache_block of free block {block_id}")
        current = self._block_hashes[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} already cached under another hash")
            return
        if block_hash in self._hash_to_block:
            return
        self._block_hashes[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        self._emit(BlockStored, [block_hash])

    def get_block_hash(self, block_id: int) -> int | None:
        return self._block_hashes[block_id]

    def get_ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def get_cached_hashes(self) -> list[int]:
        """Every hash currently cached (used or free blocks), for a full re-publish."""
        return list(self._hash_to_block)

    def clear_cache(self) -> bool:
        """Forget every hash; emits AllBlocksCleared and returns True.

        Refused (returns False, nothing changes) while any block is in use, as in vLLM: running
        sequences would keep blocks whose hash the index no longer knows. The free list order is kept.
        """
        if self.get_num_used_blocks() > 0:
            return False
        if not self.enable_caching:
            return True
        for block_id in self._hash_to_block.values():
            self._block_hashes[block_id] = None
        self._hash_to_block.clear()
        self._emit(AllBlocksCleared, [])
        return True

    def take_events(self) -> list[KVEvent]:
        """Drain the pending events, oldest first."""
        events: list[KVEvent] = []
        for kind, hashes in self._events:
            events.append(AllBlocksCleared() if kind is AllBlocksCleared else kind(tuple(hashes)))
        self._events.clear()
        return events

    def _emit(self, kind: type, hashes: list[int]) -> None:
        if self._events and self._events[-1][0] is kind:
            self._events[-1][1].extend(hashes)
        else:
            self._events.append((kind, hashes))
