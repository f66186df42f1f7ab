"""Loading a Hugging Face model directory: config.json, *.safetensors, tokenizer.json, tokenizer_config.json.

Supported `architectures`: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (Qwen2 always has q/k/v
biases), Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM (text), Phi3ForCausalLM, MixtralForCausalLM.
Weights come from `model.safetensors`, from the shards listed in `model.safetensors.index.json`, or from every
`*.safetensors` file in the directory, and are returned under their own (Hugging Face) names (Phi-3's fused
projections split, engine.arch), so the result has the same structure as the GGUF loader's.
RoPE settings are read from `rope_scaling` (keyed "type" or "rope_type") or transformers 5's `rope_parameters`
(for Gemma 3, one entry per layer type).
A GPTQ checkpoint (config.json `quantization_config` with quant_method gptq) keeps each quantized linear's
qweight / qzeros / scales / g_idx as stored, gathered into one `engine.gptq_format.GPTQWeight` under the linear's
`<prefix>.weight` name (its `shape` is the logical [out, in]); every other tensor is converted to `dtype` as usual.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.arch import check_weights, split_fused_phi3
from engine.config import ModelConfig, RopeScaling
from engine.gptq_format import TENSOR_SUFFIXES, GPTQConfig, GPTQWeight
from engine.loaded_model import LoadedModel, ModelLoadError
from engine.tokenizer import Tokenizer

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
                 "Phi3ForCausalLM": "phi3", "MixtralForCausalLM": "mixtral"}
"""config.json `architectures[0]` values this loader accepts -> ModelConfig.architecture."""

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed by the model
_SAMPLE_BYTES = 1 << 20


def load_hf_directory(path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True,
                      with_weights: bool = True) -> LoadedModel:
    """Load a Hugging Face model directory: config, weights (HF names, `dtype`, CPU; none when not
    `with_weights`), tokenizer, fingerprint.

    Raises ModelLoadError naming the file and the key or tensor that is missing, malformed or unsupported.
    """
    path = Path(path)
    config_json = _read_json(path / "config.json")
    tokenizer = load_hf_tokenizer(path)
    eos_ids = _eos_token_ids(path, config_json, tokenizer)
    try:
        config = config_from_hf(config_json, eos_token_ids=eos_ids)
    except ValueError as exc:
        raise ModelLoadError(f"{path / 'config.json'}: {exc}") from exc
    gptq = gptq_config(config_json, path)
    files = safetensors_files(path)
    weights = {}
    if with_weights:
        weights = _read_weights(files, config, dtype, progress, gptq)
        if config.architecture == "phi3":
            split_fused_phi3(weights, config)
        check_weights(weights, config, path)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, fingerprint=hf_fingerprint(path, files))


def config_from_hf(config: Mapping[str, Any], eos_token_ids: tuple[int, ...] | list[int] = ()) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json; `eos_token_ids` replaces its eos_token_id when given.

    For Llama/Mistral/Qwen2/Qwen3 a sliding attention window shorter than max_position_embeddings (Mistral 7B
    v0.1) caps max_position_embeddings at the window, since within it full attention is exactly the windowed
    one; Gemma 2/3, Phi-3 and Mixtral attend through the window on their sliding layers (layer_types).
    Raises ValueError naming the key at fault.
    """
    architectures = config.get("architectures") or []
    arch = ARCHITECTURES.get(architectures[0] if architectures else None)
    if arch is None:
        raise ValueError(f"architectures {architectures!r} is not supported (supported: {sorted(ARCHITECTURES)})")

    def required(key: str) -> Any:
        if config.get(key) is None:
            raise ValueError(f"key {key} is missing")
        return config[key]

    if config.get("mlp_bias"):
        raise ValueError("mlp_bias = true is not supported")
    if arch not in ("qwen2", "qwen3") and config.get("attention_bias"):
        raise ValueError(f"attention_bias = true is not supported for {arch}")
    if arch == "qwen3" and config.get("attention_bias"):
        raise ValueError("attention_bias = true is not supported for qwen3 (it adds an o_proj bias)")
    hidden = int(required("hidden_size"))
    num_heads = int(required("num_attention_heads"))
    num_layers = int(required("num_hidden_layers"))
    max_positions = int(config.get("max_position_embeddings") or 4096)
    window = config.get("sliding_window")
    if arch in ("llama", "mistral", "qwen2", "qwen3"):
        if window and (arch not in ("qwen2", "qwen3") or config.get("use_sliding_window")):
            max_positions = min(max_positions, int(window))
        window = None
    rope = dict(config.get("rope_parameters") or {})  # transformers 5 nests rope settings here
    local_rope = None
    if arch == "gemma3" and isinstance(rope.get("full_attention"), Mapping):
        local_rope, rope = dict(rope.get("sliding_attention") or {}), dict(rope["full_attention"])
    rope_theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    scaling = config.get("rope_scaling") or rope
    eos = tuple(eos_token_ids) or _ids(config.get("eos_token_id"))
    bos = config.get("bos_token_id")
    gemma = arch in ("gemma2", "gemma3")
    family: dict[str, Any] = {}
    if gemma:
        family = dict(
            hidden_act=config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh",
            norm_unit_offset=True, feedforward_norms=True, embedding_multiplier=hidden ** 0.5,
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
            attn_logit_softcapping=_optional_float(config.get("attn_logit_softcapping")),
            final_logit_softcapping=_optional_float(config.get("final_logit_softcapping")),
            qk_norm=arch == "gemma3")
    elif config.get("hidden_act") not in (None, "silu"):
        raise ValueError(f"hidden_act {config.get('hidden_act')!r} is not supported for {arch} (only silu is)")
    if arch == "gemma3":
        family["rope_local_theta"] = float(config.get("rope_local_base_freq") or (local_rope or {}).get("rope_theta")
                                           or 10000.0)
    if arch == "qwen3":
        family["qk_norm"] = True
    if arch == "mixtral":
        family.update(num_experts=int(required("num_local_experts")),
                      num_experts_per_tok=int(required("num_experts_per_tok")))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(required("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(required("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6 if arch in ("qwen2", "qwen3", "gemma2", "gemma3")
                                      else 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(scaling, config),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma)),
        attention_bias=arch == "qwen2",
        bos_token_id=int(bos) if isinstance(bos, int) else None,
        eos_token_ids=eos,
        partial_rotary_factor=float(config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0),
        layer_types=_layer_types(arch, config, num_layers, window),
        sliding_window=int(window) if window else None,
        **family,
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _layer_types(arch: str, config: Mapping[str, Any], num_layers: int, window: Any) -> tuple[str, ...]:
    """Per-layer attention kinds: config.json's layer_types, else the family's pattern (transformers' defaults)."""
    if not window:
        return ()
    if arch in ("phi3", "mixtral"):
        return ("sliding_attention",) * num_layers  # one window for every layer
    if config.get("layer_types"):
        kinds = tuple(config["layer_types"])
        if len(kinds) != num_layers:
            raise ValueError(f"layer_types has {len(kinds)} entries for {num_layers} layers")
        return kinds
    pattern = 2 if arch == "gemma2" else int(config.get("sliding_window_pattern") or 6)
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


_ROPE_TYPE_ALIASES = {"su": "longrope", "default": None}


def _rope_scaling(scaling: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> RopeScaling | None:
    """RopeScaling from a config.json rope_scaling / rope_parameters mapping; None for plain RoPE."""
    config = config or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    kind = _ROPE_TYPE_ALIASES.get(kind, kind)
    if kind is None:
        return None
    if kind not in ("llama3", "linear", "dynamic", "yarn", "longrope"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported "
                         "(supported: llama3, linear, dynamic, yarn, longrope)")
    original = scaling.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    factor = scaling.get("factor")
    if kind == "longrope":
        if original is None:
            raise ValueError("longrope rope_scaling needs original_max_position_embeddings")
        if factor is None:  # transformers: the ratio of the extended to the original context
            factor = float(config.get("max_position_embeddings") or original) / float(original)
        return RopeScaling(factor=float(factor), rope_type=kind, original_max_position_embeddings=int(original),
                           short_factor=tuple(float(f) for f in scaling["short_factor"]),
                           long_factor=tuple(float(f) for f in scaling["long_factor"]),
                           attention_factor=_optional_float(scaling.get("attention_factor")))
    if factor is None:
        raise ValueError(f"rope_scaling type {kind!r} needs a factor")
    if kind == "yarn":
        if original is None:  # transformers 5: the model's context before scaling
            original = config.get("max_position_embeddings")
        return RopeScaling(factor=float(factor), rope_type=kind,
                           original_max_position_embeddings=int(original or 8192),
                           beta_fast=float(scaling.get("beta_fast") or 32.0),
                           beta_slow=float(scaling.get("beta_slow") or 1.0),
                           mscale=_optional_float(scaling.get("mscale")),
                           mscale_all_dim=_optional_float(scaling.get("mscale_all_dim")),
                           truncate=bool(scaling.get("truncate", True)),
                           attention_factor=_optional_float(scaling.get("attention_factor")))
    if kind in ("linear", "dynamic"):
        return RopeScaling(factor=float(factor), rope_type=kind,
                           original_max_position_embeddings=int(original or config.get("max_position_embeddings")
                                                                or 8192))
    return RopeScaling(factor=float(factor),
                       low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                       high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                       original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)))


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return ()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path} is missing") from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot be read as JSON: {exc}") from exc


def load_hf_tokenizer(path: str | Path) -> Tokenizer:
    """Only the tokenizer of a Hugging Face directory (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path / 'tokenizer.json'} is missing (only fast tokenizers are supported)")
    tokenizer_config = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    if not tokenizer_config.get("chat_template") and (path / "chat_template.jinja").is_file():
        # Newer transformers save the template next to tokenizer_config.json instead of inside it.
        tokenizer_config["chat_template"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    try:
        return Tokenizer.from_file(path / "tokenizer.json", tokenizer_config)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def _eos_token_ids(path: Path, config_json: Mapping[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
    """generation_config.json's eos ids, then config.json's, the tokenizer's EOS and the chat turn terminator."""
    generation = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    ids = [*_ids(generation.get("eos_token_id")), *_ids(config_json.get("eos_token_id")),
           tokenizer.eos_token_id, tokenizer.chat_end_token_id()]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of a directory: the index's shards, else model.safetensors, else all *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: weight_map is missing")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{index} lists {file.name}, which is missing")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    return files


def gptq_config(config_json: Mapping[str, Any], path: Path) -> GPTQConfig | None:
    """The directory's GPTQ quantization_config, None for a float checkpoint; ModelLoadError naming the key."""
    q = config_json.get("quantization_config")
    if q is None:
        return None
    try:
        if not isinstance(q, Mapping):
            raise ValueError("quantization_config must be an object")
        return GPTQConfig.from_json(q)
    except ValueError as exc:
        raise ModelLoadError(f"{path / 'config.json'}: {exc}") from exc


def _read_weights(files: list[Path], config: ModelConfig, dtype: torch.dtype, progress: bool,
                  gptq: GPTQConfig | None = None) -> dict[str, torch.Tensor | GPTQWeight]:
    from tqdm import tqdm

    weights: dict[str, torch.Tensor | GPTQWeight] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}  # GPTQ linear prefix -> {suffix: tensor as stored}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in tqdm(list(f.keys()), desc=f"loading {file.name}", unit="tensor", disable=not progress):
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # a tied checkpoint may store the shared matrix twice
                    if name in weights:
                        raise ModelLoadError(f"{file}: tensor {name} appears in more than one file")
                    prefix, _, suffix = name.rpartition(".")
                    if gptq is not None and suffix in TENSOR_SUFFIXES:
                        packed.setdefault(prefix, {})[suffix] = f.get_tensor(name)
                        continue
                    weights[name] = f.get_tensor(name).to(dtype)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{file}: cannot be read as safetensors: {exc}") from exc
    for prefix, tensors in packed.items():
        weights[prefix + ".weight"] = _gptq_weight(prefix, tensors, gptq, files[0].parent)
    return weights


def _gptq_weight(prefix: str, tensors: dict[str, torch.Tensor], gptq: GPTQConfig, path: Path) -> GPTQWeight:
    """One linear's GPTQ tensors, checked against the format; g_idx defaults to i // group_size when absent."""
    missing = [s for s in ("qweight", "qzeros", "scales") if s not in tensors]
    if missing:
        raise ModelLoadError(f"{path}: GPTQ linear {prefix} has no {prefix}.{missing[0]}")
    if "g_idx" not in tensors:
        in_features = tensors["qweight"].shape[0] * gptq.pack_factor
        size = in_features if gptq.group_size == -1 else gptq.group_size
        tensors["g_idx"] = (torch.arange(in_features) // size).to(torch.int32)
    weight = GPTQWeight(config=gptq, **tensors)
    try:
        weight.validate(prefix)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    return weight


def hf_fingerprint(path: Path, files: list[Path]) -> str:
    """Hex sha256 of config.json, tokenizer.json, and each safetensors file's header, size and first/last MiB."""
    digest = hashlib.sha256(b"pdserve-hf-v1\0")
    for name in ("config.json", "tokenizer.json"):
        digest.update(name.encode() + b"\0" + (path / name).read_bytes())
    for file in files:
        size = file.stat().st_size
        digest.update(file.name.encode() + b"\0" + size.to_bytes(8, "little"))
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(header_len, size)))
            digest.update(f.read(_SAMPLE_BYTES))
            f.seek(max(8 + header_len, size - _SAMPLE_BYTES))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()
