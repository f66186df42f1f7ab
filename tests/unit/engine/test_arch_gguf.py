"""The new architectures from GGUF files, and every GGML type the installed gguf package dequantizes.

A tiny random transformers model (the same configs as test_arch_models) is written here as GGUF the way llama.cpp's
convert_hf_to_gguf.py lays it out: its tensor names, q/k permuted for llama (Mixtral is a llama with stacked
ffn_*_exps experts), Gemma's norms stored as 1 + weight, Phi-3's qkv and gate/up fused. Where transformers can
load that architecture's GGUF (Qwen3, Phi-3, Gemma 2/3), it must read back the original weights: that checks the
writer against an independent reading of the format. pdserve then loads the file and must match the original
model's logits and greedy tokens.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from test_arch_models import LOGIT_ATOL, _engine_logits
from tiny_gguf import CHAT_TEMPLATE, as_float, llama_cpp_permute, tiny_vocab
from tiny_hf import COMMON, PROMPT, WINDOW, assert_greedy, max_model_len, randomize

from engine.gguf_blocks import KEPT_TYPES
from engine.gguf_loader import load_gguf, supported_types
from engine.llm import LLM
from engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers", reason="the dev extra provides transformers")


def _configs():
    t = transformers
    return {
        # (gguf architecture, config class, model class, config extras, why transformers cannot read it or None)
        # transformers' Qwen3 GGUF config has no head_dim key: it assumes Qwen3's 128
        "qwen3": ("qwen3", t.Qwen3Config, t.Qwen3ForCausalLM, dict(head_dim=128), None),
        # llama.cpp keeps no query_pre_attn_scalar: it scales by head_dim ** -0.5, so the reference model does too
        "gemma2": ("gemma2", t.Gemma2Config, t.Gemma2ForCausalLM,
                   dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                        final_logit_softcapping=10.0), None),
        "gemma3": ("gemma3", t.Gemma3TextConfig, t.Gemma3ForCausalLM,
                   dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16, num_hidden_layers=6,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1000000.0}}), None),
        "phi3": ("phi3", t.Phi3Config, t.Phi3ForCausalLM, dict(sliding_window=WINDOW), None),
        "phi3-longrope": ("phi3", t.Phi3Config, t.Phi3ForCausalLM,
                          dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                "original_max_position_embeddings": 64,
                                                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                "long_factor": [2.0 + i for i in range(8)]}),
                          "its GGUF loader has no rope_factors_long/short tensors"),
        "mixtral": ("llama", t.MixtralConfig, t.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2),
                    "its GGUF loader has no llama with ffn_*_exps experts"),
    }


_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv",
          "mlp.gate_up_proj": "ffn_up", "block_sparse_moe.gate": "ffn_gate_inp"}
_GEMMA_NAMES = {**_NAMES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_tensors(arch: str, tensors: dict[str, np.ndarray], c) -> dict[str, np.ndarray]:
    """HF checkpoint tensors -> llama.cpp's names and layouts."""
    names = _GEMMA_NAMES if arch.startswith("gemma") else _NAMES
    out = {"token_embd.weight": tensors["model.embed_tokens.weight"],
           "output_norm.weight": tensors["model.norm.weight"]}
    if "lm_head.weight" in tensors and not c.tie_word_embeddings:
        out["output.weight"] = tensors["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, short in names.items():
            if p + hf + ".weight" in tensors:
                out[f"blk.{i}.{short}.weight"] = tensors[p + hf + ".weight"]
        if arch == "llama":
            out[f"blk.{i}.attn_q.weight"] = llama_cpp_permute(out[f"blk.{i}.attn_q.weight"], c.num_attention_heads)
            out[f"blk.{i}.attn_k.weight"] = llama_cpp_permute(out[f"blk.{i}.attn_k.weight"], c.num_key_value_heads)
        if getattr(c, "num_local_experts", None):
            e = p + "block_sparse_moe.experts."
            for w, short in (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")):
                out[f"blk.{i}.{short}.weight"] = np.stack(
                    [tensors[f"{e}{j}.{w}.weight"] for j in range(c.num_local_experts)])
    if arch.startswith("gemma"):
        out = {name: value + 1.0 if name.endswith("norm.weight") else value for name, value in out.items()}
    return out


def write_gguf(path, arch: str, tensors: dict[str, np.ndarray], c, qtype: Q = Q.F32) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    u32 = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
           "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
           "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
           "attention.key_length": head_dim, "attention.value_length": head_dim,
           "rope.dimension_count": int(head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0))}
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    f32 = {"rope.freq_base": float(rope["rope_theta"]), "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps)}
    if getattr(c, "sliding_window", None):
        u32["attention.sliding_window"] = c.sliding_window
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, key, None) is not None:
            f32[key] = float(getattr(c, key))
    if getattr(c, "num_local_experts", None):
        u32.update(expert_count=c.num_local_experts, expert_used_count=c.num_experts_per_tok)
    for key, value in u32.items():
        writer.add_uint32(f"{arch}.{key}", value)
    for key, value in f32.items():
        writer.add_float32(f"{arch}.{key}", value)
    if rope.get("rope_type") == "longrope":  # llama.cpp: the factors as tensors, the original context as a key
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if rope.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", float(rope["factor"]))
    tokens, types, merges = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, value in _gguf_tensors(arch, tensors, c).items():
        if value.ndim >= 2 and qtype != Q.F32:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=list(_configs()))
def gguf_case(request, tmp_path_factory):
    """(name, original transformers model, GGUF path, why transformers cannot read it or None)."""
    arch, config_cls, model_cls, extra, hf_cannot_read = _configs()[request.param]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**COMMON, **extra})).eval()
    randomize(hf, seed=2)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory / "hf", safe_serialization=True)
    tensors = load_file(str(directory / "hf" / "model.safetensors"))
    path = directory / "model.gguf"
    write_gguf(path, arch, tensors, hf.config)
    return request.param, hf, path, hf_cannot_read


def test_transformers_reads_back_the_original_weights(gguf_case):
    name, hf, path, hf_cannot_read = gguf_case
    if hf_cannot_read:
        pytest.skip(f"transformers cannot read this {name} GGUF: {hf_cannot_read}")
    reread = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32)
    original = hf.state_dict()
    for key, value in reread.state_dict().items():
        if name.startswith("gemma") and "norm" in key:  # stored as 1 + w in float32: w comes back within an ulp
            torch.testing.assert_close(value, original[key], rtol=0, atol=1e-6, msg=key)
        else:
            assert torch.equal(value, original[key]), key


def test_gguf_logits_and_greedy_tokens_match_transformers(gguf_case):
    name, hf, path, _ = gguf_case
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, block_size=4, progress=False,
              max_model_len=max_model_len(name))
    assert llm.engine.runner.model.config.architecture == {"mixtral": "llama"}.get(name, name.split("-")[0])
    if "longrope" in name:
        assert llm.engine.runner.model.config.rope_scaling.rope_type == "longrope"
    with torch.inference_mode():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    ours = _engine_logits(llm, PROMPT)
    diff = (ours - expected).abs().max().item()
    print(f"{name} (GGUF): max |logit diff| vs transformers {diff:.2e}")
    assert diff < LOGIT_ATOL
    out = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 10
    assert_greedy(hf, PROMPT, out.outputs[0].token_ids)


# --- every dequantizable GGML type ------------------------------------------------------------------------------
ROW = 256  # the K-quant and IQ super-block: rows of every type's block multiple


def _encoded(qtype: Q, shape: tuple[int, int], rng) -> np.ndarray:
    """`shape` float32 values as `qtype` bytes: quantized where gguf can, else random bytes of the right size
    (every bit pattern of these formats decodes to some value)."""
    values = rng.standard_normal(shape, dtype=np.float32)
    try:
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(shape[0], shape[1] // block_size * type_size), dtype=np.uint8)
        # Scales are float16 fields; keep them finite and small (a random one may be inf or NaN)
        return raw & np.uint8(0x3B) if qtype not in (Q.TQ1_0, Q.TQ2_0) else raw


@pytest.mark.parametrize("qtype", [t for t in supported_types() if t not in (Q.F32, Q.F16, Q.BF16)],
                         ids=lambda t: t.name)
def test_every_dequantizable_type_loads(tmp_path, qtype):
    """A llama checkpoint whose matrices are all `qtype` loads; each weight equals gguf's dequantization."""
    rng = np.random.default_rng(int(qtype))
    tokens, types, merges = tiny_vocab()
    path = tmp_path / f"{qtype.name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": ROW, "feed_forward_length": ROW,
                       "attention.head_count": 4, "attention.head_count_kv": 2}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    matrices = {"token_embd.weight": (len(tokens), ROW), "blk.0.attn_q.weight": (ROW, ROW),
                "blk.0.attn_k.weight": (ROW // 2, ROW), "blk.0.attn_v.weight": (ROW // 2, ROW),
                "blk.0.attn_output.weight": (ROW, ROW), "blk.0.ffn_gate.weight": (ROW, ROW),
                "blk.0.ffn_up.weight": (ROW, ROW), "blk.0.ffn_down.weight": (ROW, ROW)}
    encoded = {name: _encoded(qtype, shape, rng) for name, shape in matrices.items()}
    for name, data in encoded.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        writer.add_tensor(name, np.ones(ROW, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    loaded = load_gguf(path, progress=False)
    reader = gguf.GGUFReader(path)
    assert {t.name: t.tensor_type for t in reader.tensors if t.name in matrices} == dict.fromkeys(matrices, qtype)
    # The common types stay packed (engine.gguf_blocks), the rare ones are dequantized at load: either way the
    # float32 weights are gguf's dequantization bit for bit.
    down_weight = loaded.weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down_weight, torch.Tensor) == (qtype not in KEPT_TYPES)
    embedding = torch.from_numpy(gguf.quants.dequantize(encoded["token_embd.weight"], qtype))
    assert torch.equal(as_float(loaded.weights["model.embed_tokens.weight"]), embedding)
    down = torch.from_numpy(gguf.quants.dequantize(encoded["blk.0.ffn_down.weight"], qtype))
    assert torch.equal(as_float(down_weight), down)
    assert down_weight.shape == (ROW, ROW)
