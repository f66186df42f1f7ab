"""Sampler on synthetic logits: no model. Logits are made under torch.inference_mode, as the model runner
makes them (an inference tensor, never a clone), so a sampler that writes into its input fails here."""

import math

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.faults import SAMPLING_FAULTS, InjectedFault
from engine.sampler import SamplingRow, sample, sample_rows, token_seed
from engine.sampling_params import SamplingParams

VOCAB = 50


def row(prompt=(1, 2), output=(), seed=7, **kw):
    return SamplingRow(SamplingParams(**kw), seed, list(prompt), list(output))


def infer(logits: torch.Tensor) -> torch.Tensor:
    """`logits` as the model runner hands them over: produced inside torch.inference_mode."""
    with torch.inference_mode():
        out = logits * 1.0
    assert out.is_inference()
    return out


def logits_with_peak(peak, n=1):
    logits = torch.linspace(-1, 1, VOCAB).repeat(n, 1)
    logits[:, peak] = 5.0
    return infer(logits)


def test_greedy_takes_argmax():
    ids, _ = sample(logits_with_peak(17, 2), [row(temperature=0.0), row(temperature=0.0)])
    assert ids == [17, 17]


def test_greedy_takes_the_first_of_equal_maxima_and_agrees_with_argmax_on_a_real_vocabulary():
    """Greedy rows on CPU go through the native top-1 (kernels.top_k_indices): on 32 rows of the default model's
    vocabulary it gives torch.argmax's tokens, ties to the earliest index, -inf rows included."""
    logits = torch.randn(32, 49152, generator=torch.Generator().manual_seed(3))
    logits[1, 700] = logits[1, 9000] = logits[1].max() + 1.0  # a tie: the earlier index wins
    logits[2, :] = float("-inf")                               # nothing allowed (a mask that forbids all)
    logits[2, 40000] = 0.0
    ids, _ = sample(infer(logits), [row(temperature=0.0) for _ in range(32)])
    assert ids == torch.argmax(logits, dim=-1).tolist()
    assert ids[1] == 700 and ids[2] == 40000


def test_same_seed_same_token_regardless_of_batch():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    alone, _ = sample(infer(logits), [row(seed=42)])
    noise_rows = torch.randn(3, VOCAB)
    batch = torch.cat([noise_rows[:2], logits, noise_rows[2:]])
    together, _ = sample(infer(batch), [row(seed=1), row(temperature=0.0), row(seed=42), row(seed=5)])
    assert together[2] == alone[0]


def test_seed_stream_depends_on_output_index():
    assert token_seed(42, 0) != token_seed(42, 1)
    assert token_seed(42, 3) == token_seed(42, 3)
    logits = torch.zeros(1, VOCAB)  # uniform: draws differ across positions
    draws = {sample(infer(logits), [row(seed=42, output=[0] * i)])[0][0] for i in range(20)}
    assert len(draws) > 5


def test_sampling_follows_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3))
    logits = torch.log(probs.clamp_min(1e-30)).unsqueeze(0)
    counts = torch.zeros(VOCAB)
    for i in range(2000):
        counts[sample(infer(logits), [row(seed=i)])[0][0]] += 1
    assert counts[3:].sum() == 0
    assert abs(counts[0] / 2000 - 0.6) < 0.05 and abs(counts[1] / 2000 - 0.3) < 0.05


@pytest.mark.parametrize("kw, allowed", [
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.5}, {0}),                 # the top token alone holds >= 0.5 of the mass
    ({"top_p": 0.7}, {0, 1}),
    ({"min_p": 0.4}, {0, 1}),              # 0.3 >= 0.4 * 0.6; 0.1 is not
])
def test_truncation(kw, allowed):
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3))
    logits = torch.log(probs.clamp_min(1e-30)).unsqueeze(0)
    seen = {sample(infer(logits), [row(seed=i, **kw)])[0][0] for i in range(300)}
    assert seen == allowed


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    ids, _ = sample(infer(logits), [row(prompt=[3], temperature=0.0, repetition_penalty=2.0)])
    assert ids == [4]                      # 2.0 / 2 = 1.0 < 1.5


def test_frequency_and_presence_penalties_count_output_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 2.0, 1.0
    ids, _ = sample(infer(logits), [row(output=[3, 3], temperature=0.0, frequency_penalty=0.6)])
    assert ids == [4]                      # 2.0 - 2 * 0.6 = 0.8 < 1.0
    ids, _ = sample(infer(logits), [row(output=[3, 3], temperature=0.0, presence_penalty=0.6)])
    assert ids == [3]                      # 2.0 - 0.6 = 1.4 > 1.0


PENALTY_ROWS = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7), dict(presence_penalty=-0.4),
                dict(repetition_penalty=0.8, frequency_penalty=0.2, presence_penalty=0.5), dict()]


def reference_penalized(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """The penalties of one row, written the slow obvious way (module docstring, step 1)."""
    out = logits.clone()
    p = r.params
    for t in set(r.prompt_token_ids) | set(r.output_token_ids):
        if p.repetition_penalty != 1.0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(r.output_token_ids):
        out[t] -= p.frequency_penalty * r.output_token_ids.count(t) + p.presence_penalty
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_penalties_in_a_seeded_batch_match_a_row_by_row_reference(device):
    base = torch.randn(len(PENALTY_ROWS), VOCAB, generator=torch.Generator().manual_seed(11))
    rows = [row(prompt=[1, 2, 7], output=[7, 9, 9, 30], seed=100 + i, temperature=0.0, logprobs=0, **kw)
            for i, kw in enumerate(PENALTY_ROWS)]
    ids, lps = sample(infer(base.to(device)), rows)
    for i, r in enumerate(rows):
        expected = torch.log_softmax(reference_penalized(base[i], r), -1)
        assert ids[i] == int(torch.argmax(expected))
        assert math.isclose(lps[i].logprob, float(expected[ids[i]]), rel_tol=1e-4, abs_tol=1e-5)
    # seeded random rows: the same token in the batch as alone, and on CUDA as on CPU
    random_rows = [row(prompt=[1, 2, 7], output=[7, 9, 9, 30], seed=100 + i, temperature=0.8, **kw)
                   for i, kw in enumerate(PENALTY_ROWS)]
    together, _ = sample(infer(base.to(device)), random_rows)
    alone = [sample(infer(base[i:i + 1]), [r])[0][0] for i, r in enumerate(random_rows)]
    assert together == alone


def test_penalties_never_write_into_the_input():
    logits = infer(torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4)))
    before = logits.clone()
    sample(logits, [row(output=[5, 5], repetition_penalty=2.0, frequency_penalty=1.0, temperature=0.0),
                    row(output=[6], presence_penalty=2.0, seed=3)])
    assert torch.equal(logits, before)


def test_a_raising_row_fails_alone_and_the_others_keep_their_tokens():
    logits = infer(torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(8)))
    rows = [SamplingRow(SamplingParams(temperature=0.9, frequency_penalty=0.5), 40 + i, [1], [2, 2], f"q{i}")
            for i in range(3)]
    expected, _ = sample(logits, rows)
    with SAMPLING_FAULTS.armed("q1"):
        results = sample_rows(logits, rows)
    assert [r.token_id for r in results] == [expected[0], None, expected[2]]
    assert results[0].error is None and isinstance(results[1].error, InjectedFault) and results[2].error is None
    assert [r.token_id for r in sample_rows(logits, rows)] == expected   # disarmed: back to normal


def test_logprobs_are_log_softmax_of_penalized_logits():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    ids, lps = sample(infer(logits), [row(temperature=0.0, logprobs=3)])
    expected = torch.log_softmax(logits[0], -1)
    assert lps[0].token_id == ids[0]
    assert math.isclose(lps[0].logprob, float(expected[ids[0]]), rel_tol=1e-5)
    assert [t for t, _ in lps[0].top] == torch.topk(expected, 3).indices.tolist()


@pytest.mark.parametrize("kw, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"logprobs": 100}, "logprobs"),
    ({"stop_token_ids": (VOCAB,)}, "stop_token_ids"),
])
def test_validation_names_the_field(kw, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw).validate(VOCAB)
    assert e.value.field == field and field in str(e.value)
