"""Runs one scheduled step: builds the flat batch and its attention metadata, runs the model, samples.

Owns the device state of a worker: the model's weights and the paged KV cache tensor
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` (K at index 0, V at 1).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig, ModelConfig
from engine.model import AttentionMetadata, LlamaModel
from engine.prompt_logprobs import compute_prompt_logprobs
from engine.sampler import RowResult, SamplingRow, choice_seed, sample_rows
from engine.scheduler import SchedulerOutput
from engine.sequence import PromptLogprob
from kernels.dispatch import gather_blocks, scatter_blocks

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
                 max_model_len: int) -> None:
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        self.model = LlamaModel(model_config, weights, self.dtype, self.device, max_position=max_model_len,
                                quantization=config.quantization)
        self.num_blocks = num_kv_blocks_for(config, model_config, self.dtype, self.device)
        c = model_config
        bytes_per_token = c.kv_bytes_per_token(self.dtype.itemsize)
        log.info("KV cache: %d bytes/token (%s), %d blocks of %d tokens = %d tokens, %.1f MiB",
                 bytes_per_token, str(self.dtype).removeprefix("torch."), self.num_blocks, self.block_size,
                 self.num_blocks * self.block_size, self.num_blocks * self.block_size * bytes_per_token / 2**20)
        # Zeroed, not empty: attention masks the slots past a sequence's length, but a masked slot still enters
        # the P @ V product with weight 0, and 0 * NaN is NaN. Recycled memory can hold NaN bit patterns;
        # after this every slot only ever holds K/V values.
        self.kv_cache = torch.zeros(c.num_layers, 2, self.num_blocks, self.block_size, c.num_kv_heads,
                                    c.head_dim, dtype=self.dtype, device=self.device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks, every layer, source -> destination (a forked choice's partial prompt block)."""
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]; staging: [n, L, 2, block_size, Hkv, D]
        scatter_blocks(gather_blocks(self.kv_cache, src), self.kv_cache, dst)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run `out`'s chunks; returns, per sampling chunk's request id, its token (and logprob when asked) or
        the error that failed that request alone: one result per choice the chunk samples (n first tokens of
        an n > 1 request from the same logits, choice i with choice_seed(seed, i)), else one; and the prompt
        logprobs computed. An error of the forward pass itself raises (whole batch)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        sample_positions: list[int] = []
        sampling: list[SamplingRow] = []
        prompt_rows: list[tuple[str, list[int], list[int], int]] = []   # (request id, rows, targets, top)
        bs = self.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + chunk.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(seq.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            if seq.params.prompt_logprobs is not None:
                # Positions already scored are skipped: a preempted request recomputes its prompt.
                first, last = max(start, len(seq.prompt_logprobs)), min(end, seq.num_prompt_tokens - 1)
                if first < last:
                    assert first == len(seq.prompt_logprobs), "prompt positions are scored without a gap"
                    rows = [query_start_loc[-1] + p - start for p in range(first, last)]
                    prompt_rows.append((seq.request_id, rows, seq.prompt_token_ids[first + 1:last + 1],
                                        seq.params.prompt_logprobs))
            query_start_loc.append(query_start_loc[-1] + chunk.num_new_tokens)
            if chunk.samples:
                for choice in range(seq.num_choices_to_sample):
                    sample_positions.append(query_start_loc[-1] - 1)
                    sampling.append(SamplingRow(seq.params, choice_seed(seq.seed, choice), seq.prompt_token_ids,
                                                seq.output_token_ids, seq.request_id, self.eos_token_ids))
        max_blocks = max(len(c.seq.block_ids) for c in out.chunks)
        block_tables = [c.seq.block_ids + [0] * (max_blocks - len(c.seq.block_ids)) for c in out.chunks]

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(block_tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
        )
        hidden = self.model.forward(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                                    torch.tensor(positions, dtype=torch.int64, device=dev), self.kv_cache, meta)
        result = RunnerOutput()
        for request_id, rows, targets, num_top in prompt_rows:
            result.prompt_logprobs[request_id] = compute_prompt_logprobs(self.model.compute_logits, hidden[rows],
                                                                         targets, num_top)
        if sample_positions:
            logits = self.model.compute_logits(hidden[sample_positions]).cpu()  # [num_sampling, vocab], inference
            for row, r in zip(sampling, sample_rows(logits, sampling)):
                result.rows.setdefault(row.request_id, []).append(r)
        return result
