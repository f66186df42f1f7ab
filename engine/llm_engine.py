"""The engine loop: requests in, one scheduled step at a time, token deltas out.

`LLMEngine.step()` schedules, runs the model once and returns what changed for each request. Workers drive
it from their service loop; the offline `LLM` drives it until every request finishes.

Ownership: every request the engine knows has one `BlockLease` (engine.block_lease) in `_leases` until it
is released; `abort` is the one way out for callers (queued, running, reserved, committed or held), and a
request whose own sampling or bookkeeping raises in a step is finished with FinishReason.ERROR and released
while the rest of the batch goes on (an error of the forward pass itself still raises from `step`).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.block_lease import BlockLease, LeaseState
from engine.errors import InvalidRequestError, OverloadedError, PreconditionError
from engine.kv_cache_manager import KVCacheManager
from engine.loader import LoadedModel, load_model
from engine.model_fetch import resolve_model_path
from engine.model_runner import ModelRunner
from engine.quant import quantized_fingerprint
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import FinishReason, PromptLogprob, Sequence, TokenLogprob
from kvstore.hashing import root_hash

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load and KV accounting (what a worker's Stats RPC and registration report)."""

    num_blocks: int
    free_blocks: int      # ref_count 0, cached-but-evictable included
    used_blocks: int
    running: int
    waiting: int
    reserved: int         # leases RESERVED, RECEIVING or COMMITTED (decode side)
    held: int             # leases HELD or PUSHING (prefill side)
    preemptions: int      # since start


@dataclass(frozen=True)
class StepRecord:
    """What the last step that ran the model computed (worker metrics read it after each step)."""

    num_prompt_tokens: int                # prompt tokens computed (prefix-cache hits and output tokens excluded)
    queue_times_s: tuple[float, ...]      # requests first scheduled in it: seconds since they were queued


@dataclass
class StepOutput:
    """What one step did for one request: tokens appended (0 or 1) and whether it is finished."""

    seq: Sequence
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finished: bool
    prompt_logprobs: list[PromptLogprob] | None = None
    """With params.prompt_logprobs, on the step that produced the first output token: the whole prompt's
    (Sequence.prompt_logprobs)."""


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True, loaded: LoadedModel | None = None) -> None:
        """Load `config.model` (or take an already `loaded` model) and size the KV cache."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        if loaded is None:
            loaded = load_model(resolve_model_path(config.model), torch.float32, progress=progress)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.fingerprint = quantized_fingerprint(loaded.fingerprint, config.quantization)
        """Model fingerprint: the checkpoint's, distinct per quantization (it roots the block hashes)."""
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        self.runner = ModelRunner(loaded.config, loaded.weights, config, self.max_model_len)
        del loaded
        capacity = self.runner.num_blocks * config.block_size
        if capacity < self.max_model_len:
            if config.max_model_len is not None:
                raise ValueError(f"KV cache holds {capacity} tokens, fewer than max_model_len={self.max_model_len}: "
                                 "raise kv_cache_memory or lower max_model_len")
            log.warning("KV cache holds %d tokens: max_model_len lowered from %d to fit", capacity,
                        self.max_model_len)
            self.max_model_len = capacity
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, root_hash(self.fingerprint),
                                 config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.max_waiting,
                            self.max_model_len),
            self.kv, self.model_config.eos_token_ids)
        self._seed_rng = random.Random(config.seed)
        self._leases: dict[str, BlockLease] = {}
        """Every request not yet released, by id: its lease owns its blocks (engine.block_lease)."""
        self.num_steps = 0
        """Steps that ran the model (a step with nothing schedulable does not count)."""
        self.last_step: StepRecord | None = None
        """The latest of those steps (no side effects to read)."""

    # --- requests ---------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.model_config.vocab_size
        for token_id in prompt_token_ids:
            if not 0 <= token_id < vocab:
                raise InvalidRequestError("prompt_token_ids", f"{token_id} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"has {len(prompt_token_ids)} tokens; the context holds {self.max_model_len} "
                          "(prompt plus at least one generated token)")
        params.validate(vocab)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, seed: int | None = None, hold_blocks: bool = False) -> Sequence:
        """Queue a request. `seed` overrides params.seed (a gateway draws one so that two workers sample one
        stream); `hold_blocks` keeps its KV blocks after it finishes (lease HELD), until `abort`."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, cache_salt, seed)
        seq.hold_blocks = hold_blocks
        seq.queued_s = time.perf_counter()
        self.scheduler.add(seq)
        self._leases[request_id] = seq.lease
        return seq

    def _new_sequence(self, request_id, prompt_token_ids, params, cache_salt, seed) -> Sequence:
        if request_id in self._leases:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        if seed is None:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        return Sequence(request_id, list(prompt_token_ids), params, seed, cache_salt)

    # --- disaggregation: reservations (decode side) and held blocks (prefill side) ------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                cache_salt: str | None = None, seed: int | None = None) -> Sequence:
        """Allocate blocks for a whole prompt whose KV another worker computes, reusing this worker's own
        cached prefix. The sequence holds `block_ids`; the first `num_computed_tokens // block_size` of them
        were cache hits and need no transfer. Raises OverloadedError when the blocks are not there."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, cache_salt, seed)
        hit_block_ids = self.kv.get_computed_blocks(seq)
        num_new = seq.num_tokens - len(hit_block_ids) * self.kv.block_size
        if not self.kv.can_allocate(seq, num_new, hit_block_ids):
            raise OverloadedError(f"no room for {seq.num_tokens} prompt tokens in the KV cache")
        seq.lease = BlockLease(seq, self.kv, LeaseState.RESERVED)
        self.kv.allocate(seq, num_new, hit_block_ids)
        seq.num_cached_tokens = seq.num_computed_tokens
        self._leases[request_id] = seq.lease
        return seq

    def start_reserved(self, request_id: str, first_token_id: int | None = None,
                       first_logprob: TokenLogprob | None = None) -> StepOutput | None:
        """Start decoding a reservation. With `first_token_id`, the prompt's KV has been committed into its
        blocks (lease COMMITTED) and the first token sampled elsewhere; without, this worker computes the rest
        of the prompt itself (lease RESERVED). Raises PreconditionError when the lease is elsewhere. Returns
        the finished StepOutput when the first token already ends the request, else None."""
        lease = self._leases.get(request_id)
        want = LeaseState.RESERVED if first_token_id is None else LeaseState.COMMITTED
        if lease is None or lease.state is not want:
            state = "unknown (expired or aborted)" if lease is None else lease.state.value
            raise PreconditionError(f"request {request_id!r} cannot start decoding: its reservation is {state}, "
                                    f"expected {want.value}")
        seq = lease.seq
        seq.queued_s = time.perf_counter()
        if first_token_id is None:
            self.scheduler.adopt(seq)
            return None
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.output_token_ids.append(first_token_id)
        if first_logprob is not None:
            seq.output_logprobs.append(first_logprob)
        self.kv.cache_full_blocks(seq)
        reason = self.scheduler.stop_reason(seq)
        if reason is None:
            self.scheduler.adopt(seq)
            return None
        self.scheduler.finish(seq, reason)
        del self._leases[request_id]
        return StepOutput(seq, [], [], True)

    def get_lease(self, request_id: str) -> BlockLease | None:
        """The lease of a request not yet released (no side effects)."""
        return self._leases.get(request_id)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (queued, running, reserved, committed, held); returns whether it was
        here. Its blocks are released exactly once, by its lease. A pinned lease (a transfer or push uses the
        blocks) is only marked: the pin's holder releases it through here once it unpinned."""
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        if lease.state in (LeaseState.QUEUED, LeaseState.RUNNING):
            self.scheduler.abort(request_id)
        elif not lease.request_release():
            return True
        assert lease.released
        del self._leases[request_id]
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step ---------------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        out = self.scheduler.schedule()
        if not out.chunks:
            return []
        self.num_steps += 1
        started = time.perf_counter()
        queue_times = []
        for chunk in out.chunks:
            if chunk.seq.first_scheduled_s is None:
                chunk.seq.first_scheduled_s = started
                if chunk.seq.queued_s is not None:
                    queue_times.append(started - chunk.seq.queued_s)
        num_prompt = sum(max(0, min(c.seq.num_computed_tokens + c.num_new_tokens, c.seq.num_prompt_tokens)
                                - c.seq.num_computed_tokens) for c in out.chunks)
        self.last_step = StepRecord(num_prompt, tuple(queue_times))
        executed = self.runner.execute(out)
        results = []
        for chunk in out.chunks:
            seq = chunk.seq
            row = executed.rows.get(seq.request_id)
            seq.prompt_logprobs.extend(executed.prompt_logprobs.get(seq.request_id, ()))
            try:
                if row is not None and row.error is not None:
                    raise row.error
                if row is not None and row.logprob is not None:
                    seq.output_logprobs.append(row.logprob)
                done = self.scheduler.update(chunk, row.token_id if row is not None else None)
            except Exception as exc:  # this request alone fails; the rest of the batch goes on
                results.append(self._fail(seq, exc))
                continue
            if row is None:
                continue
            if done and seq.lease.released:
                del self._leases[seq.request_id]
            first = seq.params.prompt_logprobs is not None and len(seq.output_token_ids) == 1
            results.append(StepOutput(seq, [row.token_id], [row.logprob] if row.logprob is not None else [], done,
                                      list(seq.prompt_logprobs) if first else None))
        return results

    def _fail(self, seq: Sequence, exc: Exception) -> StepOutput:
        log.warning("request %s failed in its step and was dropped: %s: %s", seq.request_id,
                    type(exc).__name__, exc)
        seq.error = f"{type(exc).__name__}: {exc}"
        if not seq.is_finished:
            self.scheduler.abort(seq.request_id, FinishReason.ERROR)
        else:                                   # finished (maybe HELD) before the error: still fail it
            seq.finish_reason = FinishReason.ERROR
            if not seq.lease.released:
                seq.lease.request_release()
        if seq.lease.released:
            self._leases.pop(seq.request_id, None)
        return StepOutput(seq, [], [], True)

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        states = [lease.state for lease in self._leases.values()]
        return EngineStats(
            num_blocks=pool.num_blocks, free_blocks=pool.get_num_free_blocks(), used_blocks=pool.get_num_used_blocks(),
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            reserved=sum(s in _RESERVED_STATES for s in states), held=sum(s in _HELD_STATES for s in states),
            preemptions=self.scheduler.num_preemptions)


_RESERVED_STATES = frozenset({LeaseState.RESERVED, LeaseState.RECEIVING, LeaseState.COMMITTED})
_HELD_STATES = frozenset({LeaseState.HELD, LeaseState.PUSHING})


__all__ = ["EngineStats", "LLMEngine", "StepOutput", "StepRecord", "FinishReason"]
