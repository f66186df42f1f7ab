"""The weights each supported architecture's checkpoint provides, under their Hugging Face names, and the check
every loader runs on what it read (`check_weights`).

Names (i = layer index, j = expert index); every family has the Llama rows unless it replaces them:

    model.embed_tokens.weight                               [vocab, hidden]
    model.layers.{i}.input_layernorm.weight                 [hidden]
    model.layers.{i}.self_attn.q_proj.weight                [num_heads * head_dim, hidden]   (+ .bias: attention_bias)
    model.layers.{i}.self_attn.k_proj.weight                [num_kv_heads * head_dim, hidden] (+ .bias: attention_bias)
    model.layers.{i}.self_attn.v_proj.weight                [num_kv_heads * head_dim, hidden] (+ .bias: attention_bias)
    model.layers.{i}.self_attn.o_proj.weight                [hidden, num_heads * head_dim]
    model.layers.{i}.post_attention_layernorm.weight        [hidden]
    model.layers.{i}.mlp.gate_proj.weight                   [intermediate, hidden]   (dense MLP)
    model.layers.{i}.mlp.up_proj.weight                     [intermediate, hidden]   (dense MLP)
    model.layers.{i}.mlp.down_proj.weight                   [hidden, intermediate]   (dense MLP)
    model.norm.weight                                       [hidden]
    lm_head.weight                                          [vocab, hidden]  (absent when tie_word_embeddings)
  qk_norm (Qwen3, Gemma 3):
    model.layers.{i}.self_attn.q_norm.weight                [head_dim]
    model.layers.{i}.self_attn.k_norm.weight                [head_dim]
  feedforward_norms (Gemma 2/3):
    model.layers.{i}.pre_feedforward_layernorm.weight       [hidden]
    model.layers.{i}.post_feedforward_layernorm.weight      [hidden]
  num_experts > 0 (Mixtral), instead of the dense MLP rows:
    model.layers.{i}.block_sparse_moe.gate.weight           [num_experts, hidden]
    model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight [intermediate, hidden]  (gate)
    model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight [intermediate, hidden]  (up)
    model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight [hidden, intermediate]  (down)

Phi-3 checkpoints fuse q/k/v (qkv_proj) and gate/up (gate_up_proj); the loaders split them into the rows above,
so every family reaches the model under these names.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.loaded_model import ModelLoadError


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> torch shape of every weight a checkpoint with `config` must provide (the table above)."""
    c = config
    h, q, kv, ff = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
            a + "o_proj.weight": (h, q),
        })
        if c.attention_bias:
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
        if c.qk_norm:
            shapes.update({a + "q_norm.weight": (c.head_dim,), a + "k_norm.weight": (c.head_dim,)})
        if c.feedforward_norms:
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,),
                           p + "post_feedforward_layernorm.weight": (h,)})
        if c.num_experts:
            e = p + "block_sparse_moe."
            shapes[e + "gate.weight"] = (c.num_experts, h)
            for j in range(c.num_experts):
                shapes.update({f"{e}experts.{j}.w1.weight": (ff, h), f"{e}experts.{j}.w3.weight": (ff, h),
                               f"{e}experts.{j}.w2.weight": (h, ff)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                           p + "mlp.down_proj.weight": (h, ff)})
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


def split_fused_phi3(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """In place: Phi-3's qkv_proj / gate_up_proj rows become q/k/v_proj and gate/up_proj (the table's names)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for name in [n for n in weights if n.endswith((".self_attn.qkv_proj.weight", ".mlp.gate_up_proj.weight"))]:
        fused = weights.pop(name)
        if name.endswith("qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            if fused.shape[0] != q + 2 * kv:
                raise ModelLoadError(f"weight {name} has {fused.shape[0]} rows, expected {q + 2 * kv}")
            parts = zip(("q_proj", "k_proj", "v_proj"), fused.split([q, kv, kv]))
        else:
            prefix = name.removesuffix("gate_up_proj.weight")
            if fused.shape[0] != 2 * config.intermediate_size:
                raise ModelLoadError(f"weight {name} has {fused.shape[0]} rows, "
                                     f"expected {2 * config.intermediate_size}")
            parts = zip(("gate_proj", "up_proj"), fused.chunk(2))
        for part, value in parts:
            weights[f"{prefix}{part}.weight"] = value.contiguous()
