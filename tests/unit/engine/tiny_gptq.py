"""A tiny random transformers Llama saved as safetensors, and `pdserve quantize` runs over it (GPTQ tests)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 160
# intermediate 128 and hidden 64: multiples of the group sizes tested (32, -1) and of int4pack's 16 outputs
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=0, pad_token_id=0,
              tie_word_embeddings=False)
PROMPT = [5, 17, 99, 3, 150, 42, 7, 100, 11, 64, 128, 9, 33]


def write_tiny_llama(path: Path, seed: int = 0):
    """Save a random LlamaForCausalLM (unit-scale activations, perturbed norms) with a word-level tokenizer;
    return the transformers model."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {"<eos>": 0, "<bos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    return model


def calibration_text(num_words: int = 512, seed: int = 2) -> str:
    """Words of the tiny vocabulary with a skewed distribution (some inputs far more active than others)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(2, VOCAB, dtype=torch.float32) ** -1.2
    ids = torch.multinomial(weights, num_words, replacement=True, generator=g) + 2
    return " ".join(f"w{i}" for i in ids.tolist())
