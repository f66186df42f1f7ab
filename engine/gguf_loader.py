"""Loading a llama.cpp GGUF file: config from metadata, dequantized weights under Hugging Face names, tokenizer.

Supported architectures: `llama` (Llama 2/3, SmolLM2, Mistral and Mixtral, which llama.cpp converts as llama;
Mixtral's experts as stacked ffn_*_exps tensors), `mistral` (same layout under its own key prefix), `qwen2`
(q/k/v biases), `qwen3` (q/k norms), `gemma2`, `gemma3` (text) and `phi3` (fused attn_qkv and gate/up in ffn_up,
LongRoPE factors as rope_factors_long/short tensors). Tensor types: every type `gguf.quants` dequantizes
(F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, Q2_K-Q6_K, IQ*, TQ*, MXFP4, ...). By default (`keep_quantized`) the
matrices of the common types stay in their file's encoding, as engine.packed_weight.GroupedWeight / HalfWeight
(engine.gguf_blocks lists what each type becomes; every one loses nothing); the others, and every vector
(norms, biases), are dequantized to the load dtype. With keep_quantized=False everything is dequantized.

Conversions that undo what llama.cpp's converter did:
- GGUF dimensions are listed fastest-first (ggml `ne` order): a tensor of shape [576, 49152] is the torch
  matrix [49152, 576].
- For llama/mistral the converter permutes the rows of attn_q/attn_k within each head so that RoPE rotates
  adjacent pairs (interleaved). Hugging Face's model rotates the two halves of a head (rotate_half), so the
  rows are permuted back (`unpermute_qk`, as transformers' GGUF loader does). The other families are converted
  unpermuted.
- Gemma's norms are stored as 1 + weight (llama.cpp folds the offset in); 1 is subtracted back.
- Phi-3's fused tensors and Mixtral's stacked experts are split into the per-matrix names of engine.arch.
Gemma 2's attention scale is head_dim ** -0.5 (query_pre_attn_scalar = head_dim, as llama.cpp assumes for
every size but 27B); sliding layers follow the family's pattern (every other layer; five of six for Gemma 3),
Gemma 3's local layers use RoPE base 10000 without scaling.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from engine.arch import check_weights, split_fused_phi3
from engine.config import ModelConfig, RopeScaling
from engine.gguf_blocks import KEPT_TYPES, packed_weight
from engine.loaded_model import LoadedModel, ModelLoadError
from engine.packed_weight import PackedWeight
from engine.tokenizer import Tokenizer

_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@functools.cache
def supported_types() -> tuple[GGMLQuantizationType, ...]:
    """GGML tensor types this loader reads: F32/F16/BF16 and every type the installed `gguf` dequantizes
    (probed once on one zero block of each)."""
    found = list(_FLOAT_TYPES)
    for qtype in GGMLQuantizationType:
        if qtype in found or qtype not in GGML_QUANT_SIZES:
            continue
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError:  # a type gguf knows only by name (Q8_1, Q8_K, the integer types, F64, ..)
            continue
        found.append(qtype)
    return tuple(found)


ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
"""`general.architecture` values this loader accepts."""

_PERMUTED_QK_ARCHITECTURES = ("llama", "mistral")
_GEMMA = ("gemma2", "gemma3")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
}
# Gemma's four norms per layer: llama.cpp's ffn_norm is the pre-feedforward one there.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Stacked experts [num_experts, out, in] -> one matrix per expert (j): GGUF short name -> Mixtral's w1/w3/w2.
_EXPERT_NAMES = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
# Tensors that carry configuration rather than weights.
_ROPE_FREQS = "rope_freqs.weight"
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_SAMPLE_BYTES = 1 << 20


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True,
              with_weights: bool = True, keep_quantized: bool = True) -> LoadedModel:
    """Load a GGUF file: config, weights (HF names, CPU; none when not `with_weights`; matrices of KEPT_TYPES
    packed when `keep_quantized`, everything else in `dtype`), tokenizer and fingerprint.

    Raises ModelLoadError naming the file and the metadata key or tensor that is missing, malformed or unsupported.
    """
    path = Path(path)
    reader = open_gguf(path)
    metadata = read_metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    try:
        tokenizer = Tokenizer.from_gguf(metadata)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    extra_eos = [metadata.get("tokenizer.ggml.eot_token_id"), tokenizer.chat_end_token_id()]
    shapes = {name: torch_shape(t) for name, t in tensors.items()}
    try:
        rope_freqs = None
        if _ROPE_FREQS in tensors:
            rope_freqs = dequantize_tensor(tensors[_ROPE_FREQS], torch.float32).flatten().tolist()
        long_short = None
        if all(name in tensors for name in _ROPE_FACTORS):
            long_short = tuple(dequantize_tensor(tensors[name], torch.float32).flatten().tolist()
                               for name in _ROPE_FACTORS)
        config = config_from_gguf(metadata, shapes, extra_eos_token_ids=[i for i in extra_eos if i is not None],
                                  rope_freqs=rope_freqs, longrope_factors=long_short)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    weights = (convert_tensors(reader, config, dtype=dtype, progress=progress, path=path,
                               keep_quantized=keep_quantized) if with_weights else {})
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       fingerprint=gguf_fingerprint(path, reader.data_offset),
                       file_tensor_bytes=sum(int(t.n_bytes) for t in reader.tensors))


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """Only the tokenizer of a GGUF file (no tensor is read): what a gateway needs to tokenize."""
    path = Path(path)
    try:
        return Tokenizer.from_gguf(read_metadata(open_gguf(path), path))
    except ModelLoadError:
        raise
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def open_gguf(path: Path) -> GGUFReader:
    """Memory-map and parse a GGUF file; ModelLoadError when it is not one."""
    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError, struct/numpy errors or OSError on bad files
        raise ModelLoadError(f"{path}: not a readable GGUF file: {type(exc).__name__}: {exc}") from exc


def read_metadata(reader: GGUFReader, path: Path | str = "<gguf>") -> dict[str, Any]:
    """All metadata key/value pairs as plain Python values (str, int, float, bool, lists of those)."""
    metadata = {}
    for key, field in reader.fields.items():
        try:
            metadata[key] = _field_value(field)
        except Exception as exc:
            raise ModelLoadError(f"{path}: metadata key {key} cannot be decoded: {exc}") from exc
    return metadata


def _field_value(field) -> Any:
    kind = field.types[0]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if kind == GGUFValueType.ARRAY:
        if len(field.types) != 2:
            raise ValueError("nested arrays are not supported")
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if not field.data:
            return []
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    value = field.parts[field.data[0]][0]
    if kind == GGUFValueType.FLOAT32:
        # The shortest decimal that round-trips in float32 (1e-05, not 9.999999747378752e-06), as in config.json.
        return float(str(value))
    return value.item()


def torch_shape(tensor) -> tuple[int, ...]:
    """Torch shape of a GGUF tensor: its dimensions reversed (GGUF lists the fastest-varying first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def config_from_gguf(metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], *,
                     extra_eos_token_ids: list[int] | tuple[int, ...] = (),
                     rope_freqs: list[float] | None = None,
                     longrope_factors: tuple[list[float], list[float]] | None = None) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata and the torch shapes of the file's tensors.

    head_dim comes from `attention.key_length`, else (llama/mistral/qwen2) `rope.dimension_count`, else hidden /
    heads, and is checked against attn_q's (or attn_qkv's) shape; `rope.dimension_count` below head_dim is a
    partial rotary. eos_token_ids is `tokenizer.ggml.eos_token_id` followed by `extra_eos_token_ids` (the
    loader passes `tokenizer.ggml.eot_token_id` and the chat template's turn terminator: an instruct model ends
    its answer with that token, which need not be the EOS). `rope_freqs` are the values of the file's
    rope_freqs.weight tensor if it has one (llama.cpp stores Llama-3 RoPE scaling that way);
    `longrope_factors` the (long, short) values of rope_factors_long/short.weight (Phi-3 LongRoPE).
    Raises ValueError naming the metadata key or tensor at fault.
    """
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"general.architecture {arch!r} is not supported (supported: {ARCHITECTURES})")

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ValueError(f"metadata key {arch}.{name} is missing")
        return value

    q_tensor = "blk.0.attn_qkv.weight" if arch == "phi3" else "blk.0.attn_q.weight"
    for name in ("token_embd.weight", q_tensor):
        if name not in shapes:
            raise ValueError(f"tensor {name} is missing")
    vocab_size, hidden_from_embd = shapes["token_embd.weight"]
    hidden = int(key("embedding_length", required=True))
    if hidden != hidden_from_embd:
        raise ValueError(f"tensor token_embd.weight has shape {list(shapes['token_embd.weight'])} but "
                         f"{arch}.embedding_length is {hidden}")
    num_heads = int(key("attention.head_count", required=True))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    if arch in ("llama", "mistral", "qwen2"):
        head_dim = int(key("attention.key_length") or key("rope.dimension_count") or hidden // num_heads)
    else:
        head_dim = int(key("attention.key_length") or hidden // num_heads)
    q_rows = shapes[q_tensor][0]
    expected_rows = num_heads * head_dim + (2 * num_kv_heads * head_dim if arch == "phi3" else 0)
    if q_rows != expected_rows:
        raise ValueError(f"tensor {q_tensor} has {q_rows} rows, expected {expected_rows} for head_count "
                         f"{num_heads}, head_count_kv {num_kv_heads} and head_dim {head_dim}")
    rotary_dim = int(key("rope.dimension_count") or head_dim)
    rope_theta = float(key("rope.freq_base", 10000.0))
    num_layers = int(key("block_count", required=True))
    max_positions = int(key("context_length", 4096))
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    eos_ids = tuple(dict.fromkeys(int(i) for i in [*([eos] if eos is not None else []), *extra_eos_token_ids]))
    family: dict[str, Any] = {}
    window = key("attention.sliding_window")
    if arch in _GEMMA:
        family = dict(hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, feedforward_norms=True,
                      embedding_multiplier=hidden ** 0.5, query_pre_attn_scalar=float(head_dim),
                      qk_norm=arch == "gemma3",
                      attn_logit_softcapping=_optional_float(key("attn_logit_softcapping")),
                      final_logit_softcapping=_optional_float(key("final_logit_softcapping")))
        if window:
            pattern = int(key("attention.sliding_window_pattern") or (2 if arch == "gemma2" else 6))
            family["layer_types"] = tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                                          for i in range(num_layers))
        if arch == "gemma3":
            family["rope_local_theta"] = 10000.0
    elif arch == "phi3" and window:
        family["layer_types"] = ("sliding_attention",) * num_layers
    if arch == "qwen3":
        family["qk_norm"] = True
    if key("expert_count"):
        family.update(num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count", 2)))
    if "layer_types" in family:
        family["sliding_window"] = int(window)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(key("expert_feed_forward_length") or key("feed_forward_length", required=True)),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(arch, metadata, rope_freqs, head_dim, rope_theta, longrope_factors,
                                   max_positions),
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        partial_rotary_factor=rotary_dim / head_dim,
        **family,
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _rope_scaling(arch: str, metadata: Mapping[str, Any], rope_freqs: list[float] | None, head_dim: int,
                  rope_theta: float, longrope_factors: tuple[list[float], list[float]] | None = None,
                  max_positions: int = 4096) -> RopeScaling | None:
    prefix = f"{arch}.rope.scaling."
    kind = metadata.get(prefix + "type")
    factor = metadata.get(prefix + "factor")
    original = metadata.get(prefix + "original_context_length")
    if longrope_factors is not None:
        long, short = longrope_factors
        original = int(original or metadata.get(f"{arch}.rope.scaling.original_context_length") or max_positions)
        attn_factor = metadata.get(prefix + "attn_factor")
        return RopeScaling(factor=max_positions / original, rope_type="longrope",
                           original_max_position_embeddings=original, short_factor=tuple(short),
                           long_factor=tuple(long), attention_factor=_optional_float(attn_factor))
    if kind in (None, "llama3") and factor is not None:
        return RopeScaling(factor=float(factor),
                           low_freq_factor=float(metadata.get(prefix + "low_freq_factor", 1.0)),
                           high_freq_factor=float(metadata.get(prefix + "high_freq_factor", 4.0)),
                           original_max_position_embeddings=int(original or 8192))
    if kind == "linear" and float(factor or 1.0) != 1.0:
        return RopeScaling(factor=float(factor), rope_type="linear",
                           original_max_position_embeddings=int(original or max_positions))
    if kind == "yarn" and factor is not None:
        if original is None:
            raise ValueError(f"metadata {prefix}type = 'yarn' needs {prefix}original_context_length")
        return RopeScaling(factor=float(factor), rope_type="yarn", original_max_position_embeddings=int(original),
                           beta_fast=float(metadata.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(metadata.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)))
    if kind not in (None, "none") and not (kind == "linear" and float(factor or 1.0) == 1.0):
        raise ValueError(f"metadata {prefix}type = {kind!r} is not supported (supported: llama3, linear, yarn "
                         "with factor and original_context_length)")
    if rope_freqs is None or all(f == 1.0 for f in rope_freqs):
        return None
    scaling = RopeScaling(factor=float(max(rope_freqs)), original_max_position_embeddings=int(original or 8192))
    expected = llama3_rope_factors(scaling, head_dim, rope_theta)
    if len(expected) != len(rope_freqs) or not np.allclose(rope_freqs, expected, rtol=1e-4, atol=1e-6):
        raise ValueError(f"tensor {_ROPE_FREQS} holds RoPE frequency factors that are not Llama-3 scaling with "
                         f"factor {scaling.factor}, low_freq_factor 1, high_freq_factor 4 and original context "
                         f"{scaling.original_max_position_embeddings}; this scaling is not supported")
    return scaling


def llama3_rope_factors(scaling: RopeScaling, head_dim: int, rope_theta: float) -> list[float]:
    """Per-frequency divisors of Llama-3 RoPE scaling, as llama.cpp's converter writes them to rope_freqs.weight."""
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling.factor)
        else:
            smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
                      / (scaling.high_freq_factor - scaling.low_freq_factor))
            factors.append(1.0 / ((1 - smooth) / scaling.factor + smooth))
    return factors


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Hugging Face parameter name of a GGUF tensor name, or None when the tensor is not a known weight.
    Stacked expert tensors (ffn_*_exps) are split by the caller; this names their expert 0 with "{j}" for j."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if not match:
        return None
    layer, short = match.groups()
    if short in _EXPERT_NAMES:
        return f"model.layers.{layer}.block_sparse_moe.experts.{{j}}.{_EXPERT_NAMES[short]}.weight"
    names = _GEMMA_LAYER_NAMES if arch in _GEMMA else _LAYER_NAMES
    if short in names:
        return f"model.layers.{layer}.{names[short]}"
    return None


def dequantize_tensor(tensor, dtype: torch.dtype) -> torch.Tensor:
    """A GGUF reader tensor as a torch tensor of `dtype` in torch dimension order (a copy, not the mmap).

    Raises ModelLoadError naming the tensor when its type is not in supported_types().
    """
    qtype = _supported_type(tensor)
    shape = torch_shape(tensor)
    if qtype == GGMLQuantizationType.F32:
        out = torch.from_numpy(np.array(tensor.data, dtype=np.float32))
    elif qtype == GGMLQuantizationType.F16:
        out = torch.from_numpy(np.array(tensor.data).view(np.float16))
    elif qtype == GGMLQuantizationType.BF16:
        out = torch.from_numpy(np.array(tensor.data).view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(dequantize(tensor.data, qtype))
    if out.numel() != math.prod(shape):
        raise ModelLoadError(f"tensor {tensor.name}: {out.numel()} values do not fill its shape {list(shape)}")
    return out.reshape(shape).to(dtype)


def _supported_type(tensor) -> GGMLQuantizationType:
    qtype = tensor.tensor_type
    if qtype not in supported_types():
        raise ModelLoadError(f"tensor {tensor.name} has GGML type {qtype.name}, which is not supported "
                             f"(supported: {', '.join(t.name for t in supported_types())})")
    return qtype


def read_tensor(tensor, dtype: torch.dtype, keep_quantized: bool = True) -> torch.Tensor | PackedWeight:
    """A GGUF reader tensor as a weight: packed (engine.gguf_blocks) when `keep_quantized` and it is a matrix
    (or a stack of them) of a KEPT_TYPES type, else dequantize_tensor's float tensor of `dtype`."""
    shape = torch_shape(tensor)
    if not (keep_quantized and len(shape) >= 2 and _supported_type(tensor) in KEPT_TYPES):
        return dequantize_tensor(tensor, dtype)
    try:
        return packed_weight(tensor.data, tensor.tensor_type, shape)
    except ValueError as exc:
        raise ModelLoadError(f"tensor {tensor.name}: {exc}") from exc


def unpermute_qk(weight: torch.Tensor | PackedWeight, num_heads: int) -> torch.Tensor | PackedWeight:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate_half halves) for a weight or bias,
    float or packed (only whole rows move).

    llama.cpp writes w.reshape(heads, 2, d/2, ...).swapaxes(1, 2) with d = rows / heads; this is its inverse,
    the formula of transformers' `reverse_permute_weights`, applied as a row gather.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {num_heads} heads of even width")
    half = rows // num_heads // 2
    order = torch.arange(rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(rows)
    return weight[order].contiguous()


def convert_tensors(reader: GGUFReader, config: ModelConfig, dtype: torch.dtype = torch.float32,
                    progress: bool = True, path: Path | str = "<gguf>",
                    keep_quantized: bool = True) -> dict[str, torch.Tensor | PackedWeight]:
    """Read every weight (packed or dequantized: `keep_quantized`, module docstring), rename it to its HF name,
    undo the converter's changes (module docstring), and check names and shapes."""
    from tqdm import tqdm

    permuted = config.architecture in _PERMUTED_QK_ARCHITECTURES
    weights: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"loading {Path(path).name}", unit="tensor", disable=not progress):
        if tensor.name == _ROPE_FREQS or tensor.name in _ROPE_FACTORS:
            continue
        name = hf_name(tensor.name, config.architecture)
        if name is None:
            raise ModelLoadError(f"{path}: tensor {tensor.name} is not part of a {config.architecture} model "
                                 "this loader knows")
        try:
            value = read_tensor(tensor, dtype, keep_quantized)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{path}: {exc}") from exc
        if permuted and ".attn_q." in tensor.name:
            value = unpermute_qk(value, config.num_heads)
        elif permuted and ".attn_k." in tensor.name:
            value = unpermute_qk(value, config.num_kv_heads)
        if config.norm_unit_offset and tensor.name.endswith("norm.weight"):
            value = (value.float() - 1.0).to(dtype)
        if "{j}" in name:
            experts = value.unbind(0) if isinstance(value, torch.Tensor) else value.chunk(torch_shape(tensor)[0])
            for j, expert in enumerate(experts):  # [num_experts, out, in] (packed: [num_experts * out, in])
                weights[name.format(j=j)] = expert.contiguous()
        elif config.architecture == "phi3" and tensor.name.endswith(".ffn_up.weight"):
            weights[name.replace("up_proj", "gate_up_proj")] = value  # llama.cpp keeps Phi-3's gate/up fused
        else:
            weights[name] = value
    if config.architecture == "phi3":
        split_fused_phi3(weights, config)
    check_weights(weights, config, path)
    return weights


def gguf_fingerprint(path: Path, data_offset: int) -> str:
    """Hex sha256 of the header bytes (metadata + tensor infos), the file size and the first/last MiB of data."""
    digest = hashlib.sha256(b"pdserve-gguf-v1\0")
    size = path.stat().st_size
    with open(path, "rb") as f:
        digest.update(f.read(data_offset))
        digest.update(size.to_bytes(8, "little"))
        digest.update(f.read(_SAMPLE_BYTES))
        f.seek(max(data_offset, size - _SAMPLE_BYTES))
        digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()
