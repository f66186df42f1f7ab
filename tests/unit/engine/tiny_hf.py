"""Tiny randomly initialised transformers models saved as Hugging Face directories (safetensors plus a word-level
tokenizer.json), one per architecture pdserve supports: what the architecture, GPTQ and cluster tests load.

    model = write_tiny_model(path, "gemma2")     # the transformers model, its directory written at `path`
    assert_greedy(model, PROMPT, token_ids)      # pdserve's greedy tokens are transformers'

Weights are random at unit activation scale, norms perturbed around their init: transformers' 0.02 init gives
logits of ~0.5, where soft-caps and near-ties hide mistakes, and an all-ones or all-zeros norm would hide a missing
or doubled (1 + weight) offset. PROMPT is longer than WINDOW, so windowed layers really drop positions, and
generation runs past it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.unit.engine.tiny_gguf import tiny_vocab

VOCAB = len(tiny_vocab()[0])  # the GGUF architecture tests write these models with tiny_gguf's vocabulary
WINDOW = 5
PROMPT = [5, 17, 99, 3, 250, 42, 7, 300, 11, 64, 128, 9, 33]  # 13 tokens > WINDOW
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": 1,
          "eos_token_id": 0, "pad_token_id": 0}
# The GPTQ tests' Llama: intermediate 128 and hidden 64 are multiples of the group sizes tested (32, -1) and of
# int4pack's 16 outputs; default RoPE.
GPTQ_LLAMA = {"vocab_size": 160, "intermediate_size": 128, "max_position_embeddings": 512,
              "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
GPTQ_PROMPT = [5, 17, 99, 3, 150, 42, 7, 100, 11, 64, 128, 9, 33]  # ids < GPTQ_LLAMA's vocabulary


def architectures() -> dict[str, tuple[type, type, dict]]:
    """Name -> (transformers config class, model class, config fields over COMMON): every family and RoPE
    scaling pdserve loads (engine.arch)."""
    import transformers as t

    sliding_full = ["sliding_attention", "full_attention"]
    return {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM,
                  {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                       "rope_theta": 10000.0}}),
        # pdserve caps Mistral's context at its window (full attention within it is the windowed one): none here
        "mistral": (t.MistralConfig, t.MistralForCausalLM, {"head_dim": 16, "sliding_window": None}),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, {"tie_word_embeddings": True}),  # q/k/v biases
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, {"head_dim": 16, "tie_word_embeddings": False}),
        "qwen3-yarn": (t.Qwen3Config, t.Qwen3ForCausalLM,
                       {"head_dim": 16, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                            "original_max_position_embeddings": 64}}),
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM,
                   {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                    "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0, "layer_types": sliding_full}),
        "gemma3": (t.Gemma3TextConfig, t.Gemma3ForCausalLM,
                   {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 16, "layer_types": sliding_full,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                           "rope_theta": 1000000.0}}}),
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM, {"sliding_window": WINDOW}),
        "phi3-partial-rotary": (t.Phi3Config, t.Phi3ForCausalLM,
                                {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.5}}),
        # original context 64 < the model's 256: transformers uses the short factors up to 64 tokens, as pdserve
        # does with max_model_len 64 (max_model_len())
        "phi3-longrope": (t.Phi3Config, t.Phi3ForCausalLM,
                          {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                               "original_max_position_embeddings": 64,
                                               "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                               "long_factor": [2.0 + i for i in range(8)]}}),
        "mixtral": (t.MixtralConfig, t.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    }


def max_model_len(name: str) -> int | None:
    """The engine's max_model_len for architecture `name` (None: the model's own)."""
    return 64 if "longrope" in name else None


def randomize(model, seed: int) -> None:
    """In place: unit-scale weights, norms perturbed around their init (module doc)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # [out, in] or stacked experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / p.shape[-1] ** 0.5)


def tiny_model(name: str, seed: int = 1, **overrides):
    """A randomized transformers model of architecture `name` (eval mode); `overrides`: config fields."""
    config_cls, model_cls, extra = architectures()[name]
    model = model_cls(config_cls(**{**COMMON, **extra, **overrides})).eval()
    randomize(model, seed)
    return model


def save_model(model, path: Path) -> None:
    """`model` with save_pretrained (safetensors) and a word-level tokenizer over its ids ("<eos>" 0, "<bos>" 1,
    "w2" ...): requests send ids, gateways detokenize them."""
    model.save_pretrained(path, safe_serialization=True)
    vocab = {"<eos>": 0, "<bos>": 1, **{f"w{i}": i for i in range(2, model.config.vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(Path(path) / "tokenizer.json"))
    (Path(path) / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))


def write_tiny_model(path: Path, name: str, seed: int = 1, **overrides):
    """Save tiny_model(name, seed, **overrides) at `path` (save_model); return the transformers model."""
    model = tiny_model(name, seed, **overrides)
    save_model(model, path)
    return model


def write_tiny_llama(path: Path):
    """The GPTQ tests' source checkpoint (GPTQ_LLAMA) at `path`; the transformers model."""
    return write_tiny_model(path, "llama", **GPTQ_LLAMA)


def hf_next_token_logits(model, prompt: list[int], token_ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(token_ids), vocab] for each of `token_ids` given `prompt` and the tokens before
    it, in one forward (causal: each row is what a step-by-step run computes). The tokens are transformers'
    greedy continuation exactly when each equals its row's argmax."""
    assert token_ids, "no tokens to check"
    with torch.inference_mode():
        logits = model(torch.tensor([list(prompt) + list(token_ids)])).logits[0].float()
    return logits[len(prompt) - 1:-1]


def assert_greedy(model, prompt: list[int], token_ids: list[int]) -> None:
    """`token_ids` are transformers' greedy continuation of `prompt` (hf_next_token_logits)."""
    assert hf_next_token_logits(model, prompt, token_ids).argmax(-1).tolist() == list(token_ids)


def calibration_text(num_words: int = 512, seed: int = 2, vocab_size: int = GPTQ_LLAMA["vocab_size"]) -> str:
    """Words of save_model's vocabulary with a skewed distribution (some inputs far more active than others)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(2, vocab_size, dtype=torch.float32) ** -1.2
    ids = torch.multinomial(weights, num_words, replacement=True, generator=g) + 2
    return " ".join(f"w{i}" for i in ids.tolist())
