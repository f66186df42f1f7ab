"""Iteration-level scheduler: continuous batching, chunked prefill, preemption by recompute.

Every step gets a token budget (`max_num_batched_tokens`). Running sequences are served first, in arrival
order: a decoding sequence takes 1 token, a sequence still prefilling takes the next chunk of its prompt.
Then waiting sequences join (FCFS) while budget, `max_num_seqs` and KV blocks allow; a prompt longer than
the remaining budget is split into chunks across steps; with `long_prefill_token_threshold` (> 0) no prompt
takes more than that many tokens of one step, so that a long prompt's chunks leave budget to the sequences
behind it (short prompts join at once instead of waiting for the whole long prefill; decodes share each step
with a bounded chunk). When a running sequence needs a block and none is
free, the most recently arrived running sequence is preempted: its lease frees its blocks and it goes back to the
front of the waiting queue, to be recomputed (prompt + tokens generated so far) when blocks are available
again. Nothing joins from the waiting queue in a step that preempted. A sequence whose structured-output
grammar is still compiling (`awaiting_grammar`) is passed over, in either queue, without holding up the others.
An EOS ends a constrained sequence even with ignore_eos: its grammar allows EOS only once it is complete.

Pure Python: no torch, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_lease import BlockLease, LeaseState
from engine.errors import OverloadedError
from engine.kv_cache_manager import KVCacheManager
from engine.sequence import FinishReason, Sequence, SequenceStatus


_QUEUED = frozenset({LeaseState.QUEUED})
_RUNNING = frozenset({LeaseState.RUNNING})
_ADOPTABLE = frozenset({LeaseState.RESERVED, LeaseState.COMMITTED})


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    """Most prompt tokens of one sequence in one step (0: up to the whole budget)."""


@dataclass
class ScheduledChunk:
    """`num_new_tokens` tokens of `seq`, starting at its `num_computed_tokens`, run this step."""

    seq: Sequence
    num_new_tokens: int
    samples: bool = field(init=False)
    """This chunk reaches the end of the sequence's tokens, so its last position yields the next token."""

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._num_arrivals = 0
        self.num_preemptions = 0
        """Preemptions since start (a metric: a high rate means the KV cache is too small for the load)."""

    # --- queue management -------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue `seq`; it gets the lease (engine.block_lease) that owns its blocks from now on."""
        if len(self.waiting) >= self.config.max_waiting:
            raise OverloadedError(f"waiting queue is full ({self.config.max_waiting} requests); retry later")
        assert seq.lease is None, "a sequence is queued once"
        seq.lease = BlockLease(seq, self.kv)
        seq.arrival_order = self._num_arrivals
        self._num_arrivals += 1
        self.waiting.append(seq)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """Finish `request_id` with `reason` (ABORT or ERROR) and free its blocks; None when it is not here."""
        assert reason in (FinishReason.ABORT, FinishReason.ERROR)
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.finish(seq, reason)
                    return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def adopt(self, seq: Sequence) -> None:
        """Run `seq`, which already holds blocks for its computed tokens (a reservation whose KV arrived, or
        whose prompt the decode worker prefills itself), from the next step on."""
        assert seq.block_ids and seq.num_computed_tokens < seq.num_tokens
        seq.lease.advance(LeaseState.RUNNING, expect=_ADOPTABLE)
        seq.arrival_order = self._num_arrivals
        self._num_arrivals += 1
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def add_choice(self, child: Sequence) -> None:
        """Take `child`, a choice forked from a sequence of this batch, with its first token: it runs from the
        next step when it holds its prompt's blocks (KVCacheManager.fork), else (no block was free for the
        fork) it goes to the front of the waiting queue to recompute its prompt, as a preempted sequence does."""
        assert child.lease is None and child.output_token_ids
        child.lease = BlockLease(child, self.kv)
        child.arrival_order = self._num_arrivals
        self._num_arrivals += 1
        if child.block_ids:
            child.lease.advance(LeaseState.RUNNING, expect=_QUEUED)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:
            self.waiting.appendleft(child)

    # --- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.awaiting_grammar:
                i += 1
                continue
            num_new = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.can_allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.kv.allocate(seq, num_new)
                out.chunks.append(ScheduledChunk(seq, num_new))
                budget -= num_new
                i += 1
        if out.preempted:
            if not self.running and not out.chunks:
                raise RuntimeError("a single sequence does not fit in the KV cache; capacity < max_model_len")
            return out

        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = next((s for s in self.waiting if not s.awaiting_grammar), None)
            if seq is None:
                break
            hit_block_ids = self.kv.get_computed_blocks(seq)
            num_computed = len(hit_block_ids) * self.kv.block_size
            num_new = self._chunk(seq.num_tokens - num_computed, budget)
            if not self.kv.can_allocate(seq, num_new, hit_block_ids):
                break
            self.kv.allocate(seq, num_new, hit_block_ids)
            seq.lease.advance(LeaseState.RUNNING, expect=_QUEUED)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_computed
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
        return out

    def update(self, chunk: ScheduledChunk, token_id: int | None) -> bool:
        """Advance one scheduled chunk by its step's result (`token_id` when the chunk `samples`); returns
        whether its sequence finished."""
        seq = chunk.seq
        seq.num_computed_tokens += chunk.num_new_tokens
        if chunk.samples:
            seq.output_token_ids.append(token_id)
        self.kv.cache_full_blocks(seq)
        reason = self.stop_reason(seq) if chunk.samples else None
        if reason is None:
            return False
        self.running.remove(seq)
        self.finish(seq, reason)
        return True

    # --- helpers ----------------------------------------------------------------------------------------------
    def _chunk(self, num_left: int, budget: int) -> int:
        """Tokens of a sequence with `num_left` to compute this step (1 for a decode)."""
        cap = self.config.long_prefill_token_threshold
        return min(num_left, budget, cap) if cap > 0 else min(num_left, budget)

    def stop_reason(self, seq: Sequence) -> FinishReason | None:
        """Why `seq` must stop after its last token, or None to go on."""
        token_id = seq.output_token_ids[-1]
        if token_id in seq.params.stop_token_ids:
            return FinishReason.STOP
        if token_id in self.eos_token_ids and (not seq.params.ignore_eos or seq.params.structured_output):
            return FinishReason.STOP
        if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _preempt(self, seq: Sequence) -> None:
        seq.lease.advance(LeaseState.QUEUED, expect=_RUNNING)  # frees the blocks
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End `seq`: its lease is released, or HELD for a push (hold_blocks, finished normally)."""
        if reason in (FinishReason.ABORT, FinishReason.ERROR) or not seq.hold_blocks:
            seq.lease.release()
        else:
            seq.lease.advance(LeaseState.HELD, expect=_RUNNING)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
