"""kernels.cpu_matmul's bfloat16-activation kinds ("q4-bf16", "q8-bf16": EngineConfig.cpu_matmul="native-bf16")
against the float math of their contract written here from the definition (x rounded to bfloat16, the weights
(q - 8) * scale + zero / q * scale, the sum in float64), on the default model's own layer-0 codes (in int4pack's
layout) and LM head and inference-mode activations made from them, on every ISA path this CPU has (q4: the same
bits on all, vdpbf16ps's included); against torch's int4pack_mm / int8pack_mm (int8pack bit for bit where they
share an order); rows batch and thread invariant; then the engine end to end."""

from __future__ import annotations

import pytest
import torch

from engine import quant
from engine.quant import Int4Linear, Int8Linear
from engine.sampling_params import SamplingParams
from kernels import cpu_matmul as cm
from tests.batching import assert_same_alone_as_batched
from tests.kernels.test_cpu_matmul import layer0_activations

pytestmark = pytest.mark.skipif(not cm.available(), reason="native CPU matmul kernels could not be built here")
ISAS = [cm.ISA_SCALAR, cm.ISA_AVX2, cm.ISA_AVX512, cm.ISA_AVX512_BF16]
# Float32 sums of K products (in order, or in lanes) against the float64 sum: within a few K * 2^-24 of
# sum |x w| (measured <= 1.3e-7 of it here).
SUM_RTOL = 1e-5
LOGPROB_TOL = 0.05


def isa_param(isa: int):
    return pytest.param(isa, id=cm.ISA_NAMES[isa], marks=pytest.mark.skipif(
        cm.available() and isa > cm.best_isa("q4-bf16"), reason=f"this CPU has no {cm.ISA_NAMES[isa]} path"))


@pytest.fixture(scope="module")
def kept(default_model_path):
    """The default model's file read once with its codes kept, shared by the two engines below."""
    from engine.loader import load_model

    return load_model(default_model_path, torch.float32, progress=False, keep_quantized=True)


def kept_llm(path, loaded, cpu_matmul: str):
    from engine.llm import LLM

    return LLM(model=str(path), dtype="float32", kv_cache_memory=32 * 2**20, progress=False,
               keep_quantized_weights=True, cpu_matmul=cpu_matmul, loaded=loaded)


@pytest.fixture(scope="module")
def llm(default_model_path, kept):
    return kept_llm(default_model_path, kept, "native-bf16")


@pytest.fixture(scope="module")
def llm_torch(default_model_path, kept):
    return kept_llm(default_model_path, kept, "torch")


@pytest.fixture(scope="module")
def layer0(llm):
    """name -> (kind, weight, table, x): the default model's real shapes over its layer-0 Q4_1 codes and its Q8_0
    LM head, with inference-mode activations (normed embeddings of a real prompt; SiLU(gate) * up for down)."""
    model, layer, x, x_down = layer0_activations(llm)

    def q4(linear, start, stop, x):
        """Rows start .. stop - 1 (whole blocks) of an Int4Linear's int4pack layout, and their float32 weights."""
        half = linear.shape[1] // 2
        packed = linear.packed.view(-1)[start * half:stop * half].view(stop - start, half)
        table = linear.scale_zero[:, start:stop].contiguous()                        # [groups, rows, 2]
        w = linear.dequantize(torch.float32)[start:stop]
        return "q4-bf16", (packed, table, linear.block_rows), x, w

    head = model.lm_head
    return {"q 576x576": q4(layer.qkv, 0, 576, x), "k 192x576": q4(layer.qkv, 576, 768, x),
            "gate 1536x576": q4(layer.gate_up, 0, 1536, x), "down 576x1536": q4(layer.down, 0, 576, x_down),
            "lm_head 49152x576": ("q8-bf16", (head.qweight, head.scale), x, head.qweight.float() * head.scale[:, None])}


def run(kind: str, x, args, **kw):
    return (cm.q4_bf16_matmul if kind == "q4-bf16" else cm.q8_bf16_matmul)(x, *args, **kw)


@pytest.mark.parametrize("isa", [isa_param(i) for i in ISAS])
@pytest.mark.parametrize("name", ["q 576x576", "k 192x576", "gate 1536x576", "down 576x1536", "lm_head 49152x576"])
def test_kernel_equals_the_float_reference(layer0, name, isa):
    """Unrounded: the float64 sum of bf16(x) * w (w: Int4Linear.dequantize, or q * scale) within float32
    summation error; rounded: exactly that result rounded to bfloat16; x is rounded inside (a bfloat16-valued x
    gives the same bits); q4 sums in one order on every path (the scalar one's bits)."""
    kind, args, x, w = layer0[name]
    x = x[:5] if isa != cm.ISA_SCALAR else x[:3]                                     # odd M
    xb, w = x.bfloat16().double(), w.double()
    expected, scale = xb @ w.t(), xb.abs() @ w.abs().t()                             # [M, N]
    got = run(kind, x, args, isa=isa, round_output=False)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert ((got.double() - expected).abs() <= SUM_RTOL * scale + 1e-30).all()
    rounded = run(kind, x, args, isa=isa)
    assert torch.equal(rounded, got.bfloat16().float())
    assert torch.equal(run(kind, x.bfloat16().float(), args, isa=isa), rounded)
    if kind == "q4-bf16" and isa != cm.ISA_SCALAR:
        assert torch.equal(got, run(kind, x, args, isa=cm.ISA_SCALAR, round_output=False))
        # From 32 rows AVX512 reads a dequantized tile (vdpbf16ps over bfloat16 pairs at ISA_AVX512_BF16): the
        # scalar path's bits still, 3 rows a pass (35: 11 passes of 3 and one of 2)
        many = x.repeat(7, 1)                                                        # [35, in]
        assert torch.equal(run(kind, many, args, isa=isa, round_output=False), got.repeat(7, 1))


@pytest.mark.parametrize("isa", [isa_param(i) for i in (cm.ISA_AVX2, cm.ISA_AVX512, cm.ISA_AVX512_BF16)])
@pytest.mark.parametrize("name", ["q 576x576", "down 576x1536", "lm_head 49152x576"])
def test_rows_are_batch_and_thread_invariant(layer0, name, isa):
    """A row's result is bit for bit the same alone, in a batch of 7 (tiles of 4 + 3) and on 2 or 4 threads (q4:
    9 blocks split into halves between threads at both)."""
    kind, args, x, _ = layer0[name]
    together = run(kind, x, args, nthreads=1, isa=isa)
    for i in range(x.shape[0]):
        assert torch.equal(run(kind, x[i:i + 1], args, nthreads=1, isa=isa)[0], together[i])
    for nthreads in (2, 4):
        assert torch.equal(run(kind, x, args, nthreads=nthreads, isa=isa), together)
    # From Q4P_DEQUANT_ROWS (32) rows the AVX512 q4 path reads a dequantized tile instead, 3 rows a pass (35: 11
    # passes of 3 and one of 2); the AVX512 q8 one from 12 rows, 6 a pass (5 passes of 6 and one of 5), at
    # ISA_AVX512_BF16 4 a pass (35: 8 of 4 and one of 3; 70: 17 of 4 and one of 2).
    # On AVX2 the q4 path reads chunks of 64 inputs dequantized from 64 rows, 6 a pass (70: 11 of 6, one of 4).
    for copies in (5, 10):
        many = x.repeat(copies, 1)                                                   # [35 or 70, in]
        assert torch.equal(run(kind, many, args, nthreads=1, isa=isa), together.repeat(copies, 1))


@pytest.mark.parametrize("block_rows", [32, 64])
@pytest.mark.parametrize("isa", [isa_param(i) for i in (cm.ISA_AVX2, cm.ISA_AVX512, cm.ISA_AVX512_BF16)])
def test_q4_every_path_gives_the_scalar_bits_at_both_block_sizes(isa, block_rows):
    """Random codes read as int4pack's layout of 32-row blocks (torch's AVX2 packing) or 64-row ones, scales and
    zeros of mixed sign and size, x spanning 2^-20 .. 2^6 with exact zeros, -0, values about the smallest
    normal float (rounded to bfloat16, a subnormal is +0) and halfway ones (ties to even): 2 and 5 rows (the
    codes read in every pass; on AVX2 a whole block's two nibbles at once in passes of 1 or 2 rows), 35 (from 32 on AVX512: the dequantized tile, bfloat16 pairs at ISA_AVX512_BF16) and 70
    (from 64 on AVX2: chunks of 64 inputs dequantized, 6 rows a pass, the last chunk of 224 inputs one group), 1
    and 3 threads, the scalar path's bits."""
    g = torch.Generator().manual_seed(7)
    n, k = 4 * block_rows, 224
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    table = (torch.randn(k // 32, n, 2, generator=g) * torch.rand(k // 32, n, 2, generator=g).pow(4) * 4).bfloat16()
    x = torch.randn(70, k, generator=g) * torch.pow(2.0, torch.randint(-20, 7, (70, k), generator=g).float())
    x[x.abs() < 1e-5] = 0.0
    x[:, :6] = torch.tensor([1e-39, -1e-40, -0.0, 1.1754e-38, -1.1755e-38, 3e-38])  # subnormal (to +0) or not
    x[:, 6:10] = torch.tensor([1 + 2**-8, -(1 + 3 * 2**-8), 3 * 2**-9, 1 + 2**-8 + 2**-20])  # ties to even, not a tie
    expected = cm.q4_bf16_matmul(x, packed, table, block_rows, isa=cm.ISA_SCALAR, round_output=False, nthreads=1)
    for rows in (2, 5, 35, 70):
        for nthreads in (1, 3):
            got = cm.q4_bf16_matmul(x[:rows], packed, table, block_rows, isa=isa, round_output=False,
                                    nthreads=nthreads)
            assert torch.equal(got, expected[:rows]), (rows, nthreads)


@pytest.mark.parametrize("isa", [isa_param(i) for i in (cm.ISA_AVX2, cm.ISA_AVX512, cm.ISA_AVX512_BF16)])
def test_q8_rows_are_the_same_in_every_tile(isa):
    """A weight row's outputs do not depend on the tile holding it: the first n rows of a 23-row weight (blocks
    of 8, tiles of up to 4 rows: 4 + 3 at its tail) against the n-row weight alone, 13 rows of x (passes of 6,
    6, 1, at ISA_AVX512_BF16 of 4, 4, 4, 1; on AVX512 over the block dequantized once, its sums reduced 16 at a
    time) and 5 (the codes read in every pass), and torch's int8pack_mm where it runs the AVX512 order."""
    g = torch.Generator().manual_seed(5)
    qweight = torch.randint(-127, 128, (23, 96), generator=g, dtype=torch.int8)
    scale = torch.rand(23, generator=g).bfloat16().float() / 64
    x = torch.randn(13, 96, generator=g)
    whole = cm.q8_bf16_matmul(x, qweight, scale, isa=isa)
    for n in (1, 2, 3, 5, 8, 9, 16, 17, 19, 22):
        assert torch.equal(cm.q8_bf16_matmul(x, qweight[:n].contiguous(), scale[:n].contiguous(), isa=isa),
                           whole[:, :n]), n
    assert torch.equal(cm.q8_bf16_matmul(x[:5], qweight, scale, isa=isa), whole[:5])
    if isa == cm.ISA_AVX512 and cm.best_isa("q8-bf16") >= cm.ISA_AVX512 \
            and torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert torch.equal(whole, Int8Linear(qweight, scale).forward(x, max_rows=x.shape[0]))


@pytest.mark.parametrize("name", ["q 576x576", "gate 1536x576", "down 576x1536", "lm_head 49152x576"])
def test_matches_torch_int4pack_and_int8pack(layer0, name):
    """The values torch's kernels return: int8pack_mm's bits on the AVX512 path where torch runs its AVX512
    kernels; elsewhere (int4pack_mm's sums group by group, int8pack_mm's scaled after the sum at AVX512-BF16)
    every output within one bfloat16 step and (measured 0-0.4%) under 1% of them differing at all, at 5 rows and
    (q4) from the tile at 35."""
    kind, args, x, w = layer0[name]
    torch_avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    if kind == "q4-bf16":
        torch_linear = Int4Linear.quantize(w)                     # the same codes, scales and zeros (exact)
        assert torch.equal(torch_linear.dequantize(), w)
        pairs = [(run(kind, x, args), torch_linear.forward(x))]
        many = x.repeat(7, 1)
        pairs.append((run(kind, many, args), torch_linear.forward(many)))
    else:
        torch_linear = Int8Linear(*args)
        expected = torch_linear.forward(x, max_rows=x.shape[0])
        pairs = [(run(kind, x, args), expected)]
        if cm.best_isa(kind) >= cm.ISA_AVX512 and torch_avx512:
            assert torch.equal(run(kind, x, args, isa=cm.ISA_AVX512), expected)
    for got, expected in pairs:
        step = torch.maximum(got.abs(), expected.abs()) * 2.0 ** -7                 # a bfloat16 step, at most
        assert ((got - expected).abs() <= step).all()
        assert (got != expected).float().mean() < 0.01


def test_int8_layers_take_the_bf16_kernel_at_every_batch():
    """An int8 layer on cpu_matmul="native-bf16" runs q8-bf16 for a prefill's batch too (past int8pack_mm's 32
    rows, where the torch build takes the float32 GEMM path): a prompt's rows are the same bits as each row alone,
    the way a decode step computes it."""
    g = torch.Generator().manual_seed(3)
    lin = Int8Linear.quantize(torch.randn(256, 576, generator=g) * 0.05, torch.randn(256, generator=g) * 0.1,
                              cpu_matmul="native-bf16")
    assert lin.native.kind == "q8-bf16"
    x = torch.randn(quant.INT8PACK_MAX_ROWS + 70, 576, generator=g)
    batched = lin.forward(x)
    for i in (0, 31, 32, 101):
        assert torch.equal(lin.forward(x[i:i + 1]), batched[i:i + 1]), i


def test_linears_use_the_bf16_kernels(llm):
    """cpu_matmul="native-bf16": every int4 layer and the int8 LM head run the bfloat16 kinds, codes held once in
    int4pack's layout; forward adds the bias and equals torch's kernels; logits recompute the top-k in float32."""
    model = llm.engine.runner.model
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert lin.native.kind == "q4-bf16" and lin.nibbles is None  # the codes once, int4pack's layout
    head = model.lm_head
    assert head.native.kind == "q8-bf16" and not head.use_int8pack
    o = model.layers[0].o
    biased = Int4Linear(o.codes(), o.scale, o.zero, torch.ones(576), cpu_matmul="native-bf16")
    x = torch.randn(3, 576)
    assert torch.equal(biased.forward(x), o.forward(x) + 1)
    theirs = Int4Linear(o.codes(), o.scale, o.zero).forward(x)                      # torch's int4pack_mm
    assert ((o.forward(x) - theirs).abs() <= theirs.abs() * 2.0 ** -7).all()
    top = head.logits(x).topk(4, dim=-1)
    for i in range(x.shape[0]):
        exact = head.dequantize(torch.float32, top.indices[i]) @ x[i]
        assert torch.allclose(top.values[i], exact, rtol=1e-5, atol=1e-5)


def test_engine_answers_paris_and_matches_torch_kernels(llm, llm_torch):
    """The main job's question keeps its answer (its first token is a near tie in float32, 25.33 vs 25.24, that
    int8 activations flip), and greedy tokens equal torch kernels' on two prompts, each alone on one thread
    ("def fibonacci(n):" has a near tie of 0.04), their logprobs within LOGPROB_TOL of torch's (int4pack_mm sums
    in another order, and bfloat16 rounding of every layer's output carries
    the difference on: measured up to 0.024 on this CPU)."""
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for prompt in ("def fibonacci(n):", "Water boils at"):
            ours, theirs = (e.generate(prompt, params)[0].outputs[0] for e in (llm, llm_torch))
            assert ours.token_ids == theirs.token_ids, prompt
            for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= LOGPROB_TOL, prompt
    finally:
        torch.set_num_threads(threads)


def test_engine_gives_a_sequence_the_same_tokens_and_logprobs_alone_as_in_a_batch(llm):
    assert_same_alone_as_batched(llm, max_tokens=10)
