"""GGUF loader on tiny files written with gguf.GGUFWriter: config, names, shapes, un-permute, dequantization, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from tiny_gguf import (DEFAULT_QTYPES, HEAD_DIM, HIDDEN, NUM_HEADS, NUM_KV_HEADS, as_float, gguf_name,
                       llama_cpp_permute, qtype_of, quant_round_trip, tiny_vocab, write_tiny_gguf)

from engine.config import RopeScaling
from engine.gguf_loader import dequantize_tensor, llama3_rope_factors, load_gguf, unpermute_qk
from engine.loader import ModelLoadError, expected_weight_shapes, load_model


@pytest.fixture
def tiny_path(tmp_path):
    return tmp_path / "tiny.gguf"


def test_config_from_metadata(tiny_path):
    write_tiny_gguf(tiny_path)
    config = load_model(tiny_path, progress=False).config
    tokens, _, _ = tiny_vocab()
    assert config.architecture == "llama"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (len(tokens), HIDDEN, 64)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 8)
    assert config.rms_norm_eps == 1e-6  # float32 metadata comes back as its shortest decimal
    assert config.rope_theta == 50000.0
    assert config.rope_scaling is None
    assert config.max_position_embeddings == 2048
    assert config.tie_word_embeddings is True
    assert config.attention_bias is False
    assert config.bos_token_id == 1
    # EOS (<|endoftext|> = 0) plus the chat template's turn terminator <|im_end|> = 2.
    assert config.eos_token_ids == (0, 2)


def test_head_dim_falls_back_to_hidden_over_heads(tiny_path):
    write_tiny_gguf(tiny_path, skip_keys=("rope.dimension_count",))
    assert load_model(tiny_path, progress=False).config.head_dim == HIDDEN // NUM_HEADS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_names_shapes_and_dequantized_values(tiny_path, dtype):
    original = write_tiny_gguf(tiny_path, tied=False)
    loaded = load_model(tiny_path, dtype=dtype, progress=False, keep_quantized=False)
    assert set(loaded.weights) == set(original) == set(expected_weight_shapes(loaded.config))
    for name, value in original.items():
        got = loaded.weights[name]
        assert got.dtype == dtype and got.device.type == "cpu"
        assert tuple(got.shape) == value.shape, name
        qtype = qtype_of(gguf_name(name), DEFAULT_QTYPES) if value.ndim == 2 else Q.F32
        expected = torch.from_numpy(quant_round_trip(value, qtype)).to(dtype)
        assert torch.equal(got, expected), f"{name} ({qtype.name})"


@pytest.mark.parametrize("qtype, max_error", [(Q.Q8_0, 0.03), (Q.Q4_0, 0.5), (Q.Q4_1, 0.35), (Q.BF16, 0.02)])
def test_quantized_values_stay_close_to_the_original(tiny_path, qtype, max_error):
    qtypes = {name: qtype for name in DEFAULT_QTYPES}
    original = write_tiny_gguf(tiny_path, qtypes=qtypes)
    weights = load_model(tiny_path, progress=False).weights
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
        error = (as_float(weights[name]) - torch.from_numpy(original[name])).abs().max().item()
        assert 0 < error < max_error, name


def test_qk_unpermute_restores_hf_layout(tiny_path):
    # All F32 so the comparison is exact: the file holds llama.cpp-permuted q/k, the loader must undo it.
    original = write_tiny_gguf(tiny_path, qtypes={})
    reader = GGUFReader(tiny_path)
    raw_q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    hf_q = original["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(np.asarray(raw_q.data), hf_q)  # the file really is permuted
    weights = load_model(tiny_path, progress=False).weights
    for i in range(2):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            assert torch.equal(weights[name], torch.from_numpy(original[name])), name


def test_unpermute_is_the_inverse_of_llama_cpp_permute():
    weight = np.arange(NUM_KV_HEADS * HEAD_DIM * 3, dtype=np.float32).reshape(NUM_KV_HEADS * HEAD_DIM, 3)
    permuted = torch.from_numpy(llama_cpp_permute(weight, NUM_KV_HEADS))
    assert torch.equal(unpermute_qk(permuted, NUM_KV_HEADS), torch.from_numpy(weight))
    bias = np.arange(NUM_HEADS * HEAD_DIM, dtype=np.float32)
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(bias, NUM_HEADS)), NUM_HEADS),
                       torch.from_numpy(bias))
    # Within a head, interleaved pair (2j, 2j+1) goes back to rows j and j + head_dim/2.
    head = unpermute_qk(torch.arange(8.0).reshape(8, 1), 1).flatten().tolist()
    assert head == [0.0, 2.0, 4.0, 6.0, 1.0, 3.0, 5.0, 7.0]


def test_weights_match_transformers_gguf_loader(tiny_path):
    transformers = pytest.importorskip("transformers")
    write_tiny_gguf(tiny_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_path.parent), gguf_file=tiny_path.name, dtype=torch.float32).state_dict()
    ours = load_model(tiny_path, progress=False).weights
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied: transformers exposes the shared matrix twice
    for name, value in ours.items():
        assert torch.equal(as_float(value), reference[name]), name


def test_qwen2_keeps_qk_rows_and_loads_biases(tiny_path):
    original = write_tiny_gguf(tiny_path, arch="qwen2", bias=True, qtypes={})
    loaded = load_model(tiny_path, progress=False)
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    assert set(loaded.weights) == set(original)
    for name, value in original.items():
        assert torch.equal(loaded.weights[name], torch.from_numpy(value)), name


def test_llama_biases_are_unpermuted_too(tiny_path):
    original = write_tiny_gguf(tiny_path, bias=True, qtypes={})
    weights = load_model(tiny_path, progress=False).weights
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias"):
        assert torch.equal(weights[name], torch.from_numpy(original[name])), name


def test_rope_scaling_from_rope_freqs_tensor(tiny_path):
    scaling = RopeScaling(factor=8.0, original_max_position_embeddings=64)
    factors = np.array(llama3_rope_factors(scaling, HEAD_DIM, 50000.0), dtype=np.float32)
    assert 1.0 < factors.max() and factors.min() == 1.0  # the tiny head spans both regimes
    write_tiny_gguf(tiny_path, extra_tensors={"rope_freqs.weight": factors},
                    extra={"llama.rope.scaling.original_context_length": 64})
    loaded = load_model(tiny_path, progress=False)
    assert loaded.config.rope_scaling == scaling
    assert "rope_freqs.weight" not in loaded.weights


def test_rope_scaling_from_metadata_keys(tiny_path):
    write_tiny_gguf(tiny_path, extra={"llama.rope.scaling.type": "llama3", "llama.rope.scaling.factor": 32.0,
                                      "llama.rope.scaling.original_context_length": 8192})
    assert load_model(tiny_path, progress=False).config.rope_scaling == RopeScaling(factor=32.0)


def test_unsupported_rope_scaling_is_named(tiny_path):
    write_tiny_gguf(tiny_path, extra={"llama.rope.scaling.type": "mrope", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(ModelLoadError, match=r"llama\.rope\.scaling\.type = 'mrope' is not supported"):
        load_model(tiny_path, progress=False)


def test_yarn_and_linear_rope_scaling_from_metadata_keys(tiny_path):
    write_tiny_gguf(tiny_path, extra={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                      "llama.rope.scaling.original_context_length": 512})
    assert load_model(tiny_path, progress=False).config.rope_scaling == RopeScaling(
        factor=4.0, rope_type="yarn", original_max_position_embeddings=512)
    write_tiny_gguf(tiny_path, extra={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    assert load_model(tiny_path, progress=False).config.rope_scaling == RopeScaling(
        factor=2.0, rope_type="linear", original_max_position_embeddings=2048)


def test_fingerprint_is_stable_and_tracks_content(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_tiny_gguf(a, seed=0)
    write_tiny_gguf(b, seed=1)
    first = load_model(a, progress=False).fingerprint
    assert len(first) == 64
    assert load_model(a, progress=False).fingerprint == first
    assert load_model(b, progress=False).fingerprint != first


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match=r"broken\.gguf: not a readable GGUF file"):
        load_model(path, progress=False)


def test_truncated_file_is_a_clear_error(tiny_path, tmp_path):
    write_tiny_gguf(tiny_path)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_path.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match=r"truncated\.gguf"):
        load_model(truncated, progress=False)


def test_missing_metadata_key_is_named(tiny_path):
    write_tiny_gguf(tiny_path, skip_keys=("attention.head_count",))
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf: metadata key llama\.attention\.head_count is missing"):
        load_model(tiny_path, progress=False)


def test_unknown_architecture_is_named(tiny_path):
    write_tiny_gguf(tiny_path, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"general\.architecture 'gpt2' is not supported"):
        load_model(tiny_path, progress=False)


def test_unsupported_quant_type_names_the_tensor(tiny_path, monkeypatch):
    import engine.gguf_loader

    write_tiny_gguf(tiny_path, qtypes={**DEFAULT_QTYPES, "ffn_up": Q.Q5_0})
    without_q5_0 = tuple(t for t in engine.gguf_loader.supported_types() if t != Q.Q5_0)
    monkeypatch.setattr(engine.gguf_loader, "supported_types", lambda: without_q5_0)
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.ffn_up\.weight has GGML type Q5_0, which is not "
                                             r"supported"):
        load_model(tiny_path, progress=False)


def test_unknown_tensor_is_named(tiny_path):
    write_tiny_gguf(tiny_path, extra_tensors={"blk.0.attn_rot_embd": np.zeros(4, dtype=np.float32)})
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.attn_rot_embd is not part of"):
        load_model(tiny_path, progress=False)


def test_load_model_rejects_other_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model(tmp_path / "missing.gguf")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match=r"expected a \.gguf file or a Hugging Face model directory"):
        load_model(other)


def test_load_gguf_directly_matches_load_model(tiny_path):
    write_tiny_gguf(tiny_path)
    assert load_gguf(tiny_path, progress=False).fingerprint == load_model(tiny_path, progress=False).fingerprint


# K-quants: gguf cannot quantize them, so blocks are encoded here from the ggml block layouts, with values
# chosen to be exact in float32; this checks the loader against ggml's formulas, not against gguf itself.

def _encode_q4_k(q: np.ndarray, scales: np.ndarray, mins: np.ndarray, d: float, dmin: float) -> np.ndarray:
    """One block_q4_K: value[i] = d * scales[i // 32] * q[i] - dmin * mins[i // 32] (q 0..15, scales/mins 0..63)."""
    packed = np.zeros(12, dtype=np.uint8)
    for j in range(4):
        packed[j] = scales[j] | ((scales[j + 4] >> 4) << 6)
        packed[j + 4] = mins[j] | ((mins[j + 4] >> 4) << 6)
        packed[j + 8] = (scales[j + 4] & 0xF) | ((mins[j + 4] & 0xF) << 4)
    qs = np.zeros(128, dtype=np.uint8)
    for chunk in range(4):
        for lane in range(32):
            qs[32 * chunk + lane] = q[64 * chunk + lane] | (q[64 * chunk + 32 + lane] << 4)
    header = np.array([d, dmin], dtype=np.float16).view(np.uint8)
    return np.concatenate([header, packed, qs])


def _encode_q6_k(q: np.ndarray, scales: np.ndarray, d: float) -> np.ndarray:
    """One block_q6_K: value[i] = d * scales[i // 16] * (q[i] - 32) (q 0..63, scales int8)."""
    ql, qh = np.zeros(128, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    for half in range(2):
        base = 128 * half
        for lane in range(32):
            a, b, c, e = (q[base + lane + 32 * k] for k in range(4))
            ql[64 * half + lane] = (a & 0xF) | ((c & 0xF) << 4)
            ql[64 * half + lane + 32] = (b & 0xF) | ((e & 0xF) << 4)
            qh[32 * half + lane] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
    return np.concatenate([ql, qh, scales.astype(np.int8).view(np.uint8), np.array([d], np.float16).view(np.uint8)])


def _write_single_tensor(path, name, raw: np.ndarray, qtype: Q, rows: int) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor(name, raw.reshape(rows, -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_q4_k_blocks_dequantize_to_ggml_values(tmp_path):
    rng = np.random.default_rng(1)
    rows, blocks, expected = 2, [], []
    for _ in range(rows):
        q = rng.integers(0, 16, 256, dtype=np.uint8)
        scales, mins = rng.integers(0, 64, 8, dtype=np.uint8), rng.integers(0, 64, 8, dtype=np.uint8)
        blocks.append(_encode_q4_k(q, scales, mins, 0.5, 0.25))
        expected.append(0.5 * np.repeat(scales, 32) * q.astype(np.float32) - 0.25 * np.repeat(mins, 32))
    path = tmp_path / "q4k.gguf"
    _write_single_tensor(path, "t", np.concatenate(blocks), Q.Q4_K, rows)
    got = dequantize_tensor(GGUFReader(path).tensors[0], torch.float32)
    assert torch.equal(got, torch.from_numpy(np.stack(expected).astype(np.float32)))


def test_q6_k_blocks_dequantize_to_ggml_values(tmp_path):
    rng = np.random.default_rng(2)
    rows, blocks, expected = 3, [], []
    for _ in range(rows):
        q = rng.integers(0, 64, 256, dtype=np.uint8)
        scales = rng.integers(-128, 128, 16).astype(np.int8)
        blocks.append(_encode_q6_k(q, scales, 0.125))
        expected.append(0.125 * np.repeat(scales.astype(np.float32), 16) * (q.astype(np.float32) - 32))
    path = tmp_path / "q6k.gguf"
    _write_single_tensor(path, "t", np.concatenate(blocks), Q.Q6_K, rows)
    got = dequantize_tensor(GGUFReader(path).tensors[0], torch.float32)
    assert tuple(got.shape) == (rows, 256)
    assert torch.equal(got, torch.from_numpy(np.stack(expected).astype(np.float32)))
