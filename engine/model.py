"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

The model is a flat batch of tokens from many sequences ("varlen"): no padding, no per-sequence tensors.
Attention metadata says where each sequence's tokens are and which KV blocks hold its context. Every
kernel call goes through `kernels`, which picks Triton on CUDA and the torch reference elsewhere.

Weights use Hugging Face names and the HF "rotate_half" RoPE layout (the GGUF loader un-permutes q/k).
q/k/v and gate/up are fused into single matrices at load time: one GEMM each instead of three and two.
Every matmul goes through an `engine.quant` linear: float weights, int8 (`quantization="int8"`: every linear and
the LM head) or int4 (`quantization="int4"`: every layer's linears, the LM head int8). A tied embedding shares the
LM head's table; norms and biases stay float.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from engine.config import ModelConfig, RopeScaling
from engine.quant import DequantWorkspace, FloatLinear, Linear, lm_head_quantization, make_linear


@dataclass
class AttentionMetadata:
    """Where the batch's tokens go in the paged cache and what they attend to."""

    slot_mapping: torch.Tensor     # [num_tokens] int64: cache slot each new token's K/V is written to
    block_tables: torch.Tensor     # [batch, max_blocks_per_seq] int32
    seq_lens: torch.Tensor         # [batch] int32: context length of each sequence including its new tokens
    query_start_loc: torch.Tensor  # [batch + 1] int32: offsets of each sequence's tokens in the flat batch


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear               # [(num_heads + 2 * num_kv_heads) * head_dim, hidden], bias when attention_bias
    o: Linear                 # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor   # [hidden]
    gate_up: Linear           # [2 * intermediate, hidden]
    down: Linear              # [hidden, intermediate]


def rope_cos_sin_cache(head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[max_position, head_dim] float32: cos of each (position, frequency) then sin, the layout kernels expect."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is not None:
        inv_freq = _llama3_scale(inv_freq, scaling)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_position: int, quantization: str | None = None) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            return weights[name]

        def w(name: str) -> torch.Tensor:
            return get(name).to(device=device, dtype=dtype)

        workspace = DequantWorkspace()

        def linear(*names: str, bias: tuple[str, ...] = (), quant: str | None = quantization) -> Linear:
            # Fused from the checkpoint's tensors as loaded, so that quantization sees the original weights.
            weight = torch.cat([get(n) for n in names]) if len(names) > 1 else get(names[0])
            b = torch.cat([get(n) for n in bias]) if bias else None
            return make_linear(weight, b, quant, dtype, device, workspace)

        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = linear("model.embed_tokens.weight" if tied else "lm_head.weight",
                              quant=lm_head_quantization(quantization))
        # A tied table is looked up through the LM head's (possibly int8) copy; an untied one stays float.
        self.embed = self.lm_head if tied else FloatLinear(w("model.embed_tokens.weight"))
        self.final_norm = w("model.norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv_bias = (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if config.attention_bias else ()
            self.layers.append(_Layer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=linear(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight", bias=qkv_bias),
                o=linear(a + "o_proj.weight"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=linear(p + "mlp.down_proj.weight"),
            ))
        self.cos_sin_cache = rope_cos_sin_cache(config.head_dim, max_position, config.rope_theta,
                                                config.rope_scaling).to(device)
        self.scale = config.head_dim ** -0.5

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; kv_cache: [layers, 2, blocks, block_size, kv_heads, head_dim].

        Returns the final-norm hidden states [num_tokens, hidden].
        """
        c = self.config
        q_size = c.num_heads * c.head_dim
        kv_size = c.num_kv_heads * c.head_dim
        num_tokens = input_ids.shape[0]
        h = self.embed.embed(input_ids).to(self.dtype)              # [T, hidden]
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = h
                x = kernels.rms_norm(h, layer.input_norm, c.rms_norm_eps)
            else:
                x, residual = kernels.rms_norm(h, layer.input_norm, c.rms_norm_eps, residual=residual)
            qkv = layer.qkv.forward(x)                               # [T, q_size + 2 * kv_size]
            q = qkv[:, :q_size].view(num_tokens, c.num_heads, c.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(num_tokens, c.num_kv_heads, c.head_dim)
            v = qkv[:, q_size + kv_size:].view(num_tokens, c.num_kv_heads, c.head_dim)
            kernels.rotary_embedding(positions, q, k, self.cos_sin_cache)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]      # [blocks, block_size, kv_heads, head_dim]
            kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                           meta.query_start_loc, self.scale)  # [T, heads, head_dim]
            h = layer.o.forward(attn.reshape(num_tokens, q_size))
            x, residual = kernels.rms_norm(h, layer.post_norm, c.rms_norm_eps, residual=residual)
            gate, up = layer.gate_up.forward(x).chunk(2, dim=-1)    # [T, intermediate] each
            h = layer.down.forward(F.silu(gate) * up)
        out, _ = kernels.rms_norm(h, self.final_norm, c.rms_norm_eps, residual=residual)
        return out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> logits [n, vocab] in float32."""
        return self.lm_head.logits(hidden)

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads whatever its batch: every layer, the final norm and the LM head
        (an embedding lookup reads only its rows)."""
        layer_bytes = sum(layer.input_norm.nbytes + layer.post_norm.nbytes + layer.qkv.nbytes + layer.o.nbytes
                          + layer.gate_up.nbytes + layer.down.nbytes for layer in self.layers)
        return layer_bytes + self.final_norm.nbytes + self.lm_head.nbytes
