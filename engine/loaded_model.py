"""What a checkpoint loader returns and how it reports a bad checkpoint: `LoadedModel`, `ModelLoadError`, and the
weight names and shapes every loader checks its result against (`check_weights`). Below `engine.loader` (which
picks a loader by path) and its loaders (`gguf_loader`, `hf_loader`), which all build these.

Weight names (i = layer index):

    model.embed_tokens.weight                         [vocab, hidden]
    model.layers.{i}.input_layernorm.weight           [hidden]
    model.layers.{i}.self_attn.q_proj.weight          [num_heads * head_dim, hidden]   (+ .bias when attention_bias)
    model.layers.{i}.self_attn.k_proj.weight          [num_kv_heads * head_dim, hidden] (+ .bias when attention_bias)
    model.layers.{i}.self_attn.v_proj.weight          [num_kv_heads * head_dim, hidden] (+ .bias when attention_bias)
    model.layers.{i}.self_attn.o_proj.weight          [hidden, num_heads * head_dim]
    model.layers.{i}.post_attention_layernorm.weight  [hidden]
    model.layers.{i}.mlp.gate_proj.weight             [intermediate, hidden]
    model.layers.{i}.mlp.up_proj.weight               [intermediate, hidden]
    model.layers.{i}.mlp.down_proj.weight             [hidden, intermediate]
    model.norm.weight                                 [hidden]
    lm_head.weight                                    [vocab, hidden]  (absent when config.tie_word_embeddings)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.tokenizer import Tokenizer


class ModelLoadError(ValueError):
    """A checkpoint is missing, malformed or unsupported; the message names the file and the key or tensor."""


@dataclass
class LoadedModel:
    """A checkpoint ready to be put into the model: config, weights, tokenizer and identity."""

    config: ModelConfig
    """Hyperparameters read from the checkpoint."""
    weights: dict[str, torch.Tensor]
    """Hugging Face parameter name -> tensor on CPU in the requested dtype (names and shapes: module docstring)."""
    tokenizer: Tokenizer
    """The checkpoint's tokenizer and chat template."""
    fingerprint: str
    """Hex sha256 identifying the checkpoint, computed without reading all the weights: for GGUF the header
    (metadata and tensor infos, which include every tensor's name, type, shape and offset), the file size and
    the first and last MiB of tensor data; for a Hugging Face directory config.json, tokenizer.json, every
    safetensors header, the file sizes and the first and last MiB of each file's data. Equal fingerprints mean
    the same checkpoint on any machine; the load dtype is not part of it."""


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> torch shape of every weight a checkpoint with `config` must provide (the table above)."""
    h, q, kv, ff = (config.hidden_size, config.num_heads * config.head_dim,
                    config.num_kv_heads * config.head_dim, config.intermediate_size)
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h), p + "mlp.down_proj.weight": (h, ff),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def check_weights(weights: Mapping[str, torch.Tensor], config: ModelConfig, source: Path | str) -> None:
    """Raise ModelLoadError (naming `source` and the weight) unless `weights` has exactly the expected names/shapes."""
    expected = expected_weight_shapes(config)
    for name, shape in expected.items():
        if name not in weights:
            raise ModelLoadError(f"{source}: weight {name} is missing")
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(f"{source}: weight {name} has shape {list(weights[name].shape)}, "
                                 f"expected {list(shape)}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise ModelLoadError(f"{source}: unexpected weights for this config: {extra[:5]}"
                             + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
