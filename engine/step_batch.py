"""The flat batch one model step runs, as plain lists: what `ModelRunner` builds from a `SchedulerOutput`, and
what rank 0 of a tensor-parallel worker sends its other ranks (engine.parallel.ranks) so that every rank runs
the same step over its own slice of the model and of the paged KV cache (block ids are the same on every rank);
`copy_blocks` likewise runs on every rank.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.model import AttentionMetadata, DecoderModel
from engine.prompt_logprobs import compute_prompt_logprobs
from engine.sequence import PromptLogprob
from kernels.dispatch import gather_blocks, scatter_blocks


@dataclass
class StepBatch:
    input_ids: list[int]             # [num_tokens]
    positions: list[int]             # [num_tokens]
    slot_mapping: list[int]          # [num_tokens]: cache slot of each token's K/V
    block_tables: list[list[int]]    # [batch][max_blocks_per_seq], padded with block 0
    seq_lens: list[int]              # [batch]
    query_start_loc: list[int]       # [batch + 1]
    sample_positions: list[int]      # rows of the flat batch whose logits are sampled
    prompt_rows: list[tuple[list[int], list[int], int]] = field(default_factory=list)
    """Per request asking for prompt logprobs: (rows of the flat batch, the prompt token after each row, top
    alternatives). Never under tensor parallelism (LLMEngine.validate refuses such requests there)."""


def run_step(model: DecoderModel, kv_cache: torch.Tensor, batch: StepBatch, device: torch.device,
             after_kv_write: Callable[[int], None] | None = None
             ) -> tuple[torch.Tensor | None, list[list[PromptLogprob]]]:
    """Run `batch` through `model`, writing its K/V into kv_cache [L, 2, blocks, block_size, kv_heads, D]
    (`after_kv_write`: AttentionMetadata's).

    Returns the sampled rows' logits [num_sampling, vocab] on the model's device (an inference tensor: the
    sampler runs where they are, so a CUDA step moves only the chosen token ids to the host), or None when no row
    samples, and the prompt logprobs of each of batch.prompt_rows (engine.prompt_logprobs). On a
    tensor-parallel rank other than 0 the logits are that rank's vocabulary slice."""
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.int64, device=device),
        block_tables=torch.tensor(batch.block_tables, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(batch.query_start_loc, dtype=torch.int32, device=device),
        after_kv_write=after_kv_write,
        max_query_len=max((b - a for a, b in zip(batch.query_start_loc, batch.query_start_loc[1:])), default=0),
        max_seq_len=max(batch.seq_lens, default=0),
    )
    # every host-to-device copy before the forward: on CUDA a copy waits for the kernels queued before it
    sampled = (torch.tensor(batch.sample_positions, dtype=torch.int64, device=device)
               if batch.sample_positions else None)
    if (kept := _kept_rows(batch, sampled, device)) is not None:
        meta.keep_rows, meta.keep = kept
    hidden = model.forward(torch.tensor(batch.input_ids, dtype=torch.int64, device=device),
                           torch.tensor(batch.positions, dtype=torch.int64, device=device), kv_cache, meta)
    prompt_logprobs = [compute_prompt_logprobs(model.compute_logits, hidden[rows], targets, num_top)
                       for rows, targets, num_top in batch.prompt_rows]
    if sampled is None:
        return None, prompt_logprobs
    return model.compute_logits(hidden if meta.keep is not None else hidden[sampled]), prompt_logprobs


def _kept_rows(batch: StepBatch, sampled: torch.Tensor | None, device: torch.device
               ) -> tuple[torch.Tensor, AttentionMetadata | None] | None:
    """AttentionMetadata's keep_rows and keep for a batch that uses fewer rows than it computes (none with prompt
    logprobs, which read every row), else None. Row r of sequence b sits at position seq_lens[b] -
    (query_start_loc[b + 1] - r), so as a one-token query it sees that many tokens plus itself."""
    if batch.prompt_rows or len(batch.sample_positions) >= len(batch.input_ids):
        return None
    if sampled is None:
        return torch.empty(0, dtype=torch.int64, device=device), None
    seqs = [bisect.bisect_right(batch.query_start_loc, r) - 1 for r in batch.sample_positions]
    lens = [batch.seq_lens[b] - (batch.query_start_loc[b + 1] - 1 - r) for b, r in zip(seqs, batch.sample_positions)]
    return sampled, AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        block_tables=torch.tensor([batch.block_tables[b] for b in seqs], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(len(seqs) + 1, dtype=torch.int32, device=device),
        max_query_len=1, max_seq_len=max(lens))


def copy_blocks(kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy whole KV blocks of kv_cache, every layer, source -> destination (block ids)."""
    device = kv_cache.device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=device)
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]; staging: [n, L, 2, block_size, Hkv, D]
    scatter_blocks(gather_blocks(kv_cache, src), kv_cache, dst)
