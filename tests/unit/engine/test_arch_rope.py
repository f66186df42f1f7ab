"""RoPE scaling tables against transformers' own (modeling_rope_utils), and how config.json spells them."""

from __future__ import annotations

import pytest
import torch

from engine.config import RopeScaling
from engine.hf_loader import config_from_hf
from engine.rope import inverse_frequencies, rope_cos_sin_cache

transformers = pytest.importorskip("transformers", reason="the dev extra provides transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HEAD_DIM = 64
MAX_POSITIONS = 4096

ROPE_PARAMETERS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                              "attention_factor": 1.3, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 1024,
                 "short_factor": [1.0 + 0.01 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.0 + 0.5 * i for i in range(HEAD_DIM // 2)]},
}


def _hf_config(rope: dict):
    return transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                                    max_position_embeddings=MAX_POSITIONS,
                                    rope_parameters={"rope_theta": 50000.0, **rope})


def _ours(hf_config, max_position: int):
    config = config_from_hf({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"], "vocab_size": 32,
                             "intermediate_size": 64, "num_hidden_layers": 1})
    inv_freq, attention_factor = inverse_frequencies(config.rotary_dim, config.rope_theta, config.rope_scaling,
                                                     max_position=max_position,
                                                     max_position_embeddings=config.max_position_embeddings)
    return config, inv_freq, attention_factor


@pytest.mark.parametrize("name", list(ROPE_PARAMETERS))
def test_inverse_frequencies_match_transformers(name):
    hf_config = _hf_config(ROPE_PARAMETERS[name])
    kind = ROPE_PARAMETERS[name]["rope_type"]
    # within the model's context (transformers' seq_len argument is what its dynamic update passes)
    expected, expected_factor = ROPE_INIT_FUNCTIONS[kind](hf_config, torch.device("cpu"), MAX_POSITIONS)
    config, inv_freq, attention_factor = _ours(hf_config, max_position=MAX_POSITIONS)
    assert config.rope_scaling.rope_type == kind
    torch.testing.assert_close(inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(expected_factor, rel=1e-9)


def test_dynamic_is_plain_within_the_context_and_ntk_past_it():
    hf_config = _hf_config(ROPE_PARAMETERS["dynamic"])
    _, within, _ = _ours(hf_config, max_position=MAX_POSITIONS)
    plain = 1.0 / 50000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM)
    torch.testing.assert_close(within, plain.float(), rtol=1e-6, atol=0)
    _, longer, _ = _ours(hf_config, max_position=3 * MAX_POSITIONS)
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, torch.device("cpu"), 3 * MAX_POSITIONS)
    torch.testing.assert_close(longer, expected.float(), rtol=1e-6, atol=0)
    assert (longer[1:] < plain[1:]).all()  # a larger base: every frequency but the first is lower


def test_longrope_uses_long_factors_past_the_original_context():
    hf_config = _hf_config(ROPE_PARAMETERS["longrope"])
    _, short, _ = _ours(hf_config, max_position=1024)
    _, long, _ = _ours(hf_config, max_position=2048)
    torch.testing.assert_close(short, ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, 1024)[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(long, ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, 2048)[0], rtol=1e-6, atol=0)
    assert not torch.equal(short, long)


def test_cos_sin_cache_carries_the_attention_factor():
    scaling = RopeScaling(factor=4.0, rope_type="yarn", original_max_position_embeddings=256, attention_factor=1.5)
    cache = rope_cos_sin_cache(16, 64, 10000.0, scaling, 1024)
    cos, sin = cache[:, :8], cache[:, 8:]
    torch.testing.assert_close(cos ** 2 + sin ** 2, torch.full_like(cos, 2.25))


@pytest.mark.parametrize("key", ["type", "rope_type"])
@pytest.mark.parametrize("kind,expected", [("linear", "linear"), ("dynamic", "dynamic"), ("yarn", "yarn"),
                                           ("su", "longrope"), ("longrope", "longrope")])
def test_rope_scaling_key_spellings(key, kind, expected):
    scaling = {key: kind, "factor": 2.0, "original_max_position_embeddings": 512,
               "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    config = config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64,
                             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                             "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": scaling})
    assert config.rope_scaling.rope_type == expected
    assert config.rope_scaling.factor == 2.0


def test_unknown_rope_type_is_refused():
    with pytest.raises(ValueError, match="rope_scaling type 'mrope' is not supported"):
        config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64,
                        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                        "rope_scaling": {"rope_type": "mrope", "factor": 2.0}})
