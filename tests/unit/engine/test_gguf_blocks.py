"""GGUF tensors kept in their encoding (engine.gguf_blocks, engine.quant's GroupedWeight / HalfWeight /
PackedLinear) on small random tensors encoded by the `gguf` package."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from engine.gguf_blocks import KEPT_TYPES, packed_weight
from engine.gguf_loader import unpermute_qk
from engine.packed_weight import GroupedWeight, HalfWeight, cat_rows
from engine.quant import DequantWorkspace, Int4Linear, Int8Linear, PackedLinear, make_linear
from engine.weight_memory import held_bytes

OUT, IN = 48, 512  # 2 K-quant super-blocks per row


def encoded(qtype: Q, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Random float32 values as `qtype` bytes: gguf's quantizer where it has one; else (K-quants) random bytes
    with every float16 field kept finite (every bit pattern of their codes and 6-bit scales is valid)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape, dtype=np.float32) * 0.1
    if qtype in (Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        return gguf.quants.quantize(values, qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, size=(shape[0], shape[1] // block_size * type_size), dtype=np.uint8) & np.uint8(0x3B)


def reference(data: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))


@pytest.mark.parametrize("qtype", KEPT_TYPES, ids=lambda t: t.name)
def test_kept_type_dequantizes_to_gguf_exactly_and_its_matmul_is_the_float_matmul(qtype):
    data = encoded(qtype, (OUT, IN))
    weight = packed_weight(data, qtype, (OUT, IN))
    expected = reference(data, qtype)
    assert isinstance(weight, HalfWeight if qtype in (Q.F16, Q.BF16) else GroupedWeight)
    assert weight.shape == (OUT, IN)
    assert torch.equal(weight.dequantize(torch.float32), expected)  # bit for bit: the same float32 operations
    # In memory: the file's bytes for the 4-bit and 8-bit types, at most 2x for 5/6-bit codes held as int8.
    assert weight.nbytes <= 2 * data.nbytes
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16):
        assert weight.nbytes == data.nbytes
    with torch.inference_mode():  # production-shaped activations, as the engine makes them
        x = torch.randn(5, IN)
        lin = PackedLinear(weight, workspace=DequantWorkspace(num_elements=IN * 16))  # 3 chunks of 16 rows
        torch.testing.assert_close(lin.forward(x), F.linear(x, expected), rtol=1e-5, atol=1e-5)
        ids = torch.tensor([3, 0, 47, 3])
        assert torch.equal(lin.embed(ids), expected[ids])


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K, Q.F16], ids=lambda t: t.name)
def test_row_operations_on_codes_equal_those_on_the_float_weight(qtype):
    data = encoded(qtype, (OUT, IN), seed=1)
    weight, expected = packed_weight(data, qtype, (OUT, IN)), reference(data, qtype)
    assert torch.equal(unpermute_qk(weight, 4).dequantize(), unpermute_qk(expected, 4))
    parts = weight.split([16, 8, 24])
    assert [tuple(p.shape) for p in parts] == [(16, IN), (8, IN), (24, IN)]
    assert torch.equal(cat_rows(parts).dequantize(), expected)
    assert torch.equal(torch.cat([c.dequantize() for c in weight.chunk(3)]), expected)


def test_mixed_encodings_fuse_losslessly_as_int8_groups():
    """A Q4_K q with a Q6_K v (llama.cpp's *_M mixes) fuse into int8 codes in groups of 16."""
    q_data, v_data = encoded(Q.Q4_K, (32, IN), seed=2), encoded(Q.Q6_K, (16, IN), seed=3)
    fused = cat_rows([packed_weight(q_data, Q.Q4_K, (32, IN)), packed_weight(v_data, Q.Q6_K, (16, IN))])
    assert isinstance(fused, GroupedWeight) and (fused.bits, fused.group_size) == (8, 16)
    expected = torch.cat([reference(q_data, Q.Q4_K), reference(v_data, Q.Q6_K)])
    torch.testing.assert_close(fused.dequantize(), expected, rtol=0, atol=1e-6)  # mul/add order of the fold
    with_float = cat_rows([packed_weight(q_data, Q.Q4_K, (32, IN)), reference(v_data, Q.Q6_K)])
    assert isinstance(with_float, torch.Tensor)
    torch.testing.assert_close(with_float, expected, rtol=0, atol=1e-6)


def test_make_linear_keeps_packed_weights_or_requantizes_their_values():
    data = encoded(Q.Q4_1, (OUT, IN), seed=4)
    weight, expected = packed_weight(data, Q.Q4_1, (OUT, IN)), reference(data, Q.Q4_1)
    kept = make_linear(weight, None, None, torch.float32, torch.device("cpu"))
    assert isinstance(kept, Int4Linear) and kept.nbytes == data.nbytes  # its codes, on int4pack_mm
    int8 = make_linear(weight, None, "int8", torch.float32, torch.device("cpu"))
    assert torch.equal(int8.qweight, make_linear(expected, None, "int8", torch.float32,
                                                 torch.device("cpu")).qweight)


def test_held_bytes_counts_every_tensor_once():
    data = encoded(Q.Q8_0, (OUT, IN), seed=5)
    lin = PackedLinear(packed_weight(data, Q.Q8_0, (OUT, IN)))
    norm = torch.ones(IN)
    assert held_bytes(lin, lin, norm) == data.nbytes + norm.nbytes
    lin.forward(torch.randn(1, IN))                         # the workspace it dequantizes into is not a weight
    assert held_bytes(lin) == data.nbytes


def test_rows_not_a_whole_number_of_blocks_are_named():
    with pytest.raises(ValueError, match="not a multiple of Q4_K's block of 256"):
        packed_weight(encoded(Q.Q4_1, (4, 96)), Q.Q4_K, (4, 96))


def test_engine_over_kept_codes_equals_the_dequantized_engine(tmp_path):
    """A tiny GGUF mixing Q8_0, Q4_1, Q4_0, F16, BF16 and F32 matrices (untied head): the default engine keeps
    them packed (keep_quantized_weights) and generates the float engine's greedy tokens in less memory."""
    from tiny_gguf import write_tiny_gguf

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tied=False)
    engines = [LLM(model=str(path), dtype="float32", num_kv_blocks=32, block_size=4, progress=False,
                   keep_quantized_weights=keep) for keep in (True, False)]
    packed, floats = (llm.engine for llm in engines)
    model = packed.runner.model
    assert isinstance(model.embed, Int8Linear) and isinstance(model.lm_head, PackedLinear)  # Q8_0, F16
    assert isinstance(model.layers[0].gate_up, Int8Linear)  # Q4_1 gate with Q8_0 up: int8 groups
    assert packed.weight_memory_bytes < 0.6 * floats.weight_memory_bytes
    assert packed.file_tensor_bytes == floats.file_tensor_bytes
    assert packed.weight_memory_bytes < 1.3 * packed.file_tensor_bytes
    assert packed.fingerprint == floats.fingerprint  # the same weights
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = [llm.generate(["hello world", "the token"], params) for llm in engines]
    assert [o.outputs[0].token_ids for o in outputs[0]] == [o.outputs[0].token_ids for o in outputs[1]]
