"""`pdserve quantize`: a float checkpoint (a Hugging Face directory, or a GGUF file dequantized to float) -> a GPTQ
checkpoint directory (engine.gptq_format) that pdserve and transformers' GPTQ loader read.

Layer by layer, as GPTQ's reference implementation does ("true sequential"): the calibration text is tokenized
into `num_samples` windows of `seq_len` tokens; their hidden states enter layer 0; within a layer, q/k/v are
quantized on the Hessian of their (shared) input, then o_proj on the attention output computed with the quantized
q/k/v, then gate/up, then down_proj on the MLP's inner activations computed with the quantized gate/up; the
layer's output with every linear quantized is the next layer's input. The method is `gptq` (engine.gptq) or
`rtn` (round to nearest, the baseline, on the same grids and writer; it needs no calibration). Each linear's
relative Hessian-weighted error (gptq.hessian_error) is logged, one summary line per layer.

Output: model.safetensors (quantized linears as qweight/qzeros/scales/g_idx, every other tensor float16),
config.json (the source's, or one written from the GGUF's metadata, with `quantization_config` and torch_dtype
float16), the tokenizer files the source had (tokenizer.json / tokenizer_config.json / generation_config.json /
chat_template.jinja; a GGUF's tokenizer is saved as tokenizer.json), and quantize_config.json (AutoGPTQ's copy).
Architectures: the Llama family without sliding windows or MoE (llama, mistral, qwen2).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import kernels
from engine.config import ModelConfig
from engine.gptq import HessianAccumulator, QuantizedWeight, gptq_quantize, hessian_error, rtn_quantize
from engine.gptq_format import GPTQConfig, pack_weight
from engine.hf_loader import ARCHITECTURES
from engine.loader import load_model
from engine.rope import rope_cos_sin_cache

METHODS = ("gptq", "rtn")
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                    "special_tokens_map.json")


@dataclass(frozen=True)
class QuantizeOptions:
    """What `pdserve quantize` does; every field is a CLI flag."""

    method: str = "gptq"
    """"gptq" or "rtn"."""
    bits: int = 4
    """4 or 8."""
    group_size: int = 128
    """Inputs per (scale, zero) group; -1 for one per row."""
    act_order: bool = False
    """GPTQ only: quantize inputs by decreasing Hessian diagonal (desc_act, with g_idx)."""
    sym: bool = True
    """Symmetric grids (zero point 2^(bits-1)); False for asymmetric."""
    num_samples: int = 128
    """Calibration windows at most (fewer when the text is shorter)."""
    seq_len: int = 512
    """Tokens per calibration window."""
    damp_percent: float = 0.01
    """GPTQ dampening, as a fraction of the Hessian's mean diagonal."""
    block_size: int = 128
    """GPTQ lazy-batch width in columns."""
    checkpoint_format: str = "gptq"
    """"gptq" (v1, what transformers writes) or "gptq_v2"."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.act_order and self.method != "gptq":
            raise ValueError("act_order needs method gptq (round to nearest has no column order)")
        for name in ("num_samples", "seq_len", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.damp_percent < 1:
            raise ValueError(f"damp_percent must be in (0, 1), got {self.damp_percent}")
        self.gptq_config  # validates bits, group_size, checkpoint_format

    @property
    def gptq_config(self) -> GPTQConfig:
        return GPTQConfig(bits=self.bits, group_size=self.group_size, desc_act=self.act_order, sym=self.sym,
                          checkpoint_format=self.checkpoint_format)


_LINEAR_GROUPS = (("self_attn.", ("q_proj", "k_proj", "v_proj")), ("self_attn.", ("o_proj",)),
                  ("mlp.", ("gate_proj", "up_proj")), ("mlp.", ("down_proj",)))


def quantize_checkpoint(source: str | Path, out: str | Path, options: QuantizeOptions,
                        calibration_text: str | None, progress: bool = True,
                        log: Callable[[str], None] = print) -> dict[str, float]:
    """Quantize `source` into the directory `out` (module docstring); returns each linear's relative error."""
    loaded = load_model(source, dtype=torch.float32, progress=progress, keep_quantized=False)  # GPTQ needs floats
    config, weights = loaded.config, loaded.weights
    if config.architecture not in SUPPORTED_ARCHITECTURES or config.num_experts or config.layer_types:
        raise ValueError(f"quantize supports the architectures {SUPPORTED_ARCHITECTURES} without sliding windows "
                         f"or experts, got {config.architecture}")
    for name, w in weights.items():
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"{source} is already quantized ({name}); quantize a float checkpoint")
    gptq = options.gptq_config
    min_zero = 1 if gptq.checkpoint_format == "gptq" else 0
    hidden = None
    if options.method == "gptq":
        if not calibration_text:
            raise ValueError("calibration text is empty (method gptq needs calibration inputs)")
        hidden = _calibration_hidden(loaded.tokenizer.encode(calibration_text), weights, options)
    cos_sin = rope_cos_sin_cache(config.rotary_dim, options.seq_len, config.rope_theta, config.rope_scaling,
                                 config.max_position_embeddings)
    from tqdm import tqdm

    errors: dict[str, float] = {}
    tensors: dict[str, torch.Tensor] = {}
    for i in tqdm(range(config.num_layers), desc="quantizing layers", unit="layer", disable=not progress):
        p = f"model.layers.{i}."
        quantized, hidden = _quantize_layer(config, weights, p, hidden, cos_sin, options, min_zero, errors)
        for name, q in quantized.items():
            packed = pack_weight(q.codes, q.zeros, q.scales, q.g_idx, gptq)
            for suffix in ("qweight", "qzeros", "scales", "g_idx"):
                tensors[f"{name}.{suffix}"] = getattr(packed, suffix)
        layer_errors = [errors[n] for n in quantized]
        each = ", ".join(f"{n.rsplit('.', 1)[-1]} {errors[n]:.2e}" for n in quantized)
        log(f"layer {i}: {options.method} {gptq.bits}-bit g{gptq.group_size}{' act-order' if gptq.desc_act else ''}"
            f": relative error mean {sum(layer_errors) / len(layer_errors):.3e} max {max(layer_errors):.3e} ({each})")
    quantized_names = {name.rsplit(".", 1)[0] + ".weight" for name in tensors}
    for name, w in weights.items():
        if name not in quantized_names:
            tensors[name] = w.to(torch.float16).contiguous()
    _write(Path(source).expanduser(), Path(out).expanduser(), tensors, config, loaded.tokenizer, gptq)
    return errors


def _quantize_layer(config: ModelConfig, weights: dict[str, torch.Tensor], p: str, hidden: torch.Tensor | None,
                    cos_sin: torch.Tensor, options: QuantizeOptions, min_zero: int, errors: dict[str, float]
                    ) -> tuple[dict[str, QuantizedWeight], torch.Tensor | None]:
    """Every linear of layer `p`, true-sequentially (module docstring), and the layer's output with them
    quantized. hidden: [samples, seq_len, hidden], or None for rtn (then None is returned for the output)."""
    quantized: dict[str, QuantizedWeight] = {}
    stages = _layer_stages(config, weights, p, hidden, cos_sin, quantized) if hidden is not None else None
    for module, names in _LINEAR_GROUPS:
        x = next(stages) if stages is not None else None                      # this group's input
        hessian = None
        if x is not None:
            acc = HessianAccumulator(x.shape[-1])
            acc.add(x)
            hessian = acc.hessian
        for short in names:
            name = f"{p}{module}{short}"
            w = weights[name + ".weight"]
            if options.method == "gptq":
                q = gptq_quantize(w, hessian, options.bits, options.group_size, options.sym, options.act_order,
                                  options.damp_percent, options.block_size, min_zero)
            else:
                q = rtn_quantize(w, options.bits, options.group_size, options.sym, min_zero)
            quantized[name] = q
            errors[name] = (hessian_error(w, q.dequantize(), hessian) if hessian is not None
                            else float(((w - q.dequantize()).norm() / w.norm()) ** 2))
    return quantized, None if stages is None else next(stages)


def _weight(weights: dict[str, torch.Tensor], quantized: dict[str, QuantizedWeight], name: str) -> torch.Tensor:
    q = quantized.get(name.removesuffix(".weight"))
    return weights[name] if q is None else q.dequantize()


def _attention(config: ModelConfig, weights, quantized, p: str, x: torch.Tensor, cos_sin: torch.Tensor
               ) -> torch.Tensor:
    """Causal self-attention of each calibration window up to (not through) o_proj: [S, T, hidden] -> [S, T, q]."""
    c = config
    a = p + "self_attn."
    num_samples, seq_len, _ = x.shape

    def proj(name: str) -> torch.Tensor:
        bias = weights.get(a + name + ".bias")
        return F.linear(x, _weight(weights, quantized, a + name + ".weight"), bias)

    q = proj("q_proj").view(-1, c.num_heads, c.head_dim)
    k = proj("k_proj").view(-1, c.num_kv_heads, c.head_dim)
    v = proj("v_proj").view(num_samples, seq_len, c.num_kv_heads, c.head_dim)
    positions = torch.arange(seq_len).repeat(num_samples)
    kernels.rotary_embedding(positions, q, k, cos_sin)
    q = q.view(num_samples, seq_len, c.num_heads, c.head_dim).transpose(1, 2)       # [S, H, T, D]
    k = k.view(num_samples, seq_len, c.num_kv_heads, c.head_dim).transpose(1, 2)
    v = v.transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.num_heads != c.num_kv_heads)
    return out.transpose(1, 2).reshape(num_samples, seq_len, -1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def _layer_stages(config: ModelConfig, weights, p: str, hidden: torch.Tensor, cos_sin: torch.Tensor,
                  quantized: dict[str, QuantizedWeight]) -> Iterator[torch.Tensor]:
    """Layer p's forward in steps: yields the inputs of qkv, o, gate/up and down, then the layer's output. Each
    step runs after the caller put the previous group's quantized weights into `quantized`."""
    eps = config.rms_norm_eps
    x = _rms_norm(hidden, weights[p + "input_layernorm.weight"], eps)
    yield x
    attn = _attention(config, weights, quantized, p, x, cos_sin)
    yield attn
    h = hidden + F.linear(attn, _weight(weights, quantized, p + "self_attn.o_proj.weight"))
    y = _rms_norm(h, weights[p + "post_attention_layernorm.weight"], eps)
    yield y
    inner = (F.silu(F.linear(y, _weight(weights, quantized, p + "mlp.gate_proj.weight")))
             * F.linear(y, _weight(weights, quantized, p + "mlp.up_proj.weight")))
    yield inner
    yield h + F.linear(inner, _weight(weights, quantized, p + "mlp.down_proj.weight"))


def _calibration_hidden(token_ids: list[int], weights: dict[str, torch.Tensor], options: QuantizeOptions
                        ) -> torch.Tensor:
    """Embeddings of the calibration windows: [samples, seq_len, hidden]."""
    num_windows = min(options.num_samples, len(token_ids) // options.seq_len)
    if num_windows == 0:
        raise ValueError(f"the calibration text has {len(token_ids)} tokens, fewer than one window of seq_len "
                         f"{options.seq_len}")
    ids = torch.tensor(token_ids[:num_windows * options.seq_len]).view(num_windows, options.seq_len)
    return F.embedding(ids, weights["model.embed_tokens.weight"])


def _write(source: Path, out: Path, tensors: dict[str, torch.Tensor], config: ModelConfig, tokenizer,
           gptq: GPTQConfig) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if source.is_dir():
        config_json = json.loads((source / "config.json").read_text(encoding="utf-8"))
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
    else:
        config_json = _config_json(config)
        tokenizer.backend.save(str(out / "tokenizer.json"))
        ids = {"bos_token": tokenizer.bos_token_id, "eos_token": tokenizer.eos_token_id}
        tokenizer_config = {key: tokenizer.backend.id_to_token(i) for key, i in ids.items() if i is not None}
        if tokenizer.chat_template:
            tokenizer_config["chat_template"] = tokenizer.chat_template
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")
    config_json["quantization_config"] = gptq.to_json()
    config_json["torch_dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(config_json, indent=2), encoding="utf-8")
    quantize_config = {k: v for k, v in gptq.to_json().items() if k != "quant_method"}
    (out / "quantize_config.json").write_text(json.dumps(quantize_config, indent=2), encoding="utf-8")


def _config_json(config: ModelConfig) -> dict:
    """A transformers config.json for a GGUF-sourced model (the keys engine.hf_loader.config_from_hf reads)."""
    architecture = {v: k for k, v in ARCHITECTURES.items()}[config.architecture]
    c = {"architectures": [architecture], "model_type": config.architecture, "vocab_size": config.vocab_size,
         "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
         "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
         "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
         "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
         "max_position_embeddings": config.max_position_embeddings,
         "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu",
         "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        c["rope_scaling"] = {"rope_type": s.rope_type, "factor": s.factor,
                             "original_max_position_embeddings": s.original_max_position_embeddings}
        if s.rope_type == "llama3":
            c["rope_scaling"] |= {"low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor}
    if config.architecture == "qwen2":
        c["attention_bias"] = True
    return c
