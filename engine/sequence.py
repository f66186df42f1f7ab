"""One request's state inside the engine: tokens, KV blocks, progress and outcome.

Pure data; the scheduler and the KV cache manager move it between states:

    WAITING --schedule--> RUNNING --finish/abort--> FINISHED
       ^                      |
       +------ preempt -------+   (blocks freed, num_computed_tokens reset: recomputed when rescheduled)

A request with n > 1 choices is one Sequence until its first sampling, which draws n first tokens from the
prompt's logits; choices 1..n-1 then become Sequences of their own (`parent_id`, `choice_index`), forked on the
prompt's blocks (KVCacheManager.fork), each with its own lease.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.block_lease import BlockLease
    from engine.grammar import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"          # an end-of-sequence or stop token
    LENGTH = "length"      # max_tokens or the context length reached
    ABORT = "abort"        # cancelled by the caller
    ERROR = "error"        # failed inside the engine (e.g. its sampling raised); the batch went on


@dataclass
class TokenLogprob:
    """Log-probability of a sampled token and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class PromptLogprob(TokenLogprob):
    """Log-probability of a prompt token given the tokens before it, its rank (1 = the most likely token) and
    the top alternatives at its position."""

    rank: int = 1


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    """Seed of the request's random stream (the request's own, or one the engine drew)."""
    cache_salt: str | None = None
    arrival_order: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    """With params.prompt_logprobs: entry i is prompt token i + 1's (the first token has none); filled as the
    prompt's chunks are computed, complete when the first output token is sampled."""
    block_ids: list[int] = field(default_factory=list)
    """KV blocks in logical order; block i holds tokens [i*block_size, (i+1)*block_size)."""
    block_hashes: list[int] = field(default_factory=list)
    """Chained hashes of the full blocks of token_ids computed so far (prefix caching keys)."""
    kv_digests: dict[int, bytes] = field(default_factory=dict)
    """Block id -> xxh3-128 digest of the block's KV record, taken as the step that finished it wrote it
    (engine.kv_digests; a runner with kv_digests on); cleared with the blocks."""
    num_registered_blocks: int = 0
    """Leading blocks already offered to the prefix cache (each block is offered once)."""
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache (the rest are computed by the next scheduled chunks)."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when the request was first scheduled."""
    queued_s: float | None = None
    """time.perf_counter() when it was queued (add_request) or joined the batch from a reservation
    (start_reserved); its queue time runs from here to first_scheduled_s."""
    first_scheduled_s: float | None = None
    """time.perf_counter() when a step first computed part of it (what came before was queueing)."""
    num_preemptions: int = 0
    hold_blocks: bool = False
    """Keep the KV blocks when the sequence finishes (a prefill worker still has to send them): its lease goes
    HELD until LLMEngine.abort releases it. An aborted or failed sequence always frees its blocks."""
    cacheable: bool = True
    """Whether its blocks may enter the prefix cache. False for KV received from a sender the decode worker
    does not trust (and everything computed on top of it)."""
    lease: BlockLease | None = field(default=None, repr=False, compare=False)
    """The one owner of `block_ids` (engine.block_lease); set when the engine first takes the request."""
    grammar: GrammarState | None = field(default=None, repr=False, compare=False)
    """The structured-output matcher (params.structured_output set), attached once its grammar compiled."""
    awaiting_grammar: bool = False
    """Its grammar is still compiling: the scheduler leaves it out of steps until the engine attaches it."""
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    """Why the request failed (finish_reason ERROR), for the caller's status message."""
    parent_id: str | None = None
    """The request id of choice 0 when this sequence is another choice of that request (n > 1)."""
    choice_index: int = 0
    """Which choice of its request this sequence is (0 for the request's own sequence)."""
    num_choices_to_sample: int = 1
    """First tokens the next sampling of this sequence draws: params.n until its first token is sampled (each
    from its choice's seed), then 1."""
    choice_first_tokens: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)
    """First tokens of choices 1..n-1 when they are not forked here (a prefill worker hands them on)."""

    @property
    def group_id(self) -> str:
        """The request this sequence belongs to (its own id, or its choice 0's)."""
        return self.parent_id or self.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]
