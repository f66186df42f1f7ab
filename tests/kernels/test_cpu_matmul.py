"""kernels.cpu_matmul (the native int4 / int8 CPU matmuls) against the integer math of its contract, written
here from the definition, on the default model's own layer-0 weights (its Q4_1 codes, its Q8_0 table as the
int8 LM head) and activations made from them under torch.inference_mode; every ISA path this CPU has; then the
engine with cpu_matmul="native" end to end, and the fallback when no compiler exists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.quant import Int4Linear, _int4pack_block_rows
from engine.sampling_params import SamplingParams
from kernels import cpu_matmul as cm
from tests.batching import assert_same_alone_as_batched

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not cm.available(), reason="native CPU matmul kernels could not be built here")
ISAS = [cm.ISA_SCALAR, cm.ISA_AVX2, cm.ISA_AVX512, cm.ISA_AVX512_VBMI]
BLOCK_ROWS = _int4pack_block_rows()
# Float sums over groups run in another order on each path (and in float64 here): measured <= 3e-7 of the
# largest output.
SUM_ORDER_RTOL = 1e-5


def isa_param(isa: int):
    name = cm.isa_name("q4", isa)
    return pytest.param(isa, id=name, marks=pytest.mark.skipif(
        cm.available() and isa > cm.best_isa(), reason=f"this CPU has no {name} path"))


@pytest.fixture(scope="module")
def llm(default_model_path):
    from engine.llm import LLM

    return LLM(model=str(default_model_path), dtype="float32", kv_cache_memory=32 * 2**20, progress=False,
               keep_quantized_weights=True, cpu_matmul="native")


def layer0_activations(llm):
    """(model, layer 0, x [7, 576], x_down [7, 1536]): inference-mode activations of a real prompt at layer 0's
    inputs (its normed embeddings; SiLU(gate) * up of those, the down projection's input)."""
    model = llm.engine.runner.model
    layer = model.layers[0]
    ids = torch.tensor(llm.tokenizer.encode("The capital of France is Paris, and the river is the Seine."))[:7]
    with torch.inference_mode():
        h = model.embed.embed(ids)                                                   # [7, 576]
        x = F.rms_norm(h, (h.shape[1],), eps=1e-5)
        gate, up = (x @ layer.gate_up.dequantize().t()).chunk(2, dim=-1)
        x_down = F.silu(gate) * up                                                   # [7, 1536]
    return model, layer, x, x_down


@pytest.fixture(scope="module")
def layer0(llm):
    """name -> (linear, rows, x): the default model's real layer shapes over its layer-0 weights, with
    inference-mode activations (normed embeddings of a real prompt; SiLU(gate) * up of those for down)."""
    model, layer, x, x_down = layer0_activations(llm)
    return {"q 576x576": (layer.qkv, slice(0, 576), x), "k 192x576": (layer.qkv, slice(576, 768), x),
            "gate 1536x576": (layer.gate_up, slice(0, 1536), x), "down 576x1536": (layer.down, slice(None), x_down),
            "o 576x576": (layer.o, slice(None), x), "lm_head 49152x576": (model.lm_head, slice(None), x)}


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's activation rounding: per 32, dx = absmax / 127, xq = round_half_even(x * (1 / dx))."""
    g = x.float().view(x.shape[0], -1, cm.GROUP)
    dx = g.abs().amax(dim=-1) / 127
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    return torch.round(g * inv[..., None]).clamp_(-127, 127), dx                    # [M, G, 32], [M, G]


def q4_reference(x: torch.Tensor, codes: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """y = sum_g (d * dx) * isum + m * (dx * sumq), m = z - 8 d, isum exact (float64 holds it); codes [N, K],
    scale_zero [G, N, 2] (int4pack's table)."""
    q = codes.view(codes.shape[0], -1, cm.GROUP).double()                           # [N, G, 32]
    xq, dx = quantize_x(x)
    isum = torch.einsum("mgj,ngj->mng", xq.double(), q)
    d, z = scale_zero[..., 0].t().float(), scale_zero[..., 1].t().float()           # [N, G]
    m = z - 8 * d
    sx = dx * xq.sum(dim=-1)                                                         # [M, G] float32
    return ((d[None] * dx[:, None]).double() * isum + (m[None] * sx[:, None]).double()).sum(dim=-1)


def q8_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = ws * sum_g dx * isum, isum exact."""
    xq, dx = quantize_x(x)
    w = qweight.view(qweight.shape[0], -1, cm.GROUP).double()
    isum = torch.einsum("mgj,ngj->mng", xq.double(), w)
    return scale.double()[None] * (dx[:, None].double() * isum).sum(dim=-1)


def kernel_args(linear, rows: slice):
    """(kind, weight, table) as the kernel takes rows `rows` of a linear (int4: whole blocks of int4pack's layout)."""
    if isinstance(linear, Int4Linear):
        start, stop, _ = rows.indices(linear.shape[0])
        half = linear.shape[1] // 2
        packed = linear.packed.view(-1)[start * half:stop * half].view(stop - start, half)
        return "q4", packed, linear.scale_zero[:, start:stop].contiguous()
    return "q8", linear.qweight[rows].contiguous(), linear.scale[rows].contiguous()


def run(kind: str, x, weight, table, **kw):
    if kind == "q4":
        return cm.q4_matmul(x, weight, table, BLOCK_ROWS, **kw)
    return cm.q8_matmul(x, weight, table, **kw)


def reference(linear, rows: slice, x):
    if isinstance(linear, Int4Linear):
        start, stop, _ = rows.indices(linear.shape[0])
        return q4_reference(x, linear.codes(rows), linear.scale_zero[:, start:stop])
    return q8_reference(x, linear.qweight[rows], linear.scale[rows])


@pytest.mark.parametrize("isa", [isa_param(i) for i in ISAS])
@pytest.mark.parametrize("name", ["q 576x576", "k 192x576", "gate 1536x576", "down 576x1536", "lm_head 49152x576"])
def test_kernel_equals_the_integer_reference(layer0, name, isa):
    linear, rows, x = layer0[name]
    kind, weight, table = kernel_args(linear, rows)
    x = x[:5] if isa != cm.ISA_SCALAR or kind == "q4" else x[:3]                     # odd M
    expected = reference(linear, rows, x)
    got = run(kind, x, weight, table, isa=isa)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert (got.double() - expected).abs().max() <= SUM_ORDER_RTOL * expected.abs().max()


@pytest.mark.parametrize("name", ["q 576x576", "down 576x1536", "lm_head 49152x576"])
def test_rows_are_batch_invariant(layer0, name):
    """A row's result is bit for bit the same alone, in a batch of 7 (tiles of 4 + 3) and on 2 threads."""
    linear, rows, x = layer0[name]
    kind, weight, table = kernel_args(linear, rows)
    together = run(kind, x, weight, table, nthreads=1)
    for i in range(x.shape[0]):
        assert torch.equal(run(kind, x[i:i + 1], weight, table, nthreads=1)[0], together[i])
    assert torch.equal(run(kind, x, weight, table, nthreads=2), together)


def varied_x(g: torch.Generator, k: int) -> torch.Tensor:
    """[35, k]: values spanning 2^-20 .. 2^6 with exact zeros, an all-zero group (row 3) and a group of ~1e-38 with
    a zero (row 4: its scale is below 2^-128, the reciprocal infinite, 0 * inf NaN)."""
    x = torch.randn(35, k, generator=g) * torch.pow(2.0, torch.randint(-20, 7, (35, k), generator=g).float())
    x[x.abs() < 1e-5] = 0.0
    x[3, 32:64] = 0.0
    x[4, 64:96] = torch.linspace(-1e-38, 1e-38, 32)
    x[4, 70] = 0.0
    return x


@pytest.mark.parametrize("block_rows", [32, 64])
@pytest.mark.parametrize("isa", [isa_param(i) for i in (cm.ISA_AVX2, cm.ISA_AVX512, cm.ISA_AVX512_VBMI)])
def test_q4_every_path_gives_the_scalar_bits_at_both_block_sizes(isa, block_rows):
    """Random codes read as int4pack's layout of 32-row blocks (torch's AVX2 packing) or 64-row ones, scales and
    zeros of mixed sign and size, x from varied_x: 1-7 rows (AVX512 spreads the codes in registers every pass) and
    8-35 (from 8: into a tile once a call; AVX2 from 10, by blocks of 4 rows: 13 and 35 end in 1 and 3), 1 and 3
    threads (10 half-blocks: a block split between threads), the scalar path's bits; a planted change of one code
    moves only its own channel's outputs."""
    g = torch.Generator().manual_seed(11)
    n, k = 5 * block_rows, 224
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    table = (torch.randn(k // 32, n, 2, generator=g) * torch.rand(k // 32, n, 2, generator=g).pow(4) * 4).bfloat16()
    x = varied_x(g, k)
    expected = cm.q4_matmul(x, packed, table, block_rows, isa=cm.ISA_SCALAR, nthreads=1)
    for rows in (1, 2, 3, 7, 8, 13, 35):
        for nthreads in (1, 3):
            got = cm.q4_matmul(x[:rows], packed, table, block_rows, isa=isa, nthreads=nthreads)
            assert torch.equal(got, expected[:rows]), (rows, nthreads)
    planted = packed.clone()
    planted.view(-1, k, block_rows // 2)[1, 0, 5] ^= 0x10     # block 1, input 0, byte 5: its high nibble's channel
    moved = (cm.q4_matmul(x, planted, table, block_rows, isa=isa) != expected).any(dim=0).nonzero().flatten()
    assert moved.tolist() == [block_rows + block_rows // 2 + 5]


@pytest.mark.parametrize("block_rows", [32, 64])
@pytest.mark.parametrize("isa", [isa_param(i) for i in (cm.ISA_AVX2, cm.ISA_AVX512, cm.ISA_AVX512_VBMI)])
def test_q4_the_largest_sums_do_not_saturate(isa, block_rows):
    """Every code 15 against x rows that quantize to +127 or -127 everywhere (and one of each sign by halves):
    the largest integer sums a group can make (32 x 15 x 127), which the AVX2 kernels add up in int16 lanes
    part of the way. Rows 1-2 (straight from the codes), 3 and 9 (a tile), the scalar path's bits."""
    n, k = 2 * block_rows, 128
    packed = torch.full((n, k // 2), 0xFF, dtype=torch.uint8)
    table = torch.ones(k // 32, n, 2).bfloat16()
    signs = torch.tensor([1.0, -1.0, 1.0])
    x = signs.repeat(5)[:, None].expand(15, k).clone()
    x[2, k // 2:] = -1.0
    expected = cm.q4_matmul(x, packed, table, block_rows, isa=cm.ISA_SCALAR, nthreads=1)
    assert expected[0, 0].item() == k * 15 * 1.0 + k * 1.0 - 8.0 * k  # x = 1: sum of (15 - 8) d + z over k inputs
    for rows in (1, 2, 3, 9, 15):  # 15: AVX2's tile (from 10 rows), its last block of 4 rows 3
        got = cm.q4_matmul(x[:rows], packed, table, block_rows, isa=isa, nthreads=1)
        assert torch.equal(got, expected[:rows]), rows


@pytest.mark.parametrize("isa", [isa_param(i) for i in (cm.ISA_AVX2, cm.ISA_AVX512, cm.ISA_AVX512_VBMI)])
def test_q8_every_path_gives_the_scalar_bits(isa):
    """int8 weights of every value in [-127, 127] over 83 output channels (a last unit of 19: a partial slice) and
    160 inputs (a last part of 8 dwords in the AVX512 transpose), scales of mixed sign, x as for q4: 1-35 rows, 1
    and 3 threads, the scalar path's bits; a planted weight moves only its own channel's outputs."""
    g = torch.Generator().manual_seed(13)
    n, k = 83, 160
    qweight = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4)
    x = varied_x(g, k)
    expected = cm.q8_matmul(x, qweight, scale, isa=cm.ISA_SCALAR, nthreads=1)
    for rows in (1, 2, 3, 4, 6, 35):  # AVX2: |w| times x's sign up to 3 rows, int16 products from 4
        for nthreads in (1, 3):
            got = cm.q8_matmul(x[:rows], qweight, scale, isa=isa, nthreads=nthreads)
            assert torch.equal(got, expected[:rows]), (rows, nthreads)
    planted = qweight.clone()
    planted[70, 150] = -planted[70, 150] if planted[70, 150] else 5
    moved = (cm.q8_matmul(x, planted, scale, isa=isa) != expected).any(dim=0).nonzero().flatten()
    assert moved.tolist() == [70]


@pytest.mark.parametrize("isa", [isa_param(i) for i in (cm.ISA_AVX2, cm.ISA_AVX512, cm.ISA_AVX512_VBMI)])
def test_q8_the_largest_sums_are_exact(isa):
    """Weights all +127 or all -127 by halves against x rows that quantize to +127 or -127: each 32-input sum at
    its largest magnitude (32 x 127 x 127), on every path and row count, the scalar path's bits."""
    n, k = 80, 128
    qweight = torch.full((n, k), 127, dtype=torch.int8)
    qweight[n // 2:] = -127
    scale = torch.ones(n)
    signs = torch.tensor([1.0, -1.0, 1.0])
    x = signs.repeat(3)[:, None].expand(9, k).clone()
    x[2, k // 2:] = -1.0
    expected = cm.q8_matmul(x, qweight, scale, isa=cm.ISA_SCALAR, nthreads=1)
    assert expected[0, 0].item() == 127.0 * k  # x quantizes to 127 at scale 1 / 127
    for rows in (1, 2, 3, 4, 9):
        got = cm.q8_matmul(x[:rows], qweight, scale, isa=isa, nthreads=1)
        assert torch.equal(got, expected[:rows]), rows


@pytest.mark.parametrize("name", ["gate 1536x576", "down 576x1536", "lm_head 49152x576"])
def test_within_the_activation_rounding_of_the_float_matmul(layer0, name):
    """|y - x @ W.T| <= sum_g (dx_g / 2) * sum_j |W_gj| (each x moves by at most half its step), plus float
    rounding: the documented error of int8 activations, against the dequantized float32 weights."""
    linear, rows, x = layer0[name]
    w = linear.dequantize(torch.float32)[rows]
    _, dx = quantize_x(x)
    bound = (dx[:, None, :] / 2 * w.abs().view(w.shape[0], -1, cm.GROUP).sum(-1)[None]).sum(-1)  # [M, N]
    err = (run(*kernel_args(linear, rows)[:1], x, *kernel_args(linear, rows)[1:]) - x @ w.t()).abs()
    assert (err <= bound * 1.001 + 1e-4).all()
    assert (err.norm() / (x @ w.t()).norm()) < 0.02  # measured 0.55-0.6% (layers), 0.06% (head)


def test_noncontiguous_x_is_copied_and_bad_weights_are_rejected(layer0):
    linear, rows, x = layer0["o 576x576"]
    kind, weight, table = kernel_args(linear, rows)
    wide = torch.cat([x, x], dim=1)[:, ::2]                                          # a strided [7, 576] view
    assert not wide.is_contiguous()
    assert torch.equal(run(kind, wide, weight, table), run(kind, wide.contiguous(), weight, table))
    assert torch.equal(run(kind, x.double(), weight, table), run(kind, x, weight, table))
    with pytest.raises(ValueError, match="packed"):
        cm.q4_matmul(x, weight.t().contiguous().t(), table, BLOCK_ROWS)  # not contiguous
    with pytest.raises(ValueError, match="scale_zero"):
        cm.q4_matmul(x, weight, table.float(), BLOCK_ROWS)
    with pytest.raises(ValueError, match="block_rows"):
        cm.q4_matmul(x, weight, table, 48)
    with pytest.raises(ValueError, match="x must be"):
        cm.q4_matmul(x[:, :64], weight, table, BLOCK_ROWS)
    assert cm.q4_matmul(x[:0], weight, table, BLOCK_ROWS).shape == (0, 576)


def test_a_chain_computes_what_its_matmuls_compute_one_by_one(layer0):
    """MatmulChain (pd_matmul_chain: the matmuls of a sequence in one C call, as the native decoder calls them)
    writes each output that matmul's own call gives, bit for bit, every weight kind the model has in one chain;
    an x of another width or a mixed row count is refused before any call."""
    calls = [(lin.native, x) for name, (lin, _, x) in layer0.items() if name != "k 192x576"]
    assert len({mm.kind for mm, _ in calls}) > 1  # int4 layers and the int8 LM head
    chain = cm.MatmulChain(calls)
    chain()
    for (mm, x), y in zip(calls, chain.outputs):
        assert torch.equal(y, mm(x))
    mm, x = calls[0]
    with pytest.raises(ValueError, match=r"calls\[1\] x"):
        cm.MatmulChain([(mm, x), (mm, x[:3])])
    with pytest.raises(ValueError, match="at least one"):
        cm.MatmulChain([])


def test_linears_use_the_kernel_and_keep_their_other_operations(layer0):
    """Int4Linear / Int8Linear with cpu_matmul="native": forward adds the bias to the kernel's output, which reads
    the codes where int4pack's kernel does (the same weights: dequantize, embed); logits recompute the top-k in
    float32."""
    linear, _, x = layer0["o 576x576"]
    w = linear.dequantize(torch.float32)
    torch_layout = Int4Linear.quantize(w, bias=torch.ones(576))
    native = Int4Linear(torch_layout.codes(), torch_layout.scale, torch_layout.zero, torch.ones(576),
                        cpu_matmul="native")
    assert native.native is not None and native.native._weight is native.packed and native.nibbles is None
    assert torch.equal(native.dequantize(), torch_layout.dequantize())
    ids = torch.tensor([0, 5, 63, 64, 575])
    assert torch.equal(native.embed(ids), torch_layout.embed(ids))
    assert torch.equal(native.forward(x), native.native(x) + 1)
    head, _, _ = layer0["lm_head 49152x576"]
    top = head.logits(x).topk(4, dim=-1)
    for i in range(x.shape[0]):
        exact = head.dequantize(torch.float32, top.indices[i]) @ x[i]
        assert torch.allclose(top.values[i], exact, rtol=1e-5, atol=1e-5)


def test_engine_with_native_kernels_answers_paris(llm):
    """Kept codes + native kernels end to end. (The chat prompt "What is the capital of France?" is a near
    tie at its first token even in float32, 25.33 vs 25.24: int8 activations may flip it, as llama.cpp's.)"""
    model = llm.engine.runner.model
    assert all(lin.native is not None for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up,
                                                                           layer.down))
    assert model.lm_head.native is not None
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.outputs[0].text.startswith(" Paris")


def test_native_engine_gives_a_sequence_the_same_tokens_and_logprobs_alone_as_in_a_batch(llm):
    """As with torch's kernels (tests/e2e/test_default_model.py), one thread: the native linears compute each row
    on its own, so a sequence's tokens and logprobs do not depend on what it is batched with."""
    assert_same_alone_as_batched(llm, max_tokens=12)


@pytest.mark.parametrize("choice", ["native", "native-bf16"])
def test_no_compiler_falls_back_to_torch_kernels(tmp_path, choice):
    """CC names no compiler and the cache is empty: one warning, available() is False, and a linear asked for
    a native kernel (native-bf16 is the default) runs torch's."""
    code = ("import logging, torch; logging.basicConfig(level=logging.WARNING)\n"
            "from kernels import cpu_matmul as cm; from engine.quant import Int4Linear\n"
            f"lin = Int4Linear.quantize(torch.randn(64, 64), cpu_matmul={choice!r})\n"
            "assert not cm.available() and lin.native is None\n"
            "print(lin.forward(torch.randn(2, 64)).shape)\n")
    env = {**os.environ, "CC": "/nonexistent/cc", "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch.Size([2, 64])"
    warnings = [line for line in done.stderr.splitlines() if "native CPU matmul kernels unavailable" in line]
    assert len(warnings) == 1 and "/nonexistent/cc" in warnings[0]
