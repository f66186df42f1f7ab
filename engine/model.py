"""Pre-norm decoder over a paged KV cache: the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2), Qwen3, Gemma 2/3,
Phi-3 and Mixtral, each a set of `ModelConfig` switches on one layer loop.

The model is a flat batch of tokens from many sequences ("varlen"): no padding, no per-sequence tensors.
Attention metadata says where each sequence's tokens are and which KV blocks hold its context. Every
kernel call goes through `kernels`, which picks Triton on CUDA, native C ops on CPU and the torch reference
for the rest.

Weights use Hugging Face names (engine.arch lists them) and the HF "rotate_half" RoPE layout (the GGUF loader
un-permutes q/k). q/k/v and gate/up are fused into single matrices at load time: one GEMM each instead of three
and two. Every matmul goes through an `engine.quant` linear: the checkpoint's weights as loaded (float, or kept in
the file's encoding: PackedLinear over a GGUF tensor's codes), int8 (`quantization="int8"`: every linear and the
LM head) or int4 (`quantization="int4"`: every layer's linears, the LM head int8); a GPTQ checkpoint's linears are
`engine.gptq_linear.GPTQLinear` over its packed codes. A tied embedding shares the LM head's table; norms and biases
stay float, the MoE router as loaded.

What the other families add, in the order a layer runs it:
    embedding * embedding_multiplier                         (Gemma: sqrt(hidden))
    q/k RMSNorm per head before RoPE                         (qk_norm: Qwen3, Gemma 3)
    per-layer RoPE table and sliding window                  (layer_types; Gemma 3's local RoPE base)
    attention scale query_pre_attn_scalar ** -0.5, softcap   (Gemma)
    branch norms before each residual add                    (feedforward_norms: Gemma 2/3)
    GeGLU with tanh GELU                                     (hidden_act: Gemma)
    sparse MoE MLP                                           (num_experts: Mixtral; engine.moe)
    logits softcap                                           (final_logit_softcapping: Gemma 2)
RMSNorm with a (1 + weight) scale (Gemma) is folded into the weights at load, in float32 as transformers adds it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from engine.config import ModelConfig
from engine.gptq_format import GPTQWeight
from engine.gptq_linear import GPTQLinear
from engine.moe import SparseMoE
from engine.packed_weight import cat_rows
from engine.quant import DequantWorkspace, Int4Linear, Int8Linear, Linear, lm_head_quantization, make_linear
from engine.rope import rope_cos_sin_cache
from engine.weight_memory import held_bytes
from kernels import cpu_ops

__all__ = ["AttentionMetadata", "DecoderModel", "LlamaModel"]

_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass
class AttentionMetadata:
    """Where the batch's tokens go in the paged cache and what they attend to."""

    slot_mapping: torch.Tensor     # [num_tokens] int64: cache slot each new token's K/V is written to
    block_tables: torch.Tensor     # [batch, max_blocks_per_seq] int32
    seq_lens: torch.Tensor         # [batch] int32: context length of each sequence including its new tokens
    query_start_loc: torch.Tensor  # [batch + 1] int32: offsets of each sequence's tokens in the flat batch
    after_kv_write: Callable[[int], None] | None = None
    """Called with the layer index right after each layer's K/V are written (engine.kv_digests), or None."""
    max_query_len: int | None = None
    """Most new tokens of one sequence, known on the host (upper bound), or None: kernels.paged_attention then
    reads it from query_start_loc, a device->host sync per layer on CUDA."""
    max_seq_len: int | None = None
    """Longest context (upper bound), known on the host, or None: the Triton decode kernel then sizes its splits
    by the block table's width."""
    keep_rows: torch.Tensor | None = None
    """[n] int64 rows of the flat batch whose final hidden states the step uses (the sampled ones; n may be 0), or
    None: all. The last layer then writes every row's K/V but attends, projects and runs its MLP for these rows
    alone (each row's result is the same computation whatever the batch), and forward returns [n, hidden] in this
    order."""
    keep: AttentionMetadata | None = None
    """With n > 0 keep_rows: the kept rows as one-token queries (query i is row keep_rows[i] at its position, its
    sequence's block table, seq_len its position + 1)."""


class DenseMLP:
    """down(act(gate) * up) with gate and up fused into one GEMM."""

    def __init__(self, gate_up: Linear, down: Linear, act) -> None:
        self.gate_up = gate_up  # [2 * intermediate, hidden]
        self.down = down        # [hidden, intermediate]
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up.forward(x)  # [T, 2 * intermediate]
        if self.act is F.silu:
            return self.down.forward(kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # [T, intermediate] each
        return self.down.forward(self.act(gate) * up)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


@dataclass
class _Layer:
    input_norm: torch.Tensor                 # [hidden]
    qkv: Linear                              # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    o: Linear                                # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor                  # [hidden]: post_attention_layernorm
    mlp: DenseMLP | SparseMoE
    cos_sin_cache: torch.Tensor              # [max_position, rotary_dim] fp32
    window: int | None                       # sliding window, None for full attention
    q_norm: torch.Tensor | None = None       # [head_dim] when qk_norm
    k_norm: torch.Tensor | None = None       # [head_dim] when qk_norm
    pre_ff_norm: torch.Tensor | None = None  # [hidden] when feedforward_norms
    post_ff_norm: torch.Tensor | None = None  # [hidden] when feedforward_norms

    @property
    def gate_up(self) -> Linear:
        """The dense MLP's fused gate/up linear."""
        return self.mlp.gate_up

    @property
    def down(self) -> Linear:
        """The dense MLP's down linear."""
        return self.mlp.down

    @property
    def nbytes(self) -> int:
        norms = (self.input_norm, self.post_norm, self.q_norm, self.k_norm, self.pre_ff_norm, self.post_ff_norm)
        return sum(t.nbytes for t in norms if t is not None) + self.qkv.nbytes + self.o.nbytes + self.mlp.nbytes


class DecoderModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_position: int, quantization: str | None = None,
                 cpu_matmul: str = "torch") -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        c = config

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            return weights[name]

        def norm(name: str) -> torch.Tensor:
            weight = get(name)
            if c.norm_unit_offset:
                weight = 1.0 + weight.float()
            return weight.to(device=device, dtype=dtype)

        workspace = DequantWorkspace()

        def linear(*names: str, bias: tuple[str, ...] = (), quant: str | None = quantization) -> Linear:
            # Fused from the checkpoint's tensors as loaded, so that quantization sees the original weights.
            parts = [get(n) for n in names]
            b = torch.cat([get(n) for n in bias]) if bias else None
            if isinstance(parts[0], GPTQWeight):  # a GPTQ checkpoint's linear stays as its codes
                weight = GPTQWeight.cat(parts, names[0]) if len(parts) > 1 else parts[0]
                return GPTQLinear(weight, None if b is None else b.to(device, dtype), device, workspace)
            return make_linear(cat_rows(parts), b, quant, dtype, device, workspace, cpu_matmul)

        tied = c.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = linear("model.embed_tokens.weight" if tied else "lm_head.weight",
                              quant=lm_head_quantization(quantization))
        # A tied table is looked up through the LM head's (possibly int8) copy; an untied one stays as loaded
        # (float, or packed: a lookup dequantizes only its rows).
        self.embed = self.lm_head if tied else make_linear(get("model.embed_tokens.weight"), None, None, dtype,
                                                           device, workspace)
        self.final_norm = norm("model.norm.weight")
        act = _ACTIVATIONS[c.hidden_act]
        caches: dict[tuple, torch.Tensor] = {}

        def cos_sin(layer: int) -> torch.Tensor:
            local = c.rope_local_theta is not None and c.layer_window(layer) is not None
            theta, scaling = (c.rope_local_theta, None) if local else (c.rope_theta, c.rope_scaling)
            if (theta, scaling) not in caches:
                caches[theta, scaling] = rope_cos_sin_cache(c.rotary_dim, max_position, theta, scaling,
                                                            c.max_position_embeddings).to(device)
            return caches[theta, scaling]

        def mlp(p: str) -> DenseMLP | SparseMoE:
            if not c.num_experts:
                return DenseMLP(linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                                linear(p + "mlp.down_proj.weight"), act)
            e = p + "block_sparse_moe."
            experts = range(c.num_experts)
            return SparseMoE(
                router=linear(e + "gate.weight", quant=None),
                gate_up=[linear(f"{e}experts.{j}.w1.weight", f"{e}experts.{j}.w3.weight") for j in experts],
                down=[linear(f"{e}experts.{j}.w2.weight") for j in experts],
                top_k=c.num_experts_per_tok, act=act)

        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv_bias = (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if c.attention_bias else ()
            self.layers.append(_Layer(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=linear(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight", bias=qkv_bias),
                o=linear(a + "o_proj.weight"),
                post_norm=norm(p + "post_attention_layernorm.weight"),
                mlp=mlp(p),
                cos_sin_cache=cos_sin(i),
                window=c.layer_window(i),
                q_norm=norm(a + "q_norm.weight") if c.qk_norm else None,
                k_norm=norm(a + "k_norm.weight") if c.qk_norm else None,
                pre_ff_norm=norm(p + "pre_feedforward_layernorm.weight") if c.feedforward_norms else None,
                post_ff_norm=norm(p + "post_feedforward_layernorm.weight") if c.feedforward_norms else None,
            ))
        self.scale = (c.query_pre_attn_scalar if c.query_pre_attn_scalar is not None else c.head_dim) ** -0.5
        self.native_decoder, self.native_decoder_max_rows = self._native_decoder()

    def _native_decoder(self) -> tuple[cpu_ops.DecoderLayers | None, int]:
        """The layer loop as one native call for pure decode batches (kernels.cpu_ops.DecoderLayers: the same
        kernels in the same order, so the same bits) and the largest batch it takes, when this model is one it
        runs: float32 on CPU, plain pre-norm layers with a SiLU-gated dense MLP, every linear a native matmul."""
        c = self.config
        if (self.device.type != "cpu" or self.dtype != torch.float32 or c.qk_norm or c.feedforward_norms
                or c.hidden_act != "silu" or c.num_experts or not kernels.native_available()):
            return None, 0
        layers, max_rows = [], sys.maxsize
        for layer in self.layers:
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if not all(isinstance(l, (Int4Linear, Int8Linear)) and l.native is not None for l in linears):
                return None, 0
            max_rows = min(max_rows, *(l.native_max_rows for l in linears))
            layers.append(cpu_ops.LayerWeights(layer.input_norm, layer.post_norm, *(l.native for l in linears),
                                               biases=tuple(l.bias for l in linears), cos_sin=layer.cos_sin_cache,
                                               window=layer.window))
        decoder = cpu_ops.DecoderLayers(layers, self.final_norm, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                                        head_dim=c.head_dim, eps=c.rms_norm_eps, scale=self.scale,
                                        softcap=c.attn_logit_softcapping)
        return decoder, max_rows

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; kv_cache: [layers, 2, blocks, block_size, kv_heads, head_dim].

        Returns the final-norm hidden states [num_tokens, hidden] (of meta.keep_rows alone when given). A pure
        decode batch takes the native decoder when there is one (`native_decoder`), anything else the layer loop.
        """
        num_tokens = input_ids.shape[0]
        if (self.native_decoder is not None and num_tokens == meta.seq_lens.shape[0]
                and num_tokens <= self.native_decoder_max_rows and kernels.native_serves(kv_cache)):
            out = self.native_decoder(self._embed(input_ids), positions, kv_cache, meta.slot_mapping,
                                      meta.block_tables, meta.seq_lens, meta.query_start_loc)
            if out is not None:
                return out if meta.keep_rows is None else out[meta.keep_rows]
        return self.hidden_states(input_ids, positions, kv_cache, meta, self.attention)

    def attention(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """Layer `index`'s paged attention: writes k, v [T, kv_heads, D] at meta.slot_mapping, then attends q
        [T, heads, D] to each sequence's context; returns [T, heads, D]."""
        layer = self.layers[index]
        k_cache, v_cache = kv_cache[index, 0], kv_cache[index, 1]  # [blocks, block_size, kv_heads, head_dim]
        kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.after_kv_write is not None:
            meta.after_kv_write(index)
        if meta.keep_rows is not None and index == len(self.layers) - 1:  # the kept rows only: [n, heads, D]
            if meta.keep is None:  # none
                return q[:0]
            q, meta = q[meta.keep_rows], meta.keep
        return kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                       self.scale, sliding_window=layer.window,
                                       softcap=self.config.attn_logit_softcapping,
                                       max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, attention: Callable[..., torch.Tensor]) -> torch.Tensor:
        """forward with `attention` (the signature of `DecoderModel.attention`) in place of the paged attention:
        engine.compiled_step traces this with an attention the compiler does not look into."""
        c = self.config
        eps = c.rms_norm_eps
        q_size = c.num_heads * c.head_dim
        num_tokens = input_ids.shape[0]
        h = self._embed(input_ids)                                   # [T, hidden]
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = h
                x = kernels.rms_norm(h, layer.input_norm, eps)
            else:
                x, residual = kernels.rms_norm(h, layer.input_norm, eps, residual=residual)
            q, k, v = self._qkv(layer, x, positions)
            attn = attention(i, q, k, v, kv_cache, meta)             # [T, heads, head_dim]
            if attn.shape[0] != num_tokens:                          # the last layer's kept rows (meta.keep)
                residual, num_tokens = residual[meta.keep_rows], attn.shape[0]
                if not num_tokens:
                    return residual
            h = layer.o.forward(attn.reshape(num_tokens, q_size))
            if layer.pre_ff_norm is not None:
                h = kernels.rms_norm(h, layer.post_norm, eps)
                x, residual = kernels.rms_norm(h, layer.pre_ff_norm, eps, residual=residual)
                h = kernels.rms_norm(layer.mlp.forward(x), layer.post_ff_norm, eps)
            else:
                x, residual = kernels.rms_norm(h, layer.post_norm, eps, residual=residual)
                h = layer.mlp.forward(x)
        out, _ = kernels.rms_norm(h, self.final_norm, eps, residual=residual)
        return out

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed.embed(input_ids).to(self.dtype)              # [T, hidden]
        if self.config.embedding_multiplier != 1.0:                 # rounded to dtype, as transformers
            h = h * torch.tensor(self.config.embedding_multiplier, dtype=self.dtype)
        return h

    def _qkv(self, layer: _Layer, x: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections of the normed input x [T, hidden]: q [T, heads, D], k and v [T, kv_heads, D], with the
        per-head norms and RoPE applied to q and k."""
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        num_tokens = x.shape[0]
        qkv = layer.qkv.forward(x)                                   # [T, q_size + 2 * kv_size]
        q = qkv[:, :q_size].view(num_tokens, c.num_heads, c.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, c.num_kv_heads, c.head_dim)
        v = qkv[:, q_size + kv_size:].view(num_tokens, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:
            # [T * heads, head_dim] rows: one RMSNorm per head
            q = kernels.rms_norm(q.reshape(-1, c.head_dim), layer.q_norm, c.rms_norm_eps).view(q.shape)
            k = kernels.rms_norm(k.reshape(-1, c.head_dim), layer.k_norm, c.rms_norm_eps).view(k.shape)
        kernels.rotary_embedding(positions, q, k, layer.cos_sin_cache)
        return q, k, v

    @torch.inference_mode()
    def first_layer_kv(self, input_ids: torch.Tensor, positions: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer 0's K (after RoPE) and V for tokens at `positions`: [T, kv_heads, D] each, as forward writes
        them to the cache. They depend only on each token and its position (embed, norm, projections, RoPE),
        so any subset of a prompt's tokens can be checked without its context."""
        layer = self.layers[0]
        x = kernels.rms_norm(self._embed(input_ids), layer.input_norm, self.config.rms_norm_eps)
        _, k, v = self._qkv(layer, x, positions)
        return k, v

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> logits [n, vocab] in float32."""
        logits = self.lm_head.logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads whatever its batch: every layer, the final norm and the LM head
        (an embedding lookup reads only its rows; a MoE layer counts all its experts)."""
        return sum(layer.nbytes for layer in self.layers) + self.final_norm.nbytes + self.lm_head.nbytes


    def weight_memory_bytes(self) -> int:
        """Bytes the model's weights occupy: every tensor its linears (codes, scales, offsets, each path's copy),
        embedding, norms and biases hold, shared ones counted once (a tied embedding is the LM head's table)."""
        parts: list[object] = [self.lm_head, self.embed, self.final_norm]
        for layer in self.layers:
            parts += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.mlp, layer.q_norm, layer.k_norm,
                      layer.pre_ff_norm, layer.post_ff_norm]
        return held_bytes(*parts)


LlamaModel = DecoderModel
"""The name the engine and its tests have always used."""
