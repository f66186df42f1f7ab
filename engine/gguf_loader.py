"""Loading a llama.cpp GGUF file: config from metadata, dequantized weights under Hugging Face names, tokenizer.

Supported architectures: `llama` (Llama 2/3, SmolLM2, and Mistral, which llama.cpp converts as llama),
`mistral` (same layout under its own key prefix) and `qwen2` (q/k/v biases). Supported tensor types: F32, F16,
BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, dequantized with `gguf.quants`.

Two conversions undo what llama.cpp's converter did:
- GGUF dimensions are listed fastest-first (ggml `ne` order): a tensor of shape [576, 49152] is the torch
  matrix [49152, 576].
- For llama/mistral the converter permutes the rows of attn_q/attn_k within each head so that RoPE rotates
  adjacent pairs (interleaved). Hugging Face's model rotates the two halves of a head (rotate_half), so the
  rows are permuted back (`unpermute_qk`, as transformers' GGUF loader does). Qwen2 is converted unpermuted.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from engine.config import ModelConfig, RopeScaling
from engine.loaded_model import LoadedModel, ModelLoadError, check_weights
from engine.tokenizer import Tokenizer

SUPPORTED_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                   GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                   GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)
"""GGML tensor types this loader dequantizes."""

ARCHITECTURES = ("llama", "mistral", "qwen2")
"""`general.architecture` values this loader accepts."""

_PERMUTED_QK_ARCHITECTURES = ("llama", "mistral")

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
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
# Tensors that carry configuration rather than weights.
_ROPE_FREQS = "rope_freqs.weight"
_SAMPLE_BYTES = 1 << 20


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True,
              with_weights: bool = True) -> LoadedModel:
    """Load a GGUF file: config, weights (HF names, `dtype`, CPU; none when not `with_weights`), tokenizer and
    fingerprint.

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
        config = config_from_gguf(metadata, shapes, extra_eos_token_ids=[i for i in extra_eos if i is not None],
                                  rope_freqs=rope_freqs)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    weights = convert_tensors(reader, config, dtype=dtype, progress=progress, path=path) if with_weights else {}
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       fingerprint=gguf_fingerprint(path, reader.data_offset))


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
                     rope_freqs: list[float] | None = None) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata and the torch shapes of the file's tensors.

    head_dim comes from `attention.key_length`, else `rope.dimension_count`, else hidden / heads, and is
    checked against attn_q's shape. eos_token_ids is `tokenizer.ggml.eos_token_id` followed by
    `extra_eos_token_ids` (the loader passes `tokenizer.ggml.eot_token_id` and the chat template's turn
    terminator: an instruct model ends its answer with that token, which need not be the EOS).
    `rope_freqs` are the values of the file's rope_freqs.weight tensor if it has one (llama.cpp stores Llama-3
    RoPE scaling that way). Raises ValueError naming the metadata key or tensor at fault.
    """
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"general.architecture {arch!r} is not supported (supported: {ARCHITECTURES})")

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ValueError(f"metadata key {arch}.{name} is missing")
        return value

    for name in ("token_embd.weight", "blk.0.attn_q.weight"):
        if name not in shapes:
            raise ValueError(f"tensor {name} is missing")
    vocab_size, hidden_from_embd = shapes["token_embd.weight"]
    hidden = int(key("embedding_length", required=True))
    if hidden != hidden_from_embd:
        raise ValueError(f"tensor token_embd.weight has shape {list(shapes['token_embd.weight'])} but "
                         f"{arch}.embedding_length is {hidden}")
    num_heads = int(key("attention.head_count", required=True))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    head_dim = int(key("attention.key_length") or key("rope.dimension_count") or hidden // num_heads)
    q_rows = shapes["blk.0.attn_q.weight"][0]
    if q_rows != num_heads * head_dim:
        raise ValueError(f"tensor blk.0.attn_q.weight has {q_rows} rows, expected head_count {num_heads} x "
                         f"head_dim {head_dim}")
    rope_theta = float(key("rope.freq_base", 10000.0))
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    eos_ids = tuple(dict.fromkeys(int(i) for i in [*([eos] if eos is not None else []), *extra_eos_token_ids]))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", required=True)),
        num_layers=int(key("block_count", required=True)),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(arch, metadata, rope_freqs, head_dim, rope_theta),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
    )


def _rope_scaling(arch: str, metadata: Mapping[str, Any], rope_freqs: list[float] | None, head_dim: int,
                  rope_theta: float) -> RopeScaling | None:
    prefix = f"{arch}.rope.scaling."
    kind = metadata.get(prefix + "type")
    factor = metadata.get(prefix + "factor")
    original = metadata.get(prefix + "original_context_length")
    if kind in (None, "llama3") and factor is not None:
        return RopeScaling(factor=float(factor),
                           low_freq_factor=float(metadata.get(prefix + "low_freq_factor", 1.0)),
                           high_freq_factor=float(metadata.get(prefix + "high_freq_factor", 4.0)),
                           original_max_position_embeddings=int(original or 8192))
    if kind not in (None, "none") and not (kind == "linear" and float(factor or 1.0) == 1.0):
        raise ValueError(f"metadata {prefix}type = {kind!r} is not supported (only Llama-3 RoPE scaling is)")
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


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face parameter name of a GGUF tensor name, or None when the tensor is not a known weight."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def dequantize_tensor(tensor, dtype: torch.dtype) -> torch.Tensor:
    """A GGUF reader tensor as a torch tensor of `dtype` in torch dimension order (a copy, not the mmap).

    Raises ModelLoadError naming the tensor when its type is not in SUPPORTED_TYPES.
    """
    qtype = tensor.tensor_type
    if qtype not in SUPPORTED_TYPES:
        raise ModelLoadError(f"tensor {tensor.name} has GGML type {qtype.name}, which is not supported "
                             f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")
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


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate_half halves) for a weight or bias.

    llama.cpp writes w.reshape(heads, 2, d/2, ...).swapaxes(1, 2) with d = rows / heads; this is its inverse,
    the formula of transformers' `reverse_permute_weights`.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {num_heads} heads of even width")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()


def convert_tensors(reader: GGUFReader, config: ModelConfig, dtype: torch.dtype = torch.float32,
                    progress: bool = True, path: Path | str = "<gguf>") -> dict[str, torch.Tensor]:
    """Dequantize every weight, rename it to its HF name, un-permute q/k, and check names and shapes."""
    from tqdm import tqdm

    permuted = config.architecture in _PERMUTED_QK_ARCHITECTURES
    weights: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"loading {Path(path).name}", unit="tensor", disable=not progress):
        if tensor.name == _ROPE_FREQS:
            continue
        name = hf_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"{path}: tensor {tensor.name} is not part of a {config.architecture} model "
                                 "this loader knows")
        try:
            value = dequantize_tensor(tensor, dtype)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{path}: {exc}") from exc
        if permuted and ".attn_q." in tensor.name:
            value = unpermute_qk(value, config.num_heads)
        elif permuted and ".attn_k." in tensor.name:
            value = unpermute_qk(value, config.num_kv_heads)
        weights[name] = value
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
