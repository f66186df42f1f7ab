"""logit_bias and min_tokens in the batched sampler, on logits made under torch.inference_mode (as the model
runner makes them), and through the tiny engine end to end."""

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampler import SamplingRow, sample
from engine.sampling_params import SamplingParams
from tiny_model import run, tiny_engine

VOCAB = 50
EOS = 3


def infer(logits: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return logits * 1.0


def row(output=(), **kw):
    return SamplingRow(SamplingParams(**kw), 7, [1, 2], list(output), eos_token_ids=(EOS,))


def peaked(peak, n=1):
    logits = torch.linspace(-1, 1, VOCAB).repeat(n, 1)
    logits[:, peak] = 5.0
    return infer(logits)


def test_logit_bias_moves_greedy_choice_per_row():
    ids, _ = sample(peaked(17, 3), [row(temperature=0.0, logit_bias=((9, 100.0),)),
                                    row(temperature=0.0),
                                    row(temperature=0.0, logit_bias=((17, -100.0),))])
    assert ids[0] == 9 and ids[1] == 17
    assert ids[2] == VOCAB - 1                      # 17 banned: the next largest logit of the ramp


def test_logit_bias_shows_in_logprobs_and_sampling():
    logits = infer(torch.zeros(1, VOCAB))
    _, lps = sample(logits, [row(temperature=0.0, logprobs=1, logit_bias=((5, 2.0),))])
    expected = torch.log_softmax(torch.zeros(VOCAB).index_fill(0, torch.tensor([5]), 2.0), -1)
    assert lps[0].token_id == 5 and lps[0].logprob == pytest.approx(float(expected[5]), abs=1e-6)
    draws = {sample(logits, [SamplingRow(SamplingParams(logit_bias=((11, 100.0),)), s, [1], [])])[0][0]
             for s in range(20)}
    assert draws == {11}


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    params = {"temperature": 0.0, "min_tokens": 2, "stop_token_ids": (8,)}
    logits = infer(torch.stack([peaked(EOS)[0], peaked(8)[0]]))
    ids, _ = sample(logits, [row(output=[20], **params), row(output=[20], **params)])
    assert EOS not in ids and 8 not in ids
    ids, _ = sample(logits, [row(output=[20, 21], **params), row(output=[20, 21], **params)])
    assert ids == [EOS, 8]                          # two generated: the stop tokens are allowed again
    ids, _ = sample(peaked(EOS), [row(output=[], temperature=0.0, min_tokens=1, ignore_eos=True)])
    assert ids == [EOS]                             # ignore_eos: EOS is no stop token to suppress


def test_min_tokens_wins_over_a_positive_bias():
    ids, _ = sample(peaked(1), [row(temperature=0.0, min_tokens=1, logit_bias=((EOS, 100.0),))])
    assert ids == [1]


@pytest.mark.parametrize("bias, message", [(((50, 1.0),), "outside the vocabulary"),
                                           (((4, 100.5),), "must be in [-100, 100]"),
                                           (((4, float("nan")),), "must be in [-100, 100]")])
def test_logit_bias_validated(bias, message):
    with pytest.raises(InvalidRequestError, match="logit_bias") as exc:
        SamplingParams(logit_bias=bias).validate(VOCAB)
    assert message in str(exc.value)


def test_logit_bias_mapping_becomes_sorted_pairs():
    assert SamplingParams(logit_bias={9: 1.0, 2: -3.0}).logit_bias == ((2, -3.0), (9, 1.0))


def test_min_tokens_validated():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=-1).validate(VOCAB)


def test_engine_min_tokens_and_logit_bias_end_to_end():
    engine = tiny_engine()
    eos = engine.model_config.eos_token_ids[0]
    # A bias that makes EOS certain: without min_tokens the request stops at once, with it runs 5 tokens.
    force_eos = ((eos, 100.0),)
    short, long = run(engine, [[5, 6, 7], [5, 6, 7]],
                      [SamplingParams(temperature=0.0, max_tokens=8, logit_bias=force_eos),
                       SamplingParams(temperature=0.0, max_tokens=8, logit_bias=force_eos, min_tokens=5)])
    assert short == [eos]
    assert len(long) == 6 and eos not in long[:5] and long[5] == eos
