"""Writers of tiny GGUF checkpoints for loader and tokenizer tests (a 2-layer Llama, a byte-level vocabulary)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from engine.tokenizer import bytes_to_unicode

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, FFN, NUM_LAYERS = 32, 4, 2, 8, 64, 2
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
_WORDS = ["the", "hello", "world", "in", "and", "token", "12", "ing", "er", "on"]


def as_float(weight):
    """A loaded weight as a float32 tensor: itself, or a packed one (engine.packed_weight.GroupedWeight) dequantized."""
    import torch

    return weight if isinstance(weight, torch.Tensor) else weight.dequantize(torch.float32)


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges): 3 control tokens, the 256 byte symbols, then merges of a few words."""
    byte_symbols = list(bytes_to_unicode().values())
    tokens = SPECIAL_TOKENS + byte_symbols
    merges = []
    for word in _WORDS + ["Ġ" + w for w in _WORDS]:
        current = word[0]
        for ch in word[1:]:
            merged = current + ch
            if merged not in tokens:
                merges.append(f"{current} {ch}")
                tokens.append(merged)
            current = merged
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types, merges


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k row permutation (HF rotate_half layout -> interleaved pairs)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def hf_tensors(vocab_size: int, seed: int = 0, tied: bool = True, bias: bool = False) -> dict[str, np.ndarray]:
    """Random float32 weights under HF names, in HF (rotate_half) layout."""
    rng = np.random.default_rng(seed)
    q, kv = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    out = {"model.embed_tokens.weight": rng.standard_normal((vocab_size, HIDDEN), dtype=np.float32),
           "model.norm.weight": rng.standard_normal(HIDDEN, dtype=np.float32)}
    if not tied:
        out["lm_head.weight"] = rng.standard_normal((vocab_size, HIDDEN), dtype=np.float32)
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        shapes = {"input_layernorm.weight": (HIDDEN,), "post_attention_layernorm.weight": (HIDDEN,),
                  "self_attn.q_proj.weight": (q, HIDDEN), "self_attn.k_proj.weight": (kv, HIDDEN),
                  "self_attn.v_proj.weight": (kv, HIDDEN), "self_attn.o_proj.weight": (HIDDEN, q),
                  "mlp.gate_proj.weight": (FFN, HIDDEN), "mlp.up_proj.weight": (FFN, HIDDEN),
                  "mlp.down_proj.weight": (HIDDEN, FFN)}
        if bias:
            shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                           "self_attn.v_proj.bias": (kv,)})
        for name, shape in shapes.items():
            out[p + name] = rng.standard_normal(shape, dtype=np.float32)
    return out


_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    """GGUF tensor name of an HF weight name."""
    if hf_name in _TO_GGUF:
        return _TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}"


# Quant type per weight (matrices); norms and biases stay F32 as llama.cpp writes them.
DEFAULT_QTYPES = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_1, "attn_k": Q.Q4_0, "attn_v": Q.F16,
                  "attn_output": Q.BF16, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q8_0, "ffn_down": Q.F32,
                  "output": Q.F16}


def qtype_of(gguf_tensor_name: str, qtypes: dict[str, Q]) -> Q:
    """The type a tensor is written with: F32 for 1-D tensors, else the entry for its short name."""
    short = gguf_tensor_name.split(".")[-2]
    return qtypes.get(short, Q.F32)


def write_tiny_gguf(path: Path, *, arch: str = "llama", tied: bool = True, bias: bool = False,
                    qtypes: dict[str, Q] | None = None, pre: str = "smollm", seed: int = 0,
                    skip_keys: tuple[str, ...] = (), extra: dict | None = None,
                    extra_tensors: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write a tiny model to `path`; return its HF-layout float32 weights (what a loader must give back).

    q/k are permuted the way llama.cpp does for llama/mistral. `skip_keys` leaves metadata keys out (suffixes
    after "<arch>."), `extra` adds metadata (full key -> value), `extra_tensors` adds raw float32 tensors.
    """
    qtypes = DEFAULT_QTYPES if qtypes is None else qtypes
    tokens, types, merges = tiny_vocab()
    weights = hf_tensors(len(tokens), seed=seed, tied=tied, bias=bias)
    writer = gguf.GGUFWriter(str(path), arch)
    hparams = {"block_count": NUM_LAYERS, "context_length": 2048, "embedding_length": HIDDEN,
               "feed_forward_length": FFN, "attention.head_count": NUM_HEADS,
               "attention.head_count_kv": NUM_KV_HEADS, "rope.freq_base": 50000.0,
               "attention.layer_norm_rms_epsilon": 1e-6, "rope.dimension_count": HEAD_DIM}
    for key, value in hparams.items():
        if key in skip_keys:
            continue
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, value in weights.items():
        target = gguf_name(name)
        data = value
        if arch in ("llama", "mistral") and (".attn_q." in target or ".attn_k." in target):
            data = llama_cpp_permute(value, NUM_HEADS if ".attn_q." in target else NUM_KV_HEADS)
        add_tensor(writer, target, data, qtype_of(target, qtypes) if value.ndim == 2 else Q.F32)
    for name, value in (extra_tensors or {}).items():
        add_tensor(writer, name, value, Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def add_tensor(writer: gguf.GGUFWriter, name: str, value: np.ndarray, qtype: Q) -> None:
    """Add a float32 array as `qtype` (F32/F16 natively, others via gguf.quants.quantize)."""
    if qtype == Q.F32:
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, value.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)


def quant_round_trip(value: np.ndarray, qtype: Q) -> np.ndarray:
    """What a correct loader returns for `value` written as `qtype`: quantize then dequantize (float32)."""
    if qtype == Q.F32:
        return value
    if qtype == Q.F16:
        return value.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype).reshape(value.shape)
