"""Turns the last-position logits of a batch into next tokens.

Order of operations for each row (the vLLM / OpenAI conventions):
1. penalties on raw logits: repetition (prompt + output tokens; positive logits divided, negative multiplied),
   then frequency and presence (output tokens only); then logit_bias is added, and while fewer than
   min_tokens tokens were generated the stop tokens (stop_token_ids, and EOS unless ignore_eos) are set to -inf;
2. the structured-output bitmask of constrained rows (engine.grammar): disallowed tokens get -inf;
3. logprobs, when asked, are the log-softmax of these processed logits (before temperature and truncation);
4. greedy rows (temperature 0) take the argmax;
5. other rows: divide by temperature, keep top_k, then tokens within min_p of the top one, then the top_p
   nucleus; sample with the exponential-race trick: argmax(p / E) with E ~ Exp(1) is a draw from p.

Randomness is per token, not per batch: the noise for output token i of a request comes from a generator
seeded with mix(seed, i); choice j of an n > 1 request has its own seed, choice_seed(seed, j). A request therefore gets the same tokens whatever else is in the batch, after a
preemption, and when its first token was sampled on a prefill worker and the rest on a decode worker.
A row's grammar state is only read here (its mask); the engine advances it with the sampled token.

Logits arrive as the model made them, under torch.inference_mode: nothing here writes into its input.
`sample_rows` confines an exception to the row that raised it (engine.faults injects one in tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from engine.faults import SAMPLING_FAULTS
from engine.grammar import GrammarState, apply_token_bitmask, fill_bitmasks
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprob

_MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): a well-spread 63-bit seed for the noise of output token `index`."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def choice_seed(seed: int, index: int) -> int:
    """Seed of choice `index` of a request seeded `seed` (n > 1): the request's own for choice 0, else a
    splitmix64 mix of (seed, index) on another odd constant than token_seed's, so choice streams do not overlap
    the token streams of one seed. It depends on nothing else: choice i is reproducible whatever the batch."""
    if index == 0:
        return seed
    z = (seed ^ ((index * 0xD1B54A32D192ED03) & _MASK64)) & _MASK64
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
    request_id: str = ""
    grammar: GrammarState | None = None
    """The sequence's structured-output matcher, synced with output_token_ids; None when unconstrained."""
    eos_token_ids: tuple[int, ...] = ()
    """The model's end-of-sequence tokens (suppressed with the stop tokens until params.min_tokens)."""


@dataclass
class RowResult:
    """One row's outcome: a token (and logprob when asked), or the error that failed this row alone."""

    token_id: int | None
    logprob: TokenLogprob | None = None
    error: BaseException | None = None


def sample_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> list[RowResult]:
    """`sample`, with failures confined to their row: when the batch raises, each row is sampled alone, so a
    row that fails gets its error and the others their tokens (the same ones: randomness is per row)."""
    try:
        ids, logprobs = sample(logits, rows)
        return [RowResult(t, lp) for t, lp in zip(ids, logprobs)]
    except Exception:
        results = []
        for i, r in enumerate(rows):
            try:
                ids, logprobs = sample(logits[i:i + 1], [r])
                results.append(RowResult(ids[0], logprobs[0]))
            except Exception as exc:
                results.append(RowResult(None, None, exc))
        return results


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [num_rows, vocab] (any float dtype). Returns one token id and optional logprobs per row."""
    for r in rows:
        SAMPLING_FAULTS.check(r.request_id)
    logits = _apply_penalties(logits.float(), rows)
    logits = _apply_logit_bias(logits, rows)
    logits = _suppress_stop_tokens(logits, rows)
    logits = _apply_grammar_masks(logits, rows)

    logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None

    token_ids = _argmax_rows(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        probs = _truncated_probs(logits[random_rows], [rows[i].params for i in random_rows])
        for j, i in enumerate(random_rows):
            g = torch.Generator().manual_seed(token_seed(rows[i].seed, len(rows[i].output_token_ids)))
            # CPU generator whatever the device: the same seed gives the same token on CPU and CUDA
            noise = torch.empty(probs.shape[-1], dtype=probs.dtype).exponential_(generator=g).to(probs.device)
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


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first of equal ones: kernels.top_k_indices(k=1) on CPU (the
    native top k, which passes over NaN where argmax would pick it; a 32-row decode step's sampling 1.0 -> 0.4 ms,
    BENCHMARKS.md), torch.argmax elsewhere."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return kernels.top_k_indices(logits, 1).view(-1)
    return torch.argmax(logits, dim=-1)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits: [num_rows, vocab] -> a new penalized tensor; `logits` itself is never written.

    Out of place on purpose: the model makes logits under torch.inference_mode, and an in-place write into an
    inference tensor outside that mode raises. Batched: one scatter per penalty kind for all rows.
    """
    num_rows, vocab = logits.shape
    dev, dtype = logits.device, logits.dtype
    rep_rows = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep_rows:
        row_idx, tok_idx = [], []
        for j, i in enumerate(rep_rows):
            seen = set(rows[i].prompt_token_ids) | set(rows[i].output_token_ids)
            row_idx.extend([j] * len(seen))
            tok_idx.extend(seen)
        seen_mask = torch.zeros(len(rep_rows), vocab, dtype=torch.bool, device=dev)
        seen_mask[torch.tensor(row_idx, dtype=torch.long, device=dev),
                  torch.tensor(tok_idx, dtype=torch.long, device=dev)] = True
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in rep_rows], dtype=dtype,
                               device=dev).unsqueeze(1)                        # [n_rep, 1]
        rep_ids = torch.tensor(rep_rows, dtype=torch.long, device=dev)
        values = logits.index_select(0, rep_ids)                               # [n_rep, vocab]
        penalized = torch.where(values > 0, values / penalty, values * penalty)
        logits = logits.index_copy(0, rep_ids, torch.where(seen_mask, penalized, values))
    count_rows = [i for i, r in enumerate(rows)
                  if (r.params.frequency_penalty or r.params.presence_penalty) and r.output_token_ids]
    if count_rows:
        row_idx = [j for j, i in enumerate(count_rows) for _ in rows[i].output_token_ids]
        tok_idx = [t for i in count_rows for t in rows[i].output_token_ids]
        counts = torch.zeros(len(count_rows), vocab, dtype=dtype, device=dev)  # [n_count, vocab]
        counts.index_put_((torch.tensor(row_idx, dtype=torch.long, device=dev),
                           torch.tensor(tok_idx, dtype=torch.long, device=dev)),
                          torch.ones(len(tok_idx), dtype=dtype, device=dev), accumulate=True)
        freq = torch.tensor([rows[i].params.frequency_penalty for i in count_rows], dtype=dtype,
                            device=dev).unsqueeze(1)
        presence = torch.tensor([rows[i].params.presence_penalty for i in count_rows], dtype=dtype,
                                device=dev).unsqueeze(1)
        count_ids = torch.tensor(count_rows, dtype=torch.long, device=dev)
        delta = freq * counts + presence * (counts > 0).to(dtype)
        logits = logits.index_copy(0, count_ids, logits.index_select(0, count_ids) - delta)
    return logits


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits: [num_rows, vocab] -> a new tensor with each row's logit_bias added (one scatter for the batch)."""
    row_idx = [i for i, r in enumerate(rows) for _ in r.params.logit_bias]
    if not row_idx:
        return logits
    dev = logits.device
    tok_idx = [t for r in rows for t, _ in r.params.logit_bias]
    bias = torch.zeros_like(logits)                                            # [num_rows, vocab]
    bias.index_put_((torch.tensor(row_idx, dtype=torch.long, device=dev),
                     torch.tensor(tok_idx, dtype=torch.long, device=dev)),
                    torch.tensor([b for r in rows for _, b in r.params.logit_bias], dtype=logits.dtype, device=dev),
                    accumulate=True)
    return logits + bias


def _suppress_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """min_tokens: rows that generated fewer tokens get -inf at their stop tokens (stop_token_ids, and the model's
    EOS unless ignore_eos), so they cannot end yet. logits: [num_rows, vocab] -> a new tensor when any row does."""
    row_idx, tok_idx = [], []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens:
            stops = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_token_ids))
            row_idx.extend([i] * len(stops))
            tok_idx.extend(stops)
    if not row_idx:
        return logits
    dev = logits.device
    banned = torch.zeros(logits.shape, dtype=torch.bool, device=dev)          # [num_rows, vocab]
    banned[torch.tensor(row_idx, dtype=torch.long, device=dev),
           torch.tensor(tok_idx, dtype=torch.long, device=dev)] = True
    return logits.masked_fill(banned, float("-inf"))
def _apply_grammar_masks(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits: [num_rows, vocab] -> a new tensor where constrained rows allow only their grammar's next tokens.

    One bitmask fill for the constrained rows (on the CPU, where the matchers live), one masked copy on the
    logits' device; unconstrained rows are untouched, so their tokens do not depend on their batch-mates.
    """
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return logits
    bitmask = fill_bitmasks([rows[i].grammar for i in constrained], logits.shape[1])   # [n_con, words] int32
    ids = torch.tensor(constrained, dtype=torch.long, device=logits.device)
    return logits.index_copy(0, ids, apply_token_bitmask(logits.index_select(0, ids), bitmask))


def _truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits: [n, vocab] -> probabilities after temperature, top-k, min-p and top-p, rows renormalized."""
    dev = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev).unsqueeze(1)
    logits = logits / temperature
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values
        kth = sorted_logits.gather(1, torch.tensor(top_k, device=dev).unsqueeze(1) - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # min_p and top_p are tested on host tensors (in probs' dtype), so a CUDA batch does not wait on the device
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)
    if bool((min_p > 0).any()):
        min_p = min_p.to(dev).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)
    if bool((top_p < 1).any()):
        top_p = top_p.to(dev).unsqueeze(1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)
