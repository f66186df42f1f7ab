"""Runs one scheduled step: builds the flat batch and its attention metadata, runs the model, samples.

Owns the device state of a worker: the model's weights and the paged KV cache tensor
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` (K at index 0, V at 1). Under tensor
parallelism (EngineConfig.tensor_parallel_size > 1) it is rank 0: its model and cache hold rank 0's slice and
`tp` runs every step on the other ranks too (engine.parallel).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field

import torch

from engine.compiled_step import CompiledDecodeStep, compile_unsupported_reason
from engine.config import EngineConfig, ModelConfig
from engine.kv_digests import StepDigests, finished_blocks
from engine.model import LlamaModel
from engine.parallel.ranks import TensorParallelGroup
from engine.parallel.shard import build_rank_model, rank_shards, shard_config
from engine.sampler import RowResult, SamplingRow, choice_seed, sample_rows
from engine.scheduler import SchedulerOutput
from engine.sequence import PromptLogprob, Sequence
from engine.step_batch import StepBatch, copy_blocks, run_step
from kvstore.malloc_tuning import zeros_on_huge_pages
from kvstore.shm_cache import SharedKvCache

log = logging.getLogger(__name__)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_kv_blocks_for(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                      device: torch.device) -> int:
    """Blocks that fit the configured KV budget (see EngineConfig.kv_cache_memory*)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_memory
    if budget is None:
        budget = int(free_device_memory(device) * config.kv_cache_memory_fraction)
    bytes_per_block = model_config.kv_bytes_per_token(dtype.itemsize) * config.block_size
    return budget // bytes_per_block


@dataclass
class RunnerOutput:
    """What one step computed: per sampling chunk's request id its RowResults (one per choice sampled), and per
    request that asked for prompt logprobs the ones of the prompt positions this step computed (in order, after
    those it has)."""

    rows: dict[str, list[RowResult]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PromptLogprob]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, weights: dict[str, torch.Tensor], config: EngineConfig,
                 max_model_len: int, *, kv_cache_in_shm: bool = False, kv_digests: bool = False) -> None:
        """`kv_cache_in_shm`: allocate the KV cache over a named shared-memory segment (kvstore.shm_cache; CPU,
        one rank), so that a decode worker on the same host copies pushed blocks straight out of it. Where
        /dev/shm cannot hold it, under tensor parallelism or on CUDA it stays private, with a warning.
        `kv_digests`: prefill steps take the digests of the blocks they finish (CPU, one rank; engine.kv_digests)."""
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype)
        """What the KV cache stores (EngineConfig.kv_cache_dtype): the compute dtype, or bfloat16 under float32."""
        self.block_size = config.block_size
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        c = model_config
        self.tp: TensorParallelGroup | None = None
        """Ranks 1..N-1 when config.tensor_parallel_size > 1 (engine.parallel.ranks); this process is rank 0."""
        local = c
        if config.tensor_parallel_size > 1:
            shards = rank_shards(c, config.tensor_parallel_size, config.quantization)
            # Every rank has the same blocks: size them for the rank with the most KV heads.
            largest = max(shards, key=lambda s: len(s.heads.kv_heads))
            self.num_blocks = num_kv_blocks_for(config, shard_config(c, largest), self.kv_dtype, self.device)
            self.tp = TensorParallelGroup.start(config, c, weights, shards, max_model_len, self.num_blocks,
                                                self.dtype)
            try:
                self.model = build_rank_model(c, weights, self.dtype, self.device, max_model_len,
                                              config.quantization, shards, 0, self.tp.group)
                self.tp.wait_ready()
            except BaseException:
                self.tp.close()
                raise
            local = shard_config(c, shards[0])
        else:
            self.model = LlamaModel(c, weights, self.dtype, self.device, max_position=max_model_len,
                                    quantization=config.quantization, cpu_matmul=config.cpu_matmul)
            self.num_blocks = num_kv_blocks_for(config, c, self.kv_dtype, self.device)
        bytes_per_token = local.kv_bytes_per_token(self.kv_dtype.itemsize)
        log.info("KV cache: %d bytes/token (%s%s), %d blocks of %d tokens = %d tokens, %.1f MiB",
                 bytes_per_token, str(self.kv_dtype).removeprefix("torch."),
                 f", rank 0 of {config.tensor_parallel_size}" if self.tp else "", self.num_blocks, self.block_size,
                 self.num_blocks * self.block_size, self.num_blocks * self.block_size * bytes_per_token / 2**20)
        # Zeroed, not empty: attention masks the slots past a sequence's length, but a masked slot still enters
        # the P @ V product with weight 0, and 0 * NaN is NaN. Recycled memory can hold NaN bit patterns;
        # after this every slot only ever holds K/V values.
        shape = (c.num_layers, 2, self.num_blocks, self.block_size, local.num_kv_heads, c.head_dim)
        self.kv_segment = self._shared_kv_cache(shape) if kv_cache_in_shm else None
        """The shared-memory segment the cache lives in (kv_cache_in_shm), or None."""
        self.kv_digests = kv_digests and self.tp is None and self.device.type == "cpu"
        """Whether prefill steps take the digests of the blocks they finish as they write them (engine.kv_digests:
        Sequence.kv_digests, what a prefill worker's push sends in its trailer)."""
        self.kv_cache = (self.kv_segment.tensor if self.kv_segment is not None
                         else zeros_on_huge_pages(shape, self.kv_dtype) if self.device.type == "cpu"
                         else torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
        """This rank's heads: [L, 2, blocks, block_size, kv_heads of rank 0, D] (all of them without TP); on CPU
        on transparent huge pages where the kernel gives them (kvstore.malloc_tuning.zeros_on_huge_pages)."""
        self.compiled: CompiledDecodeStep | None = None
        """The compiled decode step (EngineConfig.compile_decode), compiled here at start-up, or None."""
        if config.compile_decode:
            reason = ("tensor parallelism" if self.tp is not None
                      else compile_unsupported_reason(self.model))
            if reason is not None:
                log.warning("compile_decode is off for this worker: %s (decode steps run eager)", reason)
            else:
                sizes = tuple(n for n in config.compile_batch_sizes if n <= config.max_num_seqs) or (1,)
                self.compiled = CompiledDecodeStep(self.model, self.kv_cache, sizes, max_model_len)
                self.compiled.warm_up()

    def _shared_kv_cache(self, shape: tuple[int, ...]) -> SharedKvCache | None:
        if self.tp is not None or self.device.type != "cpu":
            log.warning("kv_cache_in_shm is off for this worker: %s (KV pushes use the pooled segments)",
                        "tensor parallelism" if self.tp is not None else f"device {self.device}")
            return None
        try:
            segment = SharedKvCache(shape, self.kv_dtype)  # zeroed, like the private cache
        except OSError as exc:
            log.warning("KV cache not in shared memory (%s): KV pushes use the pooled segments", exc)
            return None
        log.info("KV cache in shared-memory segment %s (zero-copy same-host pushes)", segment.name)
        return segment

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks, every layer, source -> destination (a forked choice's partial prompt block), on
        every rank."""
        if self.tp is not None:
            self.tp.copy_blocks(self.kv_cache, pairs)
        else:
            copy_blocks(self.kv_cache, pairs)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run `out`'s chunks; returns, per sampling chunk's request id, its token (and logprob when asked) or
        the error that failed that request alone: one result per choice the chunk samples (n first tokens of
        an n > 1 request from the same logits, choice i with choice_seed(seed, i)), else one; and the prompt
        logprobs computed. An error of the forward pass itself raises (whole batch); under tensor parallelism a
        failed rank raises TensorParallelError."""
        batch = StepBatch([], [], [], [], [], [0], [])
        sampling: list[SamplingRow] = []
        prompt_ids: list[str] = []                   # the request id of each of batch.prompt_rows
        finished: list[tuple[Sequence, int]] = []    # (sequence, block id) of the blocks whose digests are taken
        bs = self.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + chunk.num_new_tokens
            if self.kv_digests and start < seq.num_prompt_tokens:
                finished += [(seq, seq.block_ids[j]) for j in finished_blocks(seq, start, end, bs)]
            batch.input_ids.extend(seq.token_ids[start:end])
            batch.positions.extend(range(start, end))
            batch.slot_mapping.extend(seq.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            batch.seq_lens.append(end)
            if seq.params.prompt_logprobs is not None:
                # Positions already scored are skipped: a preempted request recomputes its prompt.
                first, last = max(start, len(seq.prompt_logprobs)), min(end, seq.num_prompt_tokens - 1)
                if first < last:
                    assert first == len(seq.prompt_logprobs), "prompt positions are scored without a gap"
                    rows = [batch.query_start_loc[-1] + p - start for p in range(first, last)]
                    batch.prompt_rows.append((rows, seq.prompt_token_ids[first + 1:last + 1],
                                              seq.params.prompt_logprobs))
                    prompt_ids.append(seq.request_id)
            batch.query_start_loc.append(batch.query_start_loc[-1] + chunk.num_new_tokens)
            if chunk.samples:
                for choice in range(seq.num_choices_to_sample):
                    batch.sample_positions.append(batch.query_start_loc[-1] - 1)
                    sampling.append(SamplingRow(seq.params, choice_seed(seq.seed, choice), seq.prompt_token_ids,
                                                seq.output_token_ids, seq.request_id, seq.grammar,
                                                eos_token_ids=self.eos_token_ids))
        max_blocks = max(len(c.seq.block_ids) for c in out.chunks)
        batch.block_tables = [c.seq.block_ids + [0] * (max_blocks - len(c.seq.block_ids)) for c in out.chunks]
        if self.tp is not None:
            logits, prompt_logprobs = self.tp.run_step(self.model, self.kv_cache, batch, self.device)
        elif self.compiled is not None and self.compiled.takes(batch):
            logits, prompt_logprobs = self.compiled.run(batch), []
        else:
            digests = StepDigests.build(self.kv_cache, finished)
            with digests or contextlib.nullcontext():
                logits, prompt_logprobs = run_step(self.model, self.kv_cache, batch, self.device,
                                                   digests.after_kv_write if digests else None)
        result = RunnerOutput(prompt_logprobs=dict(zip(prompt_ids, prompt_logprobs)))
        if logits is not None:  # logits: [num_sampling, vocab], inference tensor
            for row, r in zip(sampling, sample_rows(logits, sampling)):
                result.rows.setdefault(row.request_id, []).append(r)
        return result

    # --- KV transfer: every KV head on the wire once, whatever this worker's tensor-parallel degree -------------
    def transfer_cache(self) -> torch.Tensor:
        """The cache a KV transfer sees: [L, 2, blocks, block_size, num_kv_heads (all), D]. Without tensor
        parallelism the cache itself; with it a meta tensor of that shape (no memory): the blocks are gathered
        from and written to the ranks by `blocks_to_send` and `write_received`."""
        if self.tp is None:
            return self.kv_cache
        c = self.tp.shards[-1].heads
        shape = (*self.kv_cache.shape[:4], c.kv_heads.stop, self.kv_cache.shape[5])
        return torch.empty(shape, dtype=self.kv_cache.dtype, device="meta")

    def blocks_to_send(self, block_ids: list[int]):
        """(source, ids) holding `block_ids` for kvstore.kv_sender.KvSender.push: the cache itself, or
        the payload's slices gathered from the ranks (kvstore.transfer_slices.KvSlices; then ids 0..n-1)."""
        if self.tp is None:
            return self.kv_cache, block_ids
        return self.tp.gather_kv(self.kv_cache, block_ids), list(range(len(block_ids)))

    def rank_kv_heads(self) -> tuple[range, ...]:
        """Each rank's KV heads; () without tensor parallelism (one cache of every head)."""
        return () if self.tp is None else self.tp.rank_kv_heads

    def write_received(self, plan, slices, block_ids) -> None:
        """Write a received payload's slices into `block_ids` of every rank's cache as the re-sharding plan
        (kvstore.reshard_plan.KvReshardPlan) says: each rank its own heads."""
        self.tp.scatter_kv(self.kv_cache, list(block_ids), plan, slices)

    def close(self) -> None:
        """End the tensor-parallel ranks and unlink the shared-memory KV cache (if any); the runner cannot step
        after."""
        if self.tp is not None:
            self.tp.close()
        if self.kv_segment is not None:  # the name goes; the pages stay mapped until this process exits
            self.kv_segment.close()
