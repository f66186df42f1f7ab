"""The matmuls a kept GGUF weight runs through (engine.quant.make_linear over engine.gguf_blocks' weights)
against dequantize-then-matmul in float32: every kept type, both the small-batch path and the GEMM path, on
inference-mode float32 activations as the engine makes them."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from test_gguf_blocks import encoded, reference

from engine import quant
from engine.gguf_blocks import KEPT_TYPES, packed_weight
from engine.quant import Int4Linear, Int8Linear, PackedLinear, make_linear
from engine.weight_memory import held_bytes

OUT, IN = 128, 512  # two tiles of int4pack's 64 rows (AVX512), two K-quant super-blocks per row
CPU = torch.device("cpu")
KIND = {Q.Q4_0: Int4Linear, Q.Q4_1: Int4Linear, Q.Q4_K: Int4Linear, Q.Q8_0: Int8Linear, Q.Q5_0: Int8Linear,
        Q.Q5_1: Int8Linear, Q.Q5_K: Int8Linear, Q.Q6_K: Int8Linear, Q.F16: PackedLinear, Q.BF16: PackedLinear}
# Relative error of the output against F.linear over gguf's float32 dequantization, measured at 1 and 96 rows:
# int4 0.2-0.4% (bfloat16 activations and output under 64 rows, bfloat16 scales and zeros: < 1e-3 beyond),
# int8 0.3-0.6% (one scale per row instead of per 32 inputs), 16-bit weights ~1e-7 (summation order).
REL_TOL = {Int4Linear: 0.01, Int8Linear: 0.015, PackedLinear: 1e-5}


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("qtype", KEPT_TYPES, ids=lambda t: t.name)
def test_kept_weight_matmul_equals_dequantize_then_matmul(qtype, monkeypatch):
    data = encoded(qtype, (OUT, IN), seed=11)
    expected = reference(data, qtype)                                    # [OUT, IN] float32, gguf's values
    torch.manual_seed(0)  # x: one row's error varies with x (1.7% seen for Q5_K once), so the same x every run
    with torch.inference_mode():
        lin = make_linear(packed_weight(data, qtype, (OUT, IN)), None, None, torch.float32, CPU)
        assert type(lin) is KIND[qtype]
        for rows, gemm in ((1, False), (96, False), (96, True)):         # int4pack / int8pack, then the GEMM path
            monkeypatch.setattr(quant, "INT4PACK_MAX_ROWS", 0 if gemm else sys.maxsize)
            monkeypatch.setattr(quant, "INT8PACK_MAX_ROWS", 0 if gemm else 32)
            x = torch.randn(rows, IN)
            out = lin.forward(x)
            assert out.dtype == torch.float32 and out.shape == (rows, OUT)
            assert rel_error(out, F.linear(x, expected)) < REL_TOL[type(lin)], (rows, gemm)
        monkeypatch.undo()
        ids = torch.tensor([3, 0, OUT - 1, 64, 3])
        assert rel_error(lin.embed(ids), expected[ids]) < REL_TOL[type(lin)]
        x = torch.randn(2, IN)
        assert rel_error(lin.logits(x), F.linear(x, expected)) < REL_TOL[type(lin)]
    # Memory: a Q4_1 file's bytes exactly; Q4_0's and Q4_K's 18 bytes per 32 weights become 20 (a zero per
    # group); Q8_0's 34 bytes become 32 and a scale per row; 5- and 6-bit codes take a byte each.
    if qtype in (Q.Q4_1, Q.F16, Q.BF16):
        assert lin.nbytes == data.nbytes
    bound = 1.5 if qtype in (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K) else 1.12
    assert lin.nbytes <= bound * data.nbytes
    assert held_bytes(lin) <= bound * data.nbytes


def test_int4_codes_are_stored_once_and_read_back_exactly():
    """Q4_1 codes held only in int4pack's tiled layout (no second copy for the GEMM path) read back as the
    file's codes, and its bfloat16 table is the file's float16 scale and zero rounded once."""
    data = encoded(Q.Q4_1, (OUT, IN), seed=12)
    weight = packed_weight(data, Q.Q4_1, (OUT, IN))
    lin = Int4Linear.from_grouped(weight)
    assert lin.nibbles is None and lin.block_rows in (32, 64)
    assert torch.equal(lin.codes(), weight.unpacked_codes())
    assert torch.equal(lin.codes(slice(64, 128)), weight.unpacked_codes()[64:128])
    zero = weight.offset.float() + 8 * weight.scale.float()
    assert torch.equal(lin.scale, weight.scale.float().bfloat16().float())
    assert torch.equal(lin.zero, zero.bfloat16().float())
    # bfloat16 keeps 8 significant bits: each weight moves by at most 2^-9 of |scale| * 8 + |zero|.
    bound = (weight.scale.float().abs() * 8 + zero.abs()) * 2**-8
    err = (lin.dequantize() - reference(data, Q.Q4_1)).abs().view(OUT, -1, 32).amax(-1)
    assert (err <= bound).all()


def test_shapes_int4pack_cannot_tile_keep_nibbles_and_shards_stay_exact():
    """48 rows (not a multiple of the kernel's tile, as a tensor-parallel shard can be): the codes are kept as
    nibbles as well, and both paths still equal the dequantized matmul."""
    data = encoded(Q.Q4_0, (48, IN), seed=13)
    expected = reference(data, Q.Q4_0)
    with torch.inference_mode():
        lin = make_linear(packed_weight(data, Q.Q4_0, (48, IN)), None, None, torch.float32, CPU)
        assert isinstance(lin, Int4Linear) and lin.nibbles is not None
        assert torch.equal(lin.codes(), packed_weight(data, Q.Q4_0, (48, IN)).unpacked_codes())
        for rows in (1, 65):
            x = torch.randn(rows, IN)
            assert rel_error(lin.forward(x), F.linear(x, expected)) < REL_TOL[Int4Linear]


def test_kept_int4_rows_do_not_depend_on_the_batch():
    """Every CPU batch takes int4pack_mm, whose rows are computed on their own: a prompt's rows computed in one
    batch equal them computed one at a time or in other groupings, bit for bit (what makes a prefix-cache hit,
    whose suffix is a short batch, give the cold prompt's tokens)."""
    data = encoded(Q.Q4_1, (OUT, IN), seed=14)
    with torch.inference_mode():
        lin = make_linear(packed_weight(data, Q.Q4_1, (OUT, IN)), None, None, torch.float32, CPU)
        x = torch.randn(200, IN)
        whole = lin.forward(x)
        assert torch.equal(whole, torch.cat([lin.forward(x[i:i + 1]) for i in range(200)]))
        assert torch.equal(whole, torch.cat([lin.forward(x[:7]), lin.forward(x[7:150]), lin.forward(x[150:])]))
