"""Per-sequence KV block tables over a shared `kvstore.BlockPool`, with prefix caching.

Layout of one sequence (block_size 4, 10 tokens, 3 of them new this step):

    token index   0 1 2 3 | 4 5 6 7 | 8 9 . .
    block_ids     [ b0    ] [ b1    ] [ b2    ]
    computed      x x x x   x x x
    new this step                 n   n n
    hashed        h0        h1                 only full blocks are hashed and cached

Invariants (asserted where they are enforced):
- a sequence's `block_ids` cover at least its computed tokens; each id holds one reference of the pool;
- `block_hashes[i]` is the chained hash of block i, present only for full blocks;
- every block is freed exactly once, by `free`, which also empties the table; its one caller is the
  sequence's lease (engine.block_lease), which asserts that a release happens once.

Pure Python: no torch, no I/O.
"""

from __future__ import annotations

from kvstore.block_pool import BlockPool
from kvstore.hashing import extend_block_hashes

from engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, root_hash: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.root_hash = root_hash
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)

    # --- hashing ----------------------------------------------------------------------------------------------
    def update_block_hashes(self, seq: Sequence) -> None:
        """Extend `seq.block_hashes` to every full block of its current tokens."""
        if seq.num_tokens // self.block_size > len(seq.block_hashes):
            extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, self.root_hash, seq.cache_salt)

    # --- prefix cache lookup ----------------------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Blocks of the longest cached prefix of `seq` (no side effects).

        At least one token is always left to compute, so the last position's logits exist to sample from.
        A request that asks for prompt logprobs takes no hit: every prompt position's logits must be computed.
        """
        if not self.enable_caching or seq.num_computed_tokens or seq.params.prompt_logprobs is not None:
            return []
        self.update_block_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit_ids: list[int] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hit_ids.append(block_id)
        return hit_ids

    # --- allocation -------------------------------------------------------------------------------------------
    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_block_ids: list[int] = ()) -> bool:
        needed = self._num_new_blocks(seq, num_new_tokens, computed_block_ids)
        # A cache hit on a block nobody references takes it off the free list, so it counts against free blocks.
        num_evictable_hits = sum(1 for b in computed_block_ids if self.pool.get_ref_count(b) == 0)
        return self.pool.can_allocate(needed + num_evictable_hits)

    def allocate(self, seq: Sequence, num_new_tokens: int, computed_block_ids: list[int] = ()) -> None:
        """Give `seq` blocks for `num_new_tokens` more tokens after its computed ones (plus the cached hits).

        Callers check `can_allocate` first; a shortfall here is a bug.
        """
        if computed_block_ids:
            assert not seq.block_ids, "prefix hits are only taken by a sequence that holds no blocks"
            self.pool.touch(computed_block_ids)
            seq.block_ids.extend(computed_block_ids)
            seq.num_computed_tokens = len(computed_block_ids) * self.block_size
            seq.num_registered_blocks = len(computed_block_ids)
        needed = self._num_new_blocks(seq, num_new_tokens, ())
        if needed > 0:
            seq.block_ids.extend(self.pool.allocate(needed))

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int, computed_block_ids) -> int:
        num_computed = len(computed_block_ids) * self.block_size if computed_block_ids else seq.num_computed_tokens
        num_have = len(computed_block_ids) if computed_block_ids else len(seq.block_ids)
        # A sequence may already hold more (a reservation covering its whole prompt, prefilled in capped chunks).
        return max(0, self.num_blocks_needed(num_computed + num_new_tokens) - num_have)

    # --- n > 1: choices forked on the prompt's blocks ------------------------------------------------------------
    def can_fork(self, parent: Sequence) -> bool:
        """Whether a free block is there for the copy of the prompt's partial last block (none needed when the
        prompt ends on a block boundary)."""
        return self.pool.can_allocate(1 if parent.num_prompt_tokens % self.block_size else 0)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` (holding no blocks) the KV of `parent`'s prompt, computed:

            prompt (block_size 4, 10 tokens)  [ b0 ][ b1 ][ b2 . . ]
            child                             [ b0 ][ b1 ][ c2 . . ]   b0, b1 shared: one more reference each
                                                                       c2 fresh: b2's first 2 slots copied
        The full blocks are shared by reference count (each holder frees its own reference); the partial block
        is where the choices diverge, so it is copied now (copy on write of the first divergent block). Returns
        (source, destination) block ids for the caller to copy on the device, or None when the prompt ends on a
        block boundary. Callers check `can_fork` first."""
        bs = self.block_size
        num_prompt = parent.num_prompt_tokens
        num_full = num_prompt // bs
        assert not child.block_ids and len(parent.block_ids) >= -(-num_prompt // bs), "fork of an uncomputed prompt"
        shared = parent.block_ids[:num_full]
        self.pool.touch(shared)
        child.block_ids = list(shared)
        child.block_hashes = parent.block_hashes[:num_full]
        child.num_registered_blocks = min(parent.num_registered_blocks, num_full)
        child.num_computed_tokens = num_prompt
        if num_prompt % bs == 0:
            return None
        dst = self.pool.allocate(1)[0]
        child.block_ids.append(dst)
        return parent.block_ids[num_full], dst

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block of `seq` that is full and computed, so later requests can reuse it (never the
        blocks of a sequence that is not `cacheable`)."""
        if not self.enable_caching or not seq.cacheable:
            return
        self.update_block_hashes(seq)
        num_full_computed = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_registered_blocks, num_full_computed):
            self.pool.cache_block(seq.block_ids[i], seq.block_hashes[i])
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full_computed)

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks, tail first so a sequence's last blocks are evicted before its prefix."""
        self.pool.free(list(reversed(seq.block_ids)))
        seq.block_ids = []
        seq.kv_digests = {}
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
