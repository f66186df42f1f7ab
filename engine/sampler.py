"""Turns the last-position logits of a batch into next tokens.

Order of operations for each row (the vLLM / OpenAI conventions):
1. penalties on raw logits: repetition (prompt + output tokens; positive logits divided, negative multiplied),
   then frequency and presence (output tokens only);
2. logprobs, when asked, are the log-softmax of these penalized logits (before temperature and truncation);
3. greedy rows (temperature 0) take the argmax;
4. other rows: divide by temperature, keep top_k, then tokens within min_p of the top one, then the top_p
   nucleus; sample with the exponential-race trick: argmax(p / E) with E ~ Exp(1) is a draw from p.

Randomness is per token, not per batch: the noise for output token i of a request comes from a generator
seeded with mix(seed, i). A request therefore gets the same tokens whatever else is in the batch, after a
preemption, and when its first token was sampled on a prefill worker and the rest on a decode worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprob

_MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): a well-spread 63-bit seed for the noise of output token `index`."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [num_rows, vocab] (any float dtype). Returns one token id and optional logprobs per row."""
    logits = logits.float()
    _apply_penalties(logits, rows)

    logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None

    token_ids = torch.argmax(logits, dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        probs = _truncated_probs(logits[random_rows], [rows[i].params for i in random_rows])
        for j, i in enumerate(random_rows):
            g = torch.Generator().manual_seed(token_seed(rows[i].seed, len(rows[i].output_token_ids)))
            noise = torch.empty_like(probs[j]).exponential_(generator=g)
            token_ids[i] = torch.argmax(probs[j] / noise)

    ids = token_ids.tolist()
    out_logprobs: list[TokenLogprob | None] = [None] * len(rows)
    for j, i in enumerate(logprob_rows):
        row_lp = logprobs[j]
        top = []
        if rows[i].params.logprobs:
            values, indices = torch.topk(row_lp, rows[i].params.logprobs)
            top = list(zip(indices.tolist(), values.tolist()))
        out_logprobs[i] = TokenLogprob(ids[i], float(row_lp[ids[i]]), top)
    return ids, out_logprobs


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), dtype=torch.long)
            values = logits[i, seen]
            logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and r.output_token_ids:
            out = torch.tensor(r.output_token_ids, dtype=torch.long)
            counts = torch.zeros(logits.shape[-1], dtype=logits.dtype).index_add_(
                0, out, torch.ones(len(out), dtype=logits.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits: [n, vocab] -> probabilities after temperature, top-k, min-p and top-p, rows renormalized."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temperature
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values
        kth = sorted_logits.gather(1, torch.tensor(top_k).unsqueeze(1) - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).unsqueeze(1)
    if bool((top_p < 1).any()):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)
