"""The engine loop: requests in, one scheduled step at a time, token deltas out.

`LLMEngine.step()` schedules, runs the model once and returns what changed for each request. Workers drive
it from their service loop; the offline `LLM` drives it until every request finishes.

Ownership: every request the engine knows has one `BlockLease` (engine.block_lease) in `_leases` until it
is released; `abort` is the one way out for callers (queued, running, reserved, committed or held), and a
request whose own sampling or bookkeeping raises in a step is finished with FinishReason.ERROR and released
while the rest of the batch goes on (an error of the forward pass itself still raises from `step`).

Structured output: a request with `params.structured_output` has its grammar compiled by `self.grammars`
(engine.grammar) on the compiler's thread, never in a step. Until it is compiled the sequence is
`awaiting_grammar` and the scheduler passes it over; the first step after compilation attaches its matcher,
replayed over the tokens it already has (a first token sampled by a prefill worker). Each sampled token then
advances the matcher; a grammar that fails to compile fails its request alone. A forked choice (below) gets a
matcher of its own the same way.

n > 1 choices: the prompt is computed once. The sampling that ends it draws n first tokens (the runner, each
choice from its own seed); choices 1..n-1 then fork on the prompt's blocks (`_fork_choices`: full blocks shared
by reference count, the partial one copied) as sequences "<id>/<i>" with leases of their own, so each releases
its own references exactly once, whenever it ends. On a worker that only prefills (hold_blocks) nothing is
forked: the other first tokens wait in `seq.choice_first_tokens` for the decode worker, whose `start_reserved`
forks there. `abort(request_id)` ends every choice of the request; a StepOutput says when its request's last
choice finished (`request_finished`).
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.block_lease import BlockLease, LeaseState
from engine.errors import InvalidRequestError, OverloadedError, PreconditionError
from engine.grammar import GrammarCompiler
from engine.kv_cache_manager import KVCacheManager
from engine.loader import LoadedModel, load_model
from engine.model_fetch import resolve_model_path
from engine.model_runner import ModelRunner
from engine.quant import quantized_fingerprint
from engine.sampler import RowResult, choice_seed
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import FinishReason, PromptLogprob, Sequence, TokenLogprob
from kvstore.hashing import root_hash
from kvstore.malloc_tuning import keep_freed_memory_for_reuse

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
    tensor_parallel_size: int = 1
    kv_resharding_bytes: int = 0  # KV moved between the ranks for transfers since start (engine.parallel.ranks)
    decode_compile_seconds: float = 0.0  # start-up compile of the decode step (engine.compiled_step); 0: eager


@dataclass(frozen=True)
class StepRecord:
    """What the last step that ran the model computed (worker metrics read it after each step)."""

    num_prompt_tokens: int                # prompt tokens computed (prefix-cache hits and output tokens excluded)
    queue_times_s: tuple[float, ...]      # requests first scheduled in it: seconds since they were queued


@dataclass
class StepOutput:
    """What one step did for one sequence (a choice of its request): tokens appended (0 or 1), whether it is
    finished, and whether every choice of its request is (the same for n = 1)."""

    seq: Sequence
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finished: bool
    request_finished: bool = False
    prompt_logprobs: list[PromptLogprob] | None = None
    """With params.prompt_logprobs, on the step that produced the first output token: the whole prompt's
    (Sequence.prompt_logprobs)."""


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True, loaded: LoadedModel | None = None, *,
                 kv_cache_in_shm: bool = False, kv_digests: bool = False) -> None:
        """Load `config.model` (or take an already `loaded` model) and size the KV cache; `kv_cache_in_shm`: in a
        named shared-memory segment (engine.model_runner.ModelRunner, the prefill worker's same-host pushes);
        `kv_digests`: prefill steps take the digests of the blocks they finish (engine.kv_digests: what a prefill
        worker's pushes send)."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        if loaded is None:
            loaded = load_model(resolve_model_path(config.model), torch.float32, progress=progress,
                                keep_quantized=config.keep_quantized_weights)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.fingerprint = quantized_fingerprint(loaded.fingerprint, config.quantization)
        """Model fingerprint: the checkpoint's, distinct per quantization (it roots the block hashes)."""
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        self.runner = ModelRunner(loaded.config, loaded.weights, config, self.max_model_len,
                                  kv_cache_in_shm=kv_cache_in_shm, kv_digests=kv_digests)
        if self.runner.device.type == "cpu":
            keep_freed_memory_for_reuse()  # a large step's activations stay mapped for the next (kvstore.malloc_tuning)
        self.weight_memory_bytes = self.runner.model.weight_memory_bytes()
        """Bytes the loaded model's weights occupy (DecoderModel.weight_memory_bytes)."""
        self.file_tensor_bytes = loaded.file_tensor_bytes
        """Bytes of the checkpoint's tensor data as stored, None where the loader does not say."""
        stored = "" if self.file_tensor_bytes is None else f" (checkpoint tensors {self.file_tensor_bytes / 2**20:.1f} MiB)"
        log.info("model weights: %.1f MiB in memory%s", self.weight_memory_bytes / 2**20, stored)
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
                            self.max_model_len, config.long_prefill_token_threshold),
            self.kv, self.model_config.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        """Compiles and caches the structured-output grammars of this engine's requests."""
        self._pending_grammars: dict[str, tuple[Sequence, Future]] = {}
        """Requests whose grammar is compiling (or compiled, not yet attached), by id."""
        self._seed_rng = random.Random(config.seed)
        self._leases: dict[str, BlockLease] = {}
        """Every sequence not yet released, by id: its lease owns its blocks (engine.block_lease)."""
        self._choices: dict[str, list[str]] = {}
        """Request id -> the ids of its forked choices 1..n-1 (n > 1), until its last choice finishes."""
        self._num_open_choices: dict[str, int] = {}
        """Request id -> its choices not finished yet, from the fork on (n > 1)."""
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
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            raise InvalidRequestError("prompt_logprobs", "is not supported under tensor parallelism yet")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, seed: int | None = None, hold_blocks: bool = False) -> Sequence:
        """Queue a request. `seed` overrides params.seed (a gateway draws one so that two workers sample one
        stream); `hold_blocks` keeps its KV blocks after it finishes (lease HELD), until `abort`."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, cache_salt, seed)
        seq.hold_blocks = hold_blocks
        seq.queued_s = time.perf_counter()
        self.scheduler.add(seq)
        self._leases[request_id] = seq.lease
        self._start_grammar(seq)
        return seq

    def _new_sequence(self, request_id, prompt_token_ids, params, cache_salt, seed) -> Sequence:
        if request_id in self._leases:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        if seed is None:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        return Sequence(request_id, list(prompt_token_ids), params, seed, cache_salt,
                        num_choices_to_sample=params.n)

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
        self._start_grammar(seq)
        return seq

    def start_reserved(self, request_id: str, first_token_id: int | None = None,
                       first_logprob: TokenLogprob | None = None,
                       choice_first_tokens: list[tuple[int, TokenLogprob | None]] = ()) -> list[StepOutput]:
        """Start decoding a reservation. With `first_token_id`, the prompt's KV has been committed into its
        blocks (lease COMMITTED) and the first token sampled elsewhere (with `choice_first_tokens`, those of
        choices 1..n-1, which fork here); without, this worker computes the rest of the prompt itself (lease
        RESERVED). Raises PreconditionError when the lease is elsewhere, InvalidRequestError when the first
        tokens are not one per choice. Returns the finished StepOutputs of choices the first token already
        ends (no new tokens: the caller has them)."""
        lease = self._leases.get(request_id)
        want = LeaseState.RESERVED if first_token_id is None else LeaseState.COMMITTED
        if lease is None or lease.state is not want:
            state = "unknown (expired or aborted)" if lease is None else lease.state.value
            raise PreconditionError(f"request {request_id!r} cannot start decoding: its reservation is {state}, "
                                    f"expected {want.value}")
        seq = lease.seq
        if first_token_id is not None and len(choice_first_tokens) != seq.params.n - 1:
            raise InvalidRequestError("choice_first_token_ids", f"{len(choice_first_tokens)} first tokens of "
                                      f"other choices for a request of n={seq.params.n}")
        seq.queued_s = time.perf_counter()
        if first_token_id is None:
            self.scheduler.adopt(seq)
            return []
        seq.num_choices_to_sample = 1
        seq.num_computed_tokens = seq.num_prompt_tokens
        finished = [out for out in self._fork_choices(seq, list(choice_first_tokens)) if out.finished]
        for out in finished:
            out.new_token_ids, out.new_logprobs = [], []
        seq.output_token_ids.append(first_token_id)
        if first_logprob is not None:
            seq.output_logprobs.append(first_logprob)
        self.kv.cache_full_blocks(seq)
        reason = self.scheduler.stop_reason(seq)
        if reason is None:
            self.scheduler.adopt(seq)
            return finished
        self.scheduler.finish(seq, reason)
        del self._leases[request_id]
        return finished + [StepOutput(seq, [], [], True, self._choice_done(seq))]

    def _fork_choices(self, parent: Sequence, first_tokens: list[tuple[int, TokenLogprob | None]]) -> list[StepOutput]:
        """Choices 1..len(first_tokens) of `parent`'s request, each with its first token, forked on the blocks of
        `parent`'s computed prompt (before `parent` may finish and release them). A choice its first token
        ends takes no blocks; one that finds no free block for its copy waits to recompute its prompt."""
        if not first_tokens:
            return []
        self._num_open_choices[parent.request_id] = 1 + len(first_tokens)
        child_ids = self._choices[parent.request_id] = []
        outputs, copies = [], []
        for i, (token_id, logprob) in enumerate(first_tokens, start=1):
            child = Sequence(f"{parent.request_id}/{i}", parent.prompt_token_ids, parent.params,
                             choice_seed(parent.seed, i), parent.cache_salt, parent_id=parent.request_id,
                             choice_index=i, cacheable=parent.cacheable, num_cached_tokens=parent.num_cached_tokens,
                             queued_s=parent.queued_s, first_scheduled_s=parent.first_scheduled_s)
            child.output_token_ids.append(token_id)
            if logprob is not None:
                child.output_logprobs.append(logprob)
            child_ids.append(child.request_id)
            reason = self.scheduler.stop_reason(child)
            if reason is not None:
                child.lease = BlockLease(child, self.kv)
                self.scheduler.finish(child, reason)
            else:
                if self.kv.can_fork(parent):
                    copy = self.kv.fork(parent, child)
                    if copy is not None:
                        copies.append(copy)
                self.scheduler.add_choice(child)
                self._leases[child.request_id] = child.lease
                self._start_grammar(child)           # its own matcher, replayed over its first token
            outputs.append(StepOutput(child, [token_id], [logprob] if logprob is not None else [],
                                      reason is not None, reason is not None and self._choice_done(child)))
        if copies:
            self.runner.copy_blocks(copies)
        return outputs

    def _choice_done(self, seq: Sequence) -> bool:
        """One choice of `seq`'s request finished: whether it was the request's last one."""
        request_id = seq.group_id
        left = self._num_open_choices.get(request_id)
        if left is None:                         # n = 1, or choice 0 ended before its choices forked
            return True
        if left > 1:
            self._num_open_choices[request_id] = left - 1
            return False
        del self._num_open_choices[request_id]
        self._choices.pop(request_id, None)
        return True

    def _start_grammar(self, seq: Sequence) -> None:
        if seq.params.structured_output is not None:
            seq.awaiting_grammar = True
            self._pending_grammars[seq.request_id] = (seq, self.grammars.submit(seq.params.structured_output))

    def _attach_grammars(self) -> list[StepOutput]:
        """Attach the matchers of compiled grammars to their sequences once the scheduler holds them (queued
        or running); fail those whose grammar did not compile. Entries of released requests are dropped."""
        failed = []
        for request_id, (seq, future) in list(self._pending_grammars.items()):
            if seq.lease.released:
                del self._pending_grammars[request_id]
            elif future.done() and seq.lease.state in _SCHEDULED_STATES:
                del self._pending_grammars[request_id]
                try:
                    state = self.grammars.new_state(future.result())
                    state.sync(seq.output_token_ids)
                except Exception as exc:  # this request alone fails
                    failed.append(self._fail(seq, exc))
                    continue
                seq.grammar = state
                seq.awaiting_grammar = False
        return failed

    def get_lease(self, request_id: str) -> BlockLease | None:
        """The lease of a request not yet released (no side effects)."""
        return self._leases.get(request_id)

    def abort(self, request_id: str) -> bool:
        """Drop a request, every choice of it, wherever it is (queued, running, reserved, committed, held);
        returns whether it was here. Its blocks are released exactly once, by its leases. A pinned lease (a
        transfer or push uses the blocks) is only marked: the pin's holder releases it through here once it
        unpinned."""
        found = self._abort_sequence(request_id)
        for child_id in self._choices.pop(request_id, ()):
            found = self._abort_sequence(child_id) or found
        self._num_open_choices.pop(request_id, None)
        return found

    def _abort_sequence(self, request_id: str) -> bool:
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
        failed = self._attach_grammars() if self._pending_grammars else []
        out = self.scheduler.schedule()
        if not out.chunks:
            if self._pending_grammars:  # nothing else to run: give a compilation a moment instead of spinning
                wait([f for _, f in self._pending_grammars.values()], timeout=0.01, return_when=FIRST_COMPLETED)
            return failed
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
        results = failed
        for chunk in out.chunks:
            seq = chunk.seq
            rows = executed.rows.get(seq.request_id)
            row = rows[0] if rows else None
            forked: list[StepOutput] = []
            seq.prompt_logprobs.extend(executed.prompt_logprobs.get(seq.request_id, ()))
            try:
                for r in rows or ():
                    if r.error is not None:
                        raise r.error
                if row is not None and row.logprob is not None:
                    seq.output_logprobs.append(row.logprob)
                if rows is not None and seq.num_choices_to_sample > 1:
                    forked = self._first_tokens_of_choices(seq, rows[1:])
                done = self.scheduler.update(chunk, row.token_id if row is not None else None)
                if seq.grammar is not None and row is not None:
                    seq.grammar.sync(seq.output_token_ids)
            except Exception as exc:  # this request alone fails; the rest of the batch goes on
                results.append(self._fail(seq, exc))
                results.extend(forked)
                continue
            if row is None:
                continue
            if done and seq.lease.released:
                del self._leases[seq.request_id]
            first = seq.params.prompt_logprobs is not None and len(seq.output_token_ids) == 1
            results.append(StepOutput(seq, [row.token_id], [row.logprob] if row.logprob is not None else [], done,
                                      done and self._choice_done(seq), list(seq.prompt_logprobs) if first else None))
            results.extend(forked)
        return results

    def _first_tokens_of_choices(self, seq: Sequence, rows: list[RowResult]) -> list[StepOutput]:
        """The other choices' first tokens, drawn with `seq`'s: kept for the decode worker (hold_blocks), or
        forked here (the prompt is computed: this step sampled its last position)."""
        seq.num_choices_to_sample = 1
        first_tokens = [(r.token_id, r.logprob) for r in rows]
        if seq.hold_blocks:
            seq.choice_first_tokens = first_tokens
            return []
        return self._fork_choices(seq, first_tokens)

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
        return StepOutput(seq, [], [], True, self._choice_done(seq))

    def close(self) -> None:
        """End what the engine started besides this process (tensor-parallel ranks); it cannot step after."""
        self.runner.close()

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        states = [lease.state for lease in self._leases.values()]
        return EngineStats(
            num_blocks=pool.num_blocks, free_blocks=pool.get_num_free_blocks(), used_blocks=pool.get_num_used_blocks(),
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            reserved=sum(s in _RESERVED_STATES for s in states), held=sum(s in _HELD_STATES for s in states),
            preemptions=self.scheduler.num_preemptions, tensor_parallel_size=self.config.tensor_parallel_size,
            kv_resharding_bytes=self.runner.tp.num_kv_bytes_moved if self.runner.tp is not None else 0,
            decode_compile_seconds=self.runner.compiled.compile_seconds if self.runner.compiled is not None else 0.0)


_SCHEDULED_STATES = frozenset({LeaseState.QUEUED, LeaseState.RUNNING})
_RESERVED_STATES = frozenset({LeaseState.RESERVED, LeaseState.RECEIVING, LeaseState.COMMITTED})
_HELD_STATES = frozenset({LeaseState.HELD, LeaseState.PUSHING})


__all__ = ["EngineStats", "LLMEngine", "StepOutput", "StepRecord", "FinishReason"]
