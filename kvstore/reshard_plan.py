"""Which KV heads a transfer carries from which sending rank, and which receiving rank takes them: the
re-sharding plan between two tensor-parallel degrees, as plain data (no torch).

Both ends are described by their ranks' KV heads (a tuple of contiguous `range`s, rank by rank; a head held by
several ranks is replicated there, engine.parallel.partition.kv_head_ranges gives the engine's partition).

Wire (`payload_slices`): every KV head crosses the wire exactly once, in the slice of the first sending rank that
holds it; a sending rank holding only replicas sends nothing. The payload is those slices in rank order, each
the blocks' records of its heads only (kvstore.transfer_slices), one digest per slice and block.

Receiving (`plan_reshard`): receiving rank r takes each head it owns from the payload slice that carries it;
one `KvSlice` is a contiguous run of heads from one sending rank to one receiving rank. A head several
receiving ranks own (replicated there) is on the wire once and copied to each of them on the receiving host.
So every head a receiving rank owns is covered exactly once, and the plan's bytes (`delivered_bytes`) are the
payload's bytes times the receiver's head copies over num_kv_heads.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["KvReshardPlan", "KvSlice", "KvWireSlice", "check_rank_heads", "payload_slices", "plan_reshard"]


@dataclass(frozen=True)
class KvWireSlice:
    """KV heads `kv_heads` (contiguous, global ids) on the wire, sent by sending rank `src_rank`."""

    src_rank: int
    kv_heads: range


@dataclass(frozen=True)
class KvSlice:
    """KV heads `kv_heads` (contiguous, global ids) go from sending rank `src_rank` to receiving rank `dst_rank`."""

    src_rank: int
    dst_rank: int
    kv_heads: range


def check_rank_heads(rank_heads: Sequence[range], num_kv_heads: int) -> None:
    """ValueError unless `rank_heads` are non-empty ranges inside [0, num_kv_heads) that together hold every head."""
    if not rank_heads:
        raise ValueError("no ranks")
    for rank, heads in enumerate(rank_heads):
        if heads.step != 1 or not 0 <= heads.start < heads.stop <= num_kv_heads:
            raise ValueError(f"rank {rank} holds heads [{heads.start}, {heads.stop}), not a non-empty range "
                             f"inside [0, {num_kv_heads})")
    missing = set(range(num_kv_heads)).difference(*map(set, rank_heads))
    if missing:
        raise ValueError(f"no rank holds KV heads {sorted(missing)}")


def payload_slices(src_kv_heads: Sequence[range]) -> tuple[KvWireSlice, ...]:
    """The payload's slices in order: each head from the first sending rank holding it (module docstring).
    `src_kv_heads` must pass check_rank_heads."""
    taken: set[int] = set()
    wire = []
    for rank, heads in enumerate(src_kv_heads):
        new = [h for h in heads if h not in taken]
        if new:
            if new != list(range(new[0], new[-1] + 1)):
                raise ValueError(f"rank {rank}'s first-held heads {new} are not contiguous")
            wire.append(KvWireSlice(rank, range(new[0], new[-1] + 1)))
            taken.update(new)
    return tuple(wire)


@dataclass(frozen=True)
class KvReshardPlan:
    """The moves of one p -> d KV transfer (module docstring)."""

    src_kv_heads: tuple[range, ...]
    dst_kv_heads: tuple[range, ...]
    wire: tuple[KvWireSlice, ...]
    slices: tuple[KvSlice, ...]

    @property
    def num_kv_heads(self) -> int:
        return sum(len(w.kv_heads) for w in self.wire)

    def slices_to(self, dst_rank: int) -> tuple[KvSlice, ...]:
        """What receiving rank `dst_rank` takes, in KV-head order."""
        return tuple(s for s in self.slices if s.dst_rank == dst_rank)

    def wire_slice(self, src_rank: int) -> KvWireSlice | None:
        """What sending rank `src_rank` puts on the wire (None: it holds only replicas)."""
        return next((w for w in self.wire if w.src_rank == src_rank), None)

    def heads_per_pair(self) -> dict[tuple[int, int], int]:
        """KV heads each (sending rank, receiving rank) pair moves (pairs that move nothing absent)."""
        pairs: dict[tuple[int, int], int] = {}
        for s in self.slices:
            pairs[s.src_rank, s.dst_rank] = pairs.get((s.src_rank, s.dst_rank), 0) + len(s.kv_heads)
        return pairs

    def delivered_bytes(self, payload_bytes: int) -> int:
        """Bytes the receiving ranks take for a payload of `payload_bytes` (every head once): more than the
        payload when the receiver replicates heads."""
        delivered = sum(len(s.kv_heads) for s in self.slices)
        return payload_bytes * delivered // self.num_kv_heads


def plan_reshard(src_kv_heads: Sequence[range], dst_kv_heads: Sequence[range]) -> KvReshardPlan:
    """The plan from a sender whose ranks hold `src_kv_heads` to a receiver whose ranks hold `dst_kv_heads`
    (module docstring). ValueError when either is not a partition of the same heads."""
    num_kv_heads = max(h.stop for h in src_kv_heads) if src_kv_heads else 0
    check_rank_heads(src_kv_heads, num_kv_heads)
    check_rank_heads(dst_kv_heads, num_kv_heads)
    wire = payload_slices(src_kv_heads)
    sender_of = {h: w.src_rank for w in wire for h in w.kv_heads}
    slices: list[KvSlice] = []
    for dst_rank, heads in enumerate(dst_kv_heads):
        for kv_head in heads:
            src_rank = sender_of[kv_head]
            last = slices[-1] if slices else None
            if last is not None and (last.src_rank, last.dst_rank) == (src_rank, dst_rank) \
                    and last.kv_heads.stop == kv_head:
                slices[-1] = KvSlice(src_rank, dst_rank, range(last.kv_heads.start, kv_head + 1))
            else:
                slices.append(KvSlice(src_rank, dst_rank, range(kv_head, kv_head + 1)))
    return KvReshardPlan(tuple(src_kv_heads), tuple(dst_kv_heads), wire, tuple(slices))
