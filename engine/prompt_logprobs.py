"""Log-probabilities of prompt tokens (OpenAI's echo + logprobs, vLLM's prompt_logprobs) from the hidden states
of a prefill.

The hidden state at position p gives the distribution of the token at p + 1, so a prompt of n tokens has n - 1
prompt logprobs (the first token has none). They are the log-softmax of the model's raw logits: no penalty,
logit_bias or temperature applies to text the caller wrote, as in vLLM.

Memory: a prompt of n tokens would need an [n, vocab] float32 logits tensor (a 4k prompt at a 150k vocabulary
is 2.4 GB); positions are turned into logits `CHUNK_POSITIONS` at a time, and only the target token's logprob,
its rank and the top alternatives leave each chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.sequence import PromptLogprob

CHUNK_POSITIONS = 128
"""Positions turned into logits at once (a [CHUNK_POSITIONS, vocab] float32 tensor, 25 MiB at 49k tokens)."""


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            target_ids: Sequence[int], num_top: int,
                            chunk_positions: int = CHUNK_POSITIONS) -> list[PromptLogprob]:
    """hidden: [n, hidden_size], the states of n consecutive prompt positions; target_ids[i]: the prompt token
    that follows position i. Returns one PromptLogprob per position, with `num_top` alternatives each."""
    assert hidden.shape[0] == len(target_ids), "one target token per hidden state"
    out: list[PromptLogprob] = []
    targets = torch.tensor(list(target_ids), dtype=torch.long, device=hidden.device)
    with torch.inference_mode():
        for start in range(0, len(target_ids), chunk_positions):
            logprobs = torch.log_softmax(compute_logits(hidden[start:start + chunk_positions]).float(), dim=-1)
            chunk_targets = targets[start:start + chunk_positions]
            target_lp = logprobs.gather(1, chunk_targets.unsqueeze(1))                    # [c, 1]
            ranks = (logprobs > target_lp).sum(dim=1) + 1                                  # [c]
            tops = torch.topk(logprobs, num_top, dim=-1) if num_top else None
            lp_list, rank_list = target_lp.squeeze(1).tolist(), ranks.tolist()
            top_ids = tops.indices.tolist() if tops is not None else [[]] * len(lp_list)
            top_values = tops.values.tolist() if tops is not None else [[]] * len(lp_list)
            for token_id, lp, rank, ids, values in zip(chunk_targets.tolist(), lp_list, rank_list, top_ids,
                                                        top_values):
                out.append(PromptLogprob(token_id, lp, list(zip(ids, values)), rank))
    return out
