"""Runs one scheduled step: builds the flat batch and its attention metadata, runs the model, samples.

Owns the device state of a worker: the model's weights and the paged KV cache tensor
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` (K at index 0, V at 1). Under tensor
parallelism (EngineConfig.tensor_parallel_size > 1) it is rank 0: its model and cache hold rank 0's slice and
`tp` runs every step on the other ranks too (engine.parallel).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from engine.config import EngineConfig, ModelConfig
from engine.model import LlamaModel
from engine.parallel.ranks import TensorParallelGroup
from engine.parallel.shard import build_rank_model, rank_shards
from engine.sampler import RowResult, SamplingRow, sample_rows
from engine.scheduler import SchedulerOutput
from engine.step_batch import StepBatch, run_step

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


class ModelRunner:
    def __init__(self, model_config: ModelConfig, weights: dict[str, torch.Tensor], config: EngineConfig,
                 max_model_len: int) -> None:
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        c = model_config
        self.tp: TensorParallelGroup | None = None
        """Ranks 1..N-1 when config.tensor_parallel_size > 1 (engine.parallel.ranks); this process is rank 0."""
        num_kv_heads = c.num_kv_heads
        if config.tensor_parallel_size > 1:
            shards = rank_shards(c, config.tensor_parallel_size, config.quantization)
            # Every rank has the same blocks: size them for the rank with the most KV heads.
            num_kv_heads = max(len(s.heads.kv_heads) for s in shards)
            self.num_blocks = num_kv_blocks_for(config, replace(c, num_kv_heads=num_kv_heads), self.dtype,
                                                self.device)
            self.tp = TensorParallelGroup.start(config, c, weights, shards, max_model_len, self.num_blocks,
                                                self.dtype)
            try:
                self.model = build_rank_model(c, weights, self.dtype, self.device, max_model_len,
                                              config.quantization, shards, 0, self.tp.group)
                self.tp.wait_ready()
            except BaseException:
                self.tp.close()
                raise
            num_kv_heads = len(shards[0].heads.kv_heads)
        else:
            self.model = LlamaModel(c, weights, self.dtype, self.device, max_position=max_model_len,
                                    quantization=config.quantization)
            self.num_blocks = num_kv_blocks_for(config, c, self.dtype, self.device)
        bytes_per_token = replace(c, num_kv_heads=num_kv_heads).kv_bytes_per_token(self.dtype.itemsize)
        log.info("KV cache: %d bytes/token (%s%s), %d blocks of %d tokens = %d tokens, %.1f MiB",
                 bytes_per_token, str(self.dtype).removeprefix("torch."),
                 f", rank 0 of {config.tensor_parallel_size}" if self.tp else "", self.num_blocks, self.block_size,
                 self.num_blocks * self.block_size, self.num_blocks * self.block_size * bytes_per_token / 2**20)
        # Zeroed, not empty: attention masks the slots past a sequence's length, but a masked slot still enters
        # the P @ V product with weight 0, and 0 * NaN is NaN. Recycled memory can hold NaN bit patterns;
        # after this every slot only ever holds K/V values.
        self.kv_cache = torch.zeros(c.num_layers, 2, self.num_blocks, self.block_size, num_kv_heads,
                                    c.head_dim, dtype=self.dtype, device=self.device)
        """This rank's heads: [L, 2, blocks, block_size, kv_heads of rank 0, D] (all of them without TP)."""

    def execute(self, out: SchedulerOutput) -> dict[str, RowResult]:
        """Run `out`'s chunks; returns, per sampling chunk's request id, its token (and logprob when asked) or
        the error that failed that request alone. An error of the forward pass itself raises (whole batch);
        under tensor parallelism a failed rank raises TensorParallelError."""
        batch = StepBatch([], [], [], [], [], [0], [])
        sampling: list[SamplingRow] = []
        bs = self.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + chunk.num_new_tokens
            batch.input_ids.extend(seq.token_ids[start:end])
            batch.positions.extend(range(start, end))
            batch.slot_mapping.extend(seq.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            batch.seq_lens.append(end)
            batch.query_start_loc.append(batch.query_start_loc[-1] + chunk.num_new_tokens)
            if chunk.samples:
                batch.sample_positions.append(batch.query_start_loc[-1] - 1)
                sampling.append(SamplingRow(seq.params, seq.seed, seq.prompt_token_ids, seq.output_token_ids,
                                            seq.request_id))
        max_blocks = max(len(c.seq.block_ids) for c in out.chunks)
        batch.block_tables = [c.seq.block_ids + [0] * (max_blocks - len(c.seq.block_ids)) for c in out.chunks]
        if self.tp is not None:
            logits = self.tp.run_step(self.model, self.kv_cache, batch, self.device)
        else:
            logits = run_step(self.model, self.kv_cache, batch, self.device)
        if logits is None:
            return {}
        # logits: [num_sampling, vocab], inference tensor
        return {row.request_id: result for row, result in zip(sampling, sample_rows(logits, sampling))}

    def close(self) -> None:
        """End the tensor-parallel ranks (nothing to do without them); the runner cannot step after."""
        if self.tp is not None:
            self.tp.close()
