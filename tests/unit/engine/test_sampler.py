"""Sampler on synthetic logits: no model."""

import math

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampler import SamplingRow, sample, token_seed
from engine.sampling_params import SamplingParams

VOCAB = 50


def row(prompt=(1, 2), output=(), seed=7, **kw):
    return SamplingRow(SamplingParams(**kw), seed, list(prompt), list(output))


def logits_with_peak(peak, n=1):
    logits = torch.linspace(-1, 1, VOCAB).repeat(n, 1)
    logits[:, peak] = 5.0
    return logits


def test_greedy_takes_argmax():
    ids, _ = sample(logits_with_peak(17, 2), [row(temperature=0.0), row(temperature=0.0)])
    assert ids == [17, 17]


def test_same_seed_same_token_regardless_of_batch():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    alone, _ = sample(logits.clone(), [row(seed=42)])
    noise_rows = torch.randn(3, VOCAB)
    batch = torch.cat([noise_rows[:2], logits, noise_rows[2:]])
    together, _ = sample(batch, [row(seed=1), row(temperature=0.0), row(seed=42), row(seed=5)])
    assert together[2] == alone[0]


def test_seed_stream_depends_on_output_index():
    assert token_seed(42, 0) != token_seed(42, 1)
    assert token_seed(42, 3) == token_seed(42, 3)
    logits = torch.zeros(1, VOCAB)  # uniform: draws differ across positions
    draws = {sample(logits.clone(), [row(seed=42, output=[0] * i)])[0][0] for i in range(20)}
    assert len(draws) > 5


def test_sampling_follows_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3))
    logits = torch.log(probs.clamp_min(1e-30)).unsqueeze(0)
    counts = torch.zeros(VOCAB)
    for i in range(2000):
        counts[sample(logits.clone(), [row(seed=i)])[0][0]] += 1
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
    seen = {sample(logits.clone(), [row(seed=i, **kw)])[0][0] for i in range(300)}
    assert seen == allowed


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    ids, _ = sample(logits.clone(), [row(prompt=[3], temperature=0.0, repetition_penalty=2.0)])
    assert ids == [4]                      # 2.0 / 2 = 1.0 < 1.5


def test_frequency_and_presence_penalties_count_output_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 2.0, 1.0
    ids, _ = sample(logits.clone(), [row(output=[3, 3], temperature=0.0, frequency_penalty=0.6)])
    assert ids == [4]                      # 2.0 - 2 * 0.6 = 0.8 < 1.0
    ids, _ = sample(logits.clone(), [row(output=[3, 3], temperature=0.0, presence_penalty=0.6)])
    assert ids == [3]                      # 2.0 - 0.6 = 1.4 > 1.0


def test_logprobs_are_log_softmax_of_penalized_logits():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    ids, lps = sample(logits.clone(), [row(temperature=0.0, logprobs=3)])
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
