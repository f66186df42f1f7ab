"""Block accounting on tiny pools with exact block ids, ref counts and eviction order."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored

H0, H1, H2, H3 = 0xA0, 0xA1, 0xA2, 0xA3


def test_fresh_pool_allocates_from_block_zero():
    pool = BlockPool(10)
    assert (pool.num_blocks, pool.get_num_free_blocks(), pool.get_num_used_blocks()) == (10, 10, 0)
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.get_ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert (pool.get_num_free_blocks(), pool.get_num_used_blocks()) == (7, 3)
    assert pool.allocate(0) == []
    assert pool.take_events() == []


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(10)
    pool.allocate(8)
    assert pool.can_allocate(2) and not pool.can_allocate(3) and not pool.can_allocate(-1)
    with pytest.raises(ValueError):
        pool.allocate(3)
    assert pool.get_num_free_blocks() == 2
    assert pool.allocate(2) == [8, 9]


def test_freed_blocks_go_to_the_tail_in_the_order_given():
    pool = BlockPool(10)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([3, 2, 1, 0])                  # a sequence's blocks, reversed
    assert pool.get_num_free_blocks() == 10
    assert pool.allocate(6) == [4, 5, 6, 7, 8, 9]
    assert pool.allocate(4) == [3, 2, 1, 0]


def test_cached_blocks_survive_free_and_are_evicted_tail_first():
    pool = BlockPool(10)
    seq = pool.allocate(3)                   # [0, 1, 2]; block 2 is partial
    pool.cache_block(0, H0)
    pool.cache_block(1, H1)
    assert pool.take_events() == [BlockStored((H0, H1))]
    pool.free(seq[::-1])                     # free list: 3..9, 2, 1, 0
    assert (pool.get_cached_block(H0), pool.get_cached_block(H1)) == (0, 1)
    assert sorted(pool.get_cached_hashes()) == [H0, H1]

    pool.touch([0, 1])                       # prefix hit of a second request
    assert (pool.get_ref_count(0), pool.get_ref_count(1), pool.get_num_free_blocks()) == (1, 1, 8)
    pool.free([1, 0])                        # free list: 3..9, 2, 1, 0

    assert pool.allocate(8) == [3, 4, 5, 6, 7, 8, 9, 2]
    assert pool.take_events() == []          # none of those had a hash
    assert pool.allocate(1) == [1]
    assert pool.take_events() == [BlockRemoved((H1,))]
    assert pool.get_cached_block(H1) is None and pool.get_block_hash(1) is None
    assert pool.get_cached_block(H0) == 0 and pool.get_cached_hashes() == [H0]


def test_touch_keeps_a_free_block_cached_wherever_it_is_in_the_free_list():
    pool = BlockPool(4)
    pool.allocate(4)
    for block_id, block_hash in enumerate((H0, H1, H2, H3)):
        pool.cache_block(block_id, block_hash)
    pool.free([0, 1, 2, 3])                  # free list: 0, 1, 2, 3
    pool.touch([1])
    pool.take_events()
    assert pool.allocate(2) == [0, 2]
    assert pool.take_events() == [BlockRemoved((H0, H2))]
    assert pool.get_cached_block(H1) == 1 and pool.get_ref_count(1) == 1


def test_touch_of_a_free_uncached_block_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    pool.cache_block(0, H0)
    pool.free([0, 1])
    with pytest.raises(ValueError):
        pool.touch([0, 1])
    assert (pool.get_ref_count(0), pool.get_num_free_blocks()) == (0, 4)


def test_cache_block_keeps_the_existing_block_for_a_duplicate_hash():
    pool = BlockPool(10)
    pool.allocate(2)
    pool.cache_block(0, H0)
    pool.cache_block(1, H0)                  # same content computed twice
    pool.cache_block(0, H0)                  # re-caching is a no-op
    assert pool.take_events() == [BlockStored((H0,))]
    assert pool.get_cached_block(H0) == 0 and pool.get_block_hash(1) is None
    with pytest.raises(ValueError):
        pool.cache_block(0, H1)              # one block, one content
    with pytest.raises(ValueError):
        pool.cache_block(5, H2)              # block 5 is free


def test_double_free_raises_before_changing_anything():
    pool = BlockPool(10)
    pool.allocate(2)
    pool.free([0])
    with pytest.raises(ValueError):
        pool.free([0])
    with pytest.raises(ValueError):
        pool.free([1, 1])
    assert pool.get_ref_count(1) == 1 and pool.get_num_free_blocks() == 9
    pool.touch([1])
    pool.free([1, 1])
    assert pool.get_num_free_blocks() == 10


def test_clear_cache_is_refused_while_blocks_are_in_use():
    pool = BlockPool(10)
    pool.allocate(3)
    pool.cache_block(0, H0)
    pool.cache_block(1, H1)
    pool.take_events()
    assert pool.clear_cache() is False
    assert pool.take_events() == [] and pool.get_cached_block(H0) == 0

    pool.free([2, 1, 0])
    assert pool.clear_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.get_cached_hashes() == [] and pool.get_block_hash(0) is None
    assert pool.allocate(10) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert pool.take_events() == []          # nothing left to evict


def test_consecutive_events_of_one_kind_are_merged_in_order():
    pool = BlockPool(3)
    pool.allocate(3)
    pool.cache_block(0, H0)
    pool.cache_block(1, H1)
    pool.free([1, 0, 2])
    pool.allocate(2)                         # evicts block 1 (H1), then block 0 (H0)
    pool.cache_block(1, H2)
    assert pool.take_events() == [BlockStored((H0, H1)), BlockRemoved((H1, H0)), BlockStored((H2,))]
    assert pool.take_events() == []


def test_caching_disabled_never_caches_or_emits():
    pool = BlockPool(4, enable_caching=False)
    pool.allocate(2)
    pool.cache_block(0, H0)
    assert pool.get_cached_block(H0) is None and pool.get_block_hash(0) is None
    pool.free([1, 0])
    assert pool.clear_cache() is True
    assert pool.take_events() == []
    assert pool.allocate(4) == [2, 3, 1, 0]


class PoolMachine(RuleBasedStateMachine):
    """Drives the pool and a list-based reference model; block ids and events must agree."""
    NUM_BLOCKS = 8

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS)
        self.free_list = list(range(self.NUM_BLOCKS))   # head first
        self.refs = [0] * self.NUM_BLOCKS
        self.hash_of: dict[int, int] = {}               # block -> hash
        self.seqs: list[list[int]] = []                 # references held by "sequences"
        self.cached: set[int] = set()                   # hashes the events say are cached

    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        if n > len(self.free_list):
            with pytest.raises(ValueError):
                self.pool.allocate(n)
            return
        expected, self.free_list = self.free_list[:n], self.free_list[n:]
        assert self.pool.allocate(n) == expected
        for block_id in expected:
            self.refs[block_id] = 1
            self.hash_of.pop(block_id, None)
        self.seqs.append(expected)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free_sequence(self, data):
        seq = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.pool.free(seq[::-1])
        for block_id in seq[::-1]:
            self.refs[block_id] -= 1
            if self.refs[block_id] == 0:
                self.free_list.append(block_id)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), block_hash=st.integers(0, 5))
    def cache(self, data, block_hash):
        seq = self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]
        if not seq:
            return
        block_id = seq[data.draw(st.integers(0, len(seq) - 1))]
        if block_id in self.hash_of:
            return
        self.pool.cache_block(block_id, block_hash)
        if block_hash not in self.hash_of.values():
            self.hash_of[block_id] = block_hash

    @rule(block_hash=st.integers(0, 5))
    def prefix_hit(self, block_hash):
        block_id = self.pool.get_cached_block(block_hash)
        owners = [b for b, h in self.hash_of.items() if h == block_hash]
        assert [block_id] == owners if owners else block_id is None
        if block_id is None:
            return
        self.pool.touch([block_id])
        if self.refs[block_id] == 0:
            self.free_list.remove(block_id)
        self.refs[block_id] += 1
        self.seqs.append([block_id])

    @rule()
    def clear(self):
        in_use = any(self.refs)
        assert self.pool.clear_cache() is (not in_use)
        if not in_use:
            self.hash_of.clear()

    @rule()
    def drain_events(self):
        for event in self.pool.take_events():
            if isinstance(event, BlockStored):
                assert self.cached.isdisjoint(event.block_hashes)
                self.cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert self.cached.issuperset(event.block_hashes)
                self.cached.difference_update(event.block_hashes)
            else:
                self.cached.clear()
        assert self.cached == set(self.hash_of.values())

    @invariant()
    def accounting_matches_the_model(self):
        pool = self.pool
        assert pool.get_num_free_blocks() + pool.get_num_used_blocks() == self.NUM_BLOCKS
        assert pool.get_num_free_blocks() == len(self.free_list) == self.refs.count(0)
        for block_id in range(self.NUM_BLOCKS):
            assert pool.get_ref_count(block_id) == self.refs[block_id] >= 0
            block_hash = pool.get_block_hash(block_id)
            assert block_hash == self.hash_of.get(block_id)
            if block_hash is not None:
                assert pool.get_cached_block(block_hash) == block_id
        assert sorted(pool.get_cached_hashes()) == sorted(self.hash_of.values())


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_pool_against_reference_model = PoolMachine.TestCase
