"""The head partition and the KV re-sharding plan: exact layouts and invariants for every degree up to 4."""

import itertools

import pytest

from engine.parallel.partition import (
    HeadPartition,
    RankHeads,
    kv_head_ranges,
    partition_heads,
    plan_kv_resharding,
    split_range,
)
from kvstore.reshard_plan import KvSlice, KvWireSlice, plan_reshard

# (num_heads, num_kv_heads): the default model (9/3), the tiny test model (4/2), MHA, MQA, a Llama-3 shape.
SHAPES = [(9, 3), (4, 2), (8, 8), (8, 1), (32, 8), (6, 2)]


def test_split_range_even_uneven_and_aligned():
    assert split_range(9, 3) == (range(3), range(3, 6), range(6, 9))
    assert split_range(3, 2) == (range(2), range(2, 3))
    assert split_range(1536, 2, align=32) == (range(768), range(768, 1536))
    assert split_range(100, 3, align=32) == (range(32), range(32, 64), range(64, 100))
    with pytest.raises(ValueError, match="cannot split 40 into 2"):
        split_range(40, 2, align=32)


def test_default_model_partitions():
    r, h = range, RankHeads
    assert partition_heads(9, 3, 1).ranks == (h(r(0, 9), r(0, 3)),)
    assert partition_heads(9, 3, 2).ranks == (h(r(0, 6), r(0, 2)), h(r(6, 9), r(2, 3)))
    assert partition_heads(9, 3, 3).ranks == (h(r(0, 3), r(0, 1)), h(r(3, 6), r(1, 2)), h(r(6, 9), r(2, 3)))
    assert partition_heads(9, 3, 4).ranks == (h(r(0, 2), r(0, 1)), h(r(2, 3), r(0, 1)), h(r(3, 6), r(1, 2)),
                                              h(r(6, 9), r(2, 3)))


@pytest.mark.parametrize("num_heads,num_kv_heads", SHAPES)
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_partition_invariants(num_heads, num_kv_heads, tp):
    if tp > num_heads:
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            partition_heads(num_heads, num_kv_heads, tp)
        return
    p = partition_heads(num_heads, num_kv_heads, tp)
    group = num_heads // num_kv_heads
    assert sorted(q for rank in p.ranks for q in rank.q_heads) == list(range(num_heads))  # each q head once
    for rank in p.ranks:
        assert len(rank.q_heads) >= 1 and len(rank.kv_heads) >= 1
        assert len(rank.q_heads) % len(rank.kv_heads) == 0
        ratio = len(rank.q_heads) // len(rank.kv_heads)
        for j, q in enumerate(rank.q_heads):  # the kernel's local GQA rule finds q's own KV head
            assert rank.kv_heads[j // ratio] == q // group
    for kv in range(num_kv_heads):  # replicated only when there are more ranks than KV heads
        assert len(p.kv_owners(kv)) >= 1
        if tp <= num_kv_heads:
            assert len(p.kv_owners(kv)) == 1
    assert HeadPartition.from_tuples(num_heads, num_kv_heads, p.as_tuples()) == p
    assert tuple(rank.kv_heads for rank in p.ranks) == kv_head_ranges(num_kv_heads, tp)


def test_from_tuples_rejects_a_foreign_partition():
    with pytest.raises(ValueError, match="is not the partition"):
        HeadPartition.from_tuples(9, 3, ((0, 3, 0, 1), (3, 9, 1, 3)))


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3, 4, 8])
def test_every_pair_up_to_4x4(num_kv_heads):
    for p, d in itertools.product(range(1, 5), repeat=2):
        plan = plan_kv_resharding(p, d, num_kv_heads)
        src, dst = kv_head_ranges(num_kv_heads, p), kv_head_ranges(num_kv_heads, d)
        # the wire: every head exactly once, in head order, from a sending rank that holds it
        assert [h for w in plan.wire for h in w.kv_heads] == list(range(num_kv_heads)), (p, d)
        for w in plan.wire:
            assert set(w.kv_heads) <= set(src[w.src_rank])
        sent_by = {h: w.src_rank for w in plan.wire for h in w.kv_heads}
        for dst_rank, heads in enumerate(dst):
            got = [kv for s in plan.slices_to(dst_rank) for kv in s.kv_heads]
            assert got == list(heads), (p, d, dst_rank)  # every owned head exactly once, in order
            for s in plan.slices_to(dst_rank):  # taken from the one wire slice that carries it: no duplicate
                assert all(sent_by[h] == s.src_rank for h in s.kv_heads)
        copies = sum(len(h) for h in dst)
        assert sum(plan.heads_per_pair().values()) == copies
        assert plan.delivered_bytes(num_kv_heads * 1000) == copies * 1000
        if p == d and p <= num_kv_heads:  # no replica: the identity plan
            assert all(s.src_rank == s.dst_rank for s in plan.slices)


def test_default_model_plans_exactly():
    r = range
    assert plan_kv_resharding(2, 1, 3).slices == (KvSlice(0, 0, r(0, 2)), KvSlice(1, 0, r(2, 3)))
    assert plan_kv_resharding(1, 2, 3).slices == (KvSlice(0, 0, r(0, 2)), KvSlice(0, 1, r(2, 3)))
    assert plan_kv_resharding(2, 3, 3).slices == (KvSlice(0, 0, r(0, 1)), KvSlice(0, 1, r(1, 2)),
                                                  KvSlice(1, 2, r(2, 3)))
    # at TP=4 kv 0 is on sending ranks 0 and 1: only rank 0 puts it on the wire
    four = plan_kv_resharding(4, 3, 3)
    assert four.wire == (KvWireSlice(0, r(0, 1)), KvWireSlice(2, r(1, 2)), KvWireSlice(3, r(2, 3)))
    assert four.wire_slice(1) is None
    assert four.slices == (KvSlice(0, 0, r(0, 1)), KvSlice(2, 1, r(1, 2)), KvSlice(3, 2, r(2, 3)))
    # a receiver replicating kv 0 (ranks 0 and 1) takes it twice from the one wire slice
    assert plan_kv_resharding(4, 4, 3).slices[:2] == (KvSlice(0, 0, r(0, 1)), KvSlice(0, 1, r(0, 1)))
    assert plan_kv_resharding(2, 3, 3).heads_per_pair() == {(0, 0): 1, (0, 1): 1, (1, 2): 1}
    # the tiny model (2 KV heads) at 2 -> 3: kv 0 on receiving ranks 0 and 1, 1.5 copies of the payload
    assert plan_kv_resharding(2, 3, 2).delivered_bytes(1000) == 1500


def test_plan_rejects_partitions_of_different_heads():
    with pytest.raises(ValueError, match=r"no rank holds KV heads \[2\]"):
        plan_reshard(kv_head_ranges(3, 2), kv_head_ranges(2, 2))
    with pytest.raises(ValueError, match=r"rank 1 holds heads \[2, 3\), not a non-empty range inside \[0, 2\)"):
        plan_reshard(kv_head_ranges(2, 2), kv_head_ranges(3, 2))
    with pytest.raises(ValueError, match="no rank holds KV heads"):
        plan_reshard((range(1), range(2, 3)), kv_head_ranges(3, 1))
    with pytest.raises(ValueError, match="not a non-empty range"):
        plan_reshard((range(3), range(2, 2)), kv_head_ranges(3, 1))
