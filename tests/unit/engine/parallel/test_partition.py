"""The head partition and the KV re-sharding plan: exact layouts and invariants for every degree up to 4."""

import itertools

import pytest

from engine.parallel.partition import (
    HeadPartition,
    KvSlice,
    RankHeads,
    partition_heads,
    plan_kv_resharding,
    split_range,
)

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


def test_from_tuples_rejects_a_foreign_partition():
    with pytest.raises(ValueError, match="is not the partition"):
        HeadPartition.from_tuples(9, 3, ((0, 3, 0, 1), (3, 9, 1, 3)))


@pytest.mark.parametrize("num_heads,num_kv_heads", SHAPES)
def test_every_pair_up_to_4x4(num_heads, num_kv_heads):
    layers, block_size, head_dim, dsize, blocks = 30, 16, 64, 4, 5
    per_head = blocks * 2 * layers * block_size * head_dim * dsize
    for p, d in itertools.product(range(1, 5), repeat=2):
        if max(p, d) > num_heads:
            continue
        src, dst = partition_heads(num_heads, num_kv_heads, p), partition_heads(num_heads, num_kv_heads, d)
        plan = plan_kv_resharding(src, dst)
        for dst_rank, heads in enumerate(dst.ranks):
            got = [kv for s in plan.slices_to(dst_rank) for kv in s.kv_heads]
            assert got == list(heads.kv_heads), (p, d, dst_rank)  # every owned head exactly once, in order
            for s in plan.slices_to(dst_rank):
                assert set(s.kv_heads) <= set(src.ranks[s.src_rank].kv_heads)  # sent by a rank that holds it
        pairs = plan.bytes_per_pair(blocks, layers, block_size, head_dim, dsize)
        assert sum(pairs.values()) == sum(len(h.kv_heads) for h in dst.ranks) * per_head
        assert plan.total_bytes(blocks, layers, block_size, head_dim, dsize) == sum(pairs.values())
        if p == d:
            assert all(s.src_rank == s.dst_rank for s in plan.slices)


def test_default_model_plans_exactly():
    r = range
    two, three = partition_heads(9, 3, 2), partition_heads(9, 3, 3)
    assert plan_kv_resharding(two, partition_heads(9, 3, 1)).slices == (KvSlice(0, 0, r(0, 2)), KvSlice(1, 0, r(2, 3)))
    assert plan_kv_resharding(partition_heads(9, 3, 1), two).slices == (KvSlice(0, 0, r(0, 2)), KvSlice(0, 1, r(2, 3)))
    assert plan_kv_resharding(two, three).slices == (KvSlice(0, 0, r(0, 1)), KvSlice(0, 1, r(1, 2)),
                                                     KvSlice(1, 2, r(2, 3)))
    # at TP=4 kv 0 is on sending ranks 0 and 1: receiving rank 0 takes it from owner 0 % 2, rank 0
    four = partition_heads(9, 3, 4)
    assert plan_kv_resharding(four, three).slices == (KvSlice(0, 0, r(0, 1)), KvSlice(2, 1, r(1, 2)),
                                                      KvSlice(3, 2, r(2, 3)))
    # replicas share the sending: at 4 -> 4 the second holder of kv 0 serves rank 1
    assert plan_kv_resharding(four, four).slices[1] == KvSlice(1, 1, r(0, 1))
    pairs = plan_kv_resharding(two, three).bytes_per_pair(1, 30, 16, 64, 4)
    assert pairs == {(0, 0): 245760, (0, 1): 245760, (1, 2): 245760}


def test_plan_rejects_different_models():
    with pytest.raises(ValueError, match="not the same model"):
        plan_kv_resharding(partition_heads(9, 3, 2), partition_heads(4, 2, 2))
