"""How a tensor-parallel worker splits a model across its N ranks, and how KV moves between two degrees.

Pure functions over plain integers (no torch): they fix the layout every rank, the KV transfer and the tests
agree on.

Megatron-style sharding (engine.parallel.shard applies it to the weights):
    q/k/v, gate/up   column-parallel: each rank computes its heads' / its slice of the intermediate's outputs
    o, down          row-parallel: each rank multiplies its slice of the inputs; the partial sums are all-reduced
    embedding        vocab-parallel: each rank looks up the ids in its vocabulary slice (others give 0), all-reduce
    LM head          vocab-parallel: each rank computes its vocabulary slice's logits, rank 0 gathers them
    norms, router    replicated

Attention heads (`partition_heads`). Query heads come in GQA groups: group g is KV head g with its
G = num_heads / num_kv_heads query heads, and a query head never leaves its KV head's rank.
    N <= num_kv_heads  whole groups per rank, contiguous, as even as possible (the first ranks take one more):
                       9 q / 3 kv heads at N=2 -> rank 0: kv 0-1 + q 0-5, rank 1: kv 2 + q 6-8 (uneven, group-aligned)
    N >  num_kv_heads  each group's KV head is replicated on the ranks that share its query heads (as vLLM):
                       the ranks are split over the groups as evenly as possible, each group's query heads over
                       its ranks; every rank then holds exactly one KV head (needs N <= num_heads)
                       9 q / 3 kv heads at N=4 -> ranks 0-1: kv 0 (q 0-1, q 2), rank 2: kv 1, rank 3: kv 2
On every rank the local query head j attends to local KV head j // (local q heads / local kv heads): the
paged-attention kernel's GQA rule holds per rank unchanged.

Dimensions split evenly (`split_range`) in units of `align` (int4 needs multiples of its 32-input groups on a
row-parallel weight's inputs and of 16 outputs on a column-parallel weight), the remainder to the first parts.

KV re-sharding (`plan_kv_resharding(p, d, num_kv_heads)`, a function of the two degrees and the KV heads only,
since a rank's KV heads do not depend on the query heads: `kv_head_ranges`). A prefill worker at TP=p sends its
blocks to a decode worker at TP=d (kvstore.reshard_plan holds the plan's rules, the manifest carries the sender's
`kv_head_ranges`):
    wire       every KV head once, from the first sending rank that holds it (a rank holding only replicas
               sends nothing), as one payload slice per sending rank, in rank order, with its own digests
    receiving  receiving rank r takes each head it owns from the slice that carries it, so every owned head is
               covered exactly once; a head replicated on several receiving ranks crosses the wire once and is
               copied to each of them on the receiving host
    3 KV heads, 2 -> 3: rank 0 sends kv 0-1, rank 1 kv 2; receiving rank 0 takes kv 0 from 0, 1 kv 1 from 0,
               2 kv 2 from 1.   4 -> 1: ranks 0 and 1 both hold kv 0, only rank 0 sends it.
The plan's bytes (what the receiving ranks take) are reported per transfer (Timings.kv_reshard_bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.reshard_plan import KvReshardPlan, plan_reshard

__all__ = ["HeadPartition", "RankHeads", "kv_head_ranges", "partition_heads", "plan_kv_resharding", "split_range"]


def split_range(n: int, parts: int, align: int = 1) -> tuple[range, ...]:
    """[0, n) cut into `parts` contiguous non-empty ranges whose sizes are multiples of `align` (the last one
    also takes n % align), as even as possible with the larger ones first. ValueError when impossible."""
    if parts < 1 or align < 1:
        raise ValueError(f"split_range needs parts >= 1 and align >= 1, got parts={parts} align={align}")
    units = n // align
    if units < parts:
        raise ValueError(f"cannot split {n} into {parts} non-empty parts of multiples of {align}")
    base, extra = divmod(units, parts)
    ranges, start = [], 0
    for i in range(parts):
        stop = start + (base + (i < extra)) * align
        if i == parts - 1:
            stop = n
        ranges.append(range(start, stop))
        start = stop
    return tuple(ranges)


@dataclass(frozen=True)
class RankHeads:
    """The attention heads one rank computes (global head ids, contiguous)."""

    q_heads: range
    kv_heads: range


@dataclass(frozen=True)
class HeadPartition:
    """Which query and KV heads each rank of a tensor-parallel worker holds (see the module docstring)."""

    num_heads: int
    num_kv_heads: int
    ranks: tuple[RankHeads, ...]

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    def kv_owners(self, kv_head: int) -> tuple[int, ...]:
        """The ranks holding KV head `kv_head`, ascending."""
        return tuple(r for r, heads in enumerate(self.ranks) if kv_head in heads.kv_heads)

    def as_tuples(self) -> tuple[tuple[int, int, int, int], ...]:
        """(q_start, q_stop, kv_start, kv_stop) per rank: the form a manifest carries."""
        return tuple((h.q_heads.start, h.q_heads.stop, h.kv_heads.start, h.kv_heads.stop) for h in self.ranks)

    @classmethod
    def from_tuples(cls, num_heads: int, num_kv_heads: int,
                    ranks: tuple[tuple[int, int, int, int], ...]) -> HeadPartition:
        """The inverse of as_tuples; ValueError unless it is `partition_heads`'s partition for that many ranks."""
        partition = cls(num_heads, num_kv_heads, tuple(RankHeads(range(a, b), range(c, d)) for a, b, c, d in ranks))
        if not ranks or partition != partition_heads(num_heads, num_kv_heads, len(ranks)):
            raise ValueError(f"head partition {ranks} is not the partition of {num_heads} query / {num_kv_heads} KV "
                             f"heads over {len(ranks)} ranks")
        return partition


def partition_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> HeadPartition:
    """The head partition of a model over `tp_size` ranks (module docstring). ValueError for an impossible one."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if not 1 <= tp_size <= num_heads:
        raise ValueError(f"tensor_parallel_size must be in [1, num_heads={num_heads}], got {tp_size}")
    group = num_heads // num_kv_heads
    ranks = []
    if tp_size <= num_kv_heads:
        for kv in split_range(num_kv_heads, tp_size):
            ranks.append(RankHeads(range(kv.start * group, kv.stop * group), kv))
    else:
        for g, group_ranks in enumerate(split_range(tp_size, num_kv_heads)):
            for q in split_range(group, len(group_ranks)):
                ranks.append(RankHeads(range(g * group + q.start, g * group + q.stop), range(g, g + 1)))
    return HeadPartition(num_heads, num_kv_heads, tuple(ranks))


def kv_head_ranges(num_kv_heads: int, tp_size: int) -> tuple[range, ...]:
    """The KV heads of each rank of `partition_heads(..., num_kv_heads, tp_size)`, whatever the query heads."""
    if num_kv_heads < 1 or tp_size < 1:
        raise ValueError(f"num_kv_heads and tp_size must be >= 1, got {num_kv_heads}, {tp_size}")
    if tp_size <= num_kv_heads:
        return split_range(num_kv_heads, tp_size)
    return tuple(range(g, g + 1) for g, group_ranks in enumerate(split_range(tp_size, num_kv_heads))
                 for _ in group_ranks)


def plan_kv_resharding(src_tp_size: int, dst_tp_size: int, num_kv_heads: int) -> KvReshardPlan:
    """The KV transfer plan from a worker at TP=`src_tp_size` to one at TP=`dst_tp_size` (module docstring)."""
    return plan_reshard(kv_head_ranges(num_kv_heads, src_tp_size), kv_head_ranges(num_kv_heads, dst_tp_size))
