"""Hugging Face directory loader on tiny directories written here (config.json, safetensors, tokenizer files)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.numpy import save_file
from tiny_gguf import CHAT_TEMPLATE, FFN, HEAD_DIM, HIDDEN, NUM_HEADS, NUM_KV_HEADS, hf_tensors, tiny_vocab, \
    write_tiny_gguf

from engine.config import RopeScaling
from engine.gguf_loader import load_gguf_tokenizer
from engine.hf_loader import load_hf_tokenizer
from engine.loader import ModelLoadError, load_model


def _config(**overrides) -> dict:
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": len(tiny_vocab()[0]), "hidden_size": HIDDEN,
              "intermediate_size": FFN, "num_hidden_layers": 2, "num_attention_heads": NUM_HEADS,
              "num_key_value_heads": NUM_KV_HEADS, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
              "max_position_embeddings": 2048, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 0}
    config.update(overrides)
    return config


def _write_dir(path, *, config=None, tied=True, bias=False, shards=1, generation_eos=None, weights=None):
    """A model directory built from the tiny vocabulary; returns the float32 weights written."""
    path.mkdir(exist_ok=True)
    weights = weights if weights is not None else hf_tensors(len(tiny_vocab()[0]), tied=tied, bias=bias)
    names = sorted(weights)
    if shards == 1:
        save_file(weights, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for shard in range(shards):
            file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
            part = {name: weights[name] for name in names[shard::shards]}
            save_file(part, str(path / file))
            weight_map.update(dict.fromkeys(part, file))
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config or _config(tie_word_embeddings=tied)))
    gguf_path = path.parent / f"{path.name}-tokenizer.gguf"
    write_tiny_gguf(gguf_path)
    load_gguf_tokenizer(gguf_path).backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"}))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return weights


@pytest.mark.parametrize("shards", [1, 3])
def test_weights_config_and_tokenizer(tmp_path, shards):
    original = _write_dir(tmp_path / "m", shards=shards, generation_eos=[0, 2])
    loaded = load_model(tmp_path / "m", progress=False)
    config = loaded.config
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads) == ("llama", 2, 4, 2)
    assert (config.head_dim, config.rms_norm_eps, config.rope_theta) == (HEAD_DIM, 1e-6, 50000.0)
    assert config.tie_word_embeddings and not config.attention_bias
    assert (config.bos_token_id, config.eos_token_ids) == (1, (0, 2))
    assert set(loaded.weights) == set(original)
    for name, value in original.items():
        assert torch.equal(loaded.weights[name], torch.from_numpy(value)), name
    assert loaded.tokenizer.encode("hello world") == load_hf_tokenizer(tmp_path / "m").encode("hello world")
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("assistant\n")


def test_same_structure_as_the_gguf_loader(tmp_path):
    gguf_weights = write_tiny_gguf(tmp_path / "t.gguf", qtypes={})  # F32: exact
    _write_dir(tmp_path / "m", weights=gguf_weights)
    from_gguf = load_model(tmp_path / "t.gguf", progress=False)
    from_hf = load_model(tmp_path / "m", progress=False)
    assert from_hf.config == from_gguf.config
    assert set(from_hf.weights) == set(from_gguf.weights)
    for name, value in from_gguf.weights.items():
        assert torch.equal(from_hf.weights[name], value), name


def test_tied_checkpoint_storing_lm_head_drops_it(tmp_path):
    weights = hf_tensors(len(tiny_vocab()[0]), tied=False)
    _write_dir(tmp_path / "m", weights=weights, config=_config(tie_word_embeddings=True))
    assert "lm_head.weight" not in load_model(tmp_path / "m", progress=False).weights


def test_bfloat16(tmp_path):
    _write_dir(tmp_path / "m")
    weights = load_model(tmp_path / "m", dtype=torch.bfloat16, progress=False).weights
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}


def test_qwen2_has_qkv_bias(tmp_path):
    original = _write_dir(tmp_path / "m", bias=True, config=_config(architectures=["Qwen2ForCausalLM"]))
    loaded = load_model(tmp_path / "m", progress=False)
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    assert torch.equal(loaded.weights["model.layers.1.self_attn.k_proj.bias"],
                       torch.from_numpy(original["model.layers.1.self_attn.k_proj.bias"]))


def test_llama3_rope_scaling_and_sliding_window(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    _write_dir(tmp_path / "m", config=_config(rope_scaling=scaling, sliding_window=1024,
                                              architectures=["MistralForCausalLM"]))
    config = load_model(tmp_path / "m", progress=False).config
    assert config.rope_scaling == RopeScaling(factor=8.0)
    assert config.max_position_embeddings == 1024


def test_fingerprint(tmp_path):
    _write_dir(tmp_path / "a")
    _write_dir(tmp_path / "b", weights=hf_tensors(len(tiny_vocab()[0]), seed=5))
    first = load_model(tmp_path / "a", progress=False).fingerprint
    assert load_model(tmp_path / "a", progress=False).fingerprint == first
    assert load_model(tmp_path / "b", progress=False).fingerprint != first


def test_missing_weight_is_named(tmp_path):
    weights = hf_tensors(len(tiny_vocab()[0]))
    del weights["model.layers.1.mlp.up_proj.weight"]
    _write_dir(tmp_path / "m", weights=weights)
    with pytest.raises(ModelLoadError, match=r"weight model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        load_model(tmp_path / "m", progress=False)


def test_unsupported_architecture_is_named(tmp_path):
    _write_dir(tmp_path / "m", config=_config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ModelLoadError, match=r"config\.json: architectures \['GPT2LMHeadModel'\] is not supported"):
        load_model(tmp_path / "m", progress=False)


def test_missing_files_are_named(tmp_path):
    _write_dir(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        load_model(tmp_path / "m", progress=False)
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json is missing"):
        load_model(tmp_path / "m", progress=False)


def test_corrupt_safetensors_is_named(tmp_path):
    _write_dir(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: cannot be read as safetensors"):
        load_model(tmp_path / "m", progress=False)
