"""int8 and int4 weight-only quantization: the quantized weights, both matmul paths against float, engine wiring."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import engine.quant as quant
from engine.weight_memory import held_bytes
from engine.config import EngineConfig
from engine.model import AttentionMetadata, LlamaModel
from engine.quant import DequantWorkspace, FloatLinear, Int4Linear, Int8Linear, make_linear, quantized_fingerprint
from tiny_model import TINY, tiny_engine, tiny_weights


def random_weight(out_features, in_features, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * 0.05


def rel_error(got, expected):
    return ((got - expected).norm() / expected.norm()).item()


@pytest.fixture
def gemm_only(monkeypatch):
    """Force the dequantize + GEMM path whatever the number of rows."""
    monkeypatch.setattr(quant, "INT8PACK_MAX_ROWS", 0)
    monkeypatch.setattr(quant, "INT8PACK_HEAD_MAX_ROWS", 0)
    monkeypatch.setattr(quant, "INT4PACK_MAX_ROWS", 0)


def test_quantized_weight_is_within_half_a_step_of_the_float_weight():
    w = random_weight(96, 64)
    w[5] = 0.0
    lin = Int8Linear.quantize(w)
    assert lin.qweight.dtype == torch.int8 and lin.qweight.abs().max() <= 127
    assert torch.equal(lin.scale, lin.scale.bfloat16().float())  # both paths multiply by the same scale
    assert lin.scale[5] == 0 and not lin.qweight[5].any()
    step = lin.scale[:, None]
    assert ((lin.dequantize() - w).abs() <= step * 0.5 + 1e-7).all()
    assert lin.qweight.abs().amax(dim=1)[torch.arange(96) != 5].min() >= 126  # the range is used


@pytest.mark.parametrize("num_rows", [1, 3, 8, quant.INT8PACK_MAX_ROWS, quant.INT8PACK_MAX_ROWS + 1, 100])
def test_forward_matches_the_float_linear(num_rows):
    w, bias = random_weight(200, 128), torch.randn(200) * 0.1
    x = torch.randn(num_rows, 128)
    out = Int8Linear.quantize(w, bias).forward(x)
    assert out.dtype == torch.float32 and out.shape == (num_rows, 200)
    # Measured 0.6-0.7% (int8 weights, plus bfloat16 activations and outputs on the int8pack path).
    assert rel_error(out, F.linear(x, w, bias)) < 0.015


@pytest.mark.parametrize("num_rows", [1, 5, 16])
def test_int8pack_and_gemm_paths_agree(num_rows, monkeypatch):
    lin = Int8Linear.quantize(random_weight(256, 576), torch.randn(256) * 0.1)
    assert lin.use_int8pack == (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))
    x = torch.randn(num_rows, 576)
    int8pack = lin.forward(x)
    monkeypatch.setattr(quant, "INT8PACK_MAX_ROWS", 0)
    gemm = lin.forward(x)
    # The GEMM path is float32 over exactly q * scale; the int8pack path rounds x and its output to bfloat16.
    torch.testing.assert_close(gemm, F.linear(x, lin.dequantize(), lin.bias), rtol=1e-5, atol=1e-5)
    assert rel_error(int8pack, gemm) < 0.008  # measured ~0.3%


@pytest.mark.parametrize("cls, out_features, chunk_rows", [(Int8Linear, 100, 32), (Int4Linear, 112, 48)])
def test_gemm_path_in_chunks_equals_one_shot(cls, out_features, chunk_rows, gemm_only):
    w, bias = random_weight(out_features, 64), torch.randn(out_features)
    x = torch.randn(40, 64)
    whole = cls.quantize(w, bias).forward(x)
    chunked = cls.quantize(w, bias, DequantWorkspace(chunk_rows * 64))
    assert chunked.chunk_rows == chunk_rows  # 4 and 3 chunks, the last one short
    torch.testing.assert_close(chunked.forward(x), whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(whole, F.linear(x, chunked.dequantize(), bias), rtol=1e-5, atol=1e-5)


def test_gemm_path_computes_in_the_input_dtype(gemm_only):
    """The path CUDA takes: dequantize into the model dtype (here bfloat16) and multiply there."""
    w, bias = random_weight(64, 48), torch.randn(64) * 0.1
    lin = Int8Linear.quantize(w, bias.bfloat16())
    x = torch.randn(5, 48)
    out = lin.forward(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert rel_error(out.float(), F.linear(x, w, bias)) < 0.02


def test_input_width_the_int8pack_kernel_cannot_read_takes_the_gemm_path():
    w = random_weight(40, 24)  # 24 is not a multiple of 16: the int8pack kernel would read past each row
    lin = Int8Linear.quantize(w)
    assert not lin.use_int8pack
    x = torch.randn(2, 24)
    assert rel_error(lin.forward(x), F.linear(x, w)) < 0.015


def test_unaligned_bfloat16_input_is_realigned():
    lin = Int8Linear.quantize(random_weight(64, 32))
    storage = torch.randn(3 * 32 + 1).bfloat16()
    x = storage[1:].view(3, 32)  # starts 2 bytes into an allocation
    expected = F.linear(x.float(), lin.dequantize())
    assert rel_error(lin.forward(x).float(), expected) < 0.01


def test_embed_gathers_dequantized_rows():
    lin = Int8Linear.quantize(random_weight(50, 32))
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(lin.embed(ids), lin.dequantize()[ids])


def test_float_linear_is_f_linear_exactly():
    w, b = random_weight(30, 16), torch.randn(30)
    lin = make_linear(w, b, None, torch.float32, torch.device("cpu"))
    assert isinstance(lin, FloatLinear)
    x = torch.randn(7, 16)
    assert torch.equal(lin.forward(x), F.linear(x, w, b))
    assert isinstance(make_linear(w, b, "int8", torch.float32, torch.device("cpu")), Int8Linear)


def test_fingerprint_separates_quantizations():
    assert quantized_fingerprint("abc", None) == "abc"
    # Pinned: every worker and the gateway must derive the same value.
    assert quantized_fingerprint("abc", "int8") == \
        "f38243f002f559f94d91bed0cd4c62ce1e481330de11b213ee813690e4277269"
    assert quantized_fingerprint("abc", "int4") not in ("abc", quantized_fingerprint("abc", "int8"))


def test_unknown_quantization_names_the_field():
    with pytest.raises(ValueError, match=r"EngineConfig\.quantization"):
        EngineConfig(model="default", quantization="int3")


def test_int8_engine_generates_close_to_float_with_its_own_fingerprint():
    float_engine, int8_engine = tiny_engine(), tiny_engine(quantization="int8")
    assert int8_engine.fingerprint == quantized_fingerprint(float_engine.fingerprint, "int8")
    assert int8_engine.kv.root_hash != float_engine.kv.root_hash
    model = int8_engine.runner.model
    assert all(isinstance(lin, Int8Linear) for layer in model.layers
               for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert model.embed is model.lm_head and isinstance(model.lm_head, Int8Linear)  # tied: one int8 table
    assert model.decode_weight_bytes() < float_engine.runner.model.decode_weight_bytes() / 3
    hidden = torch.randn(4, 64)
    expected = float_engine.runner.model.compute_logits(hidden)
    assert rel_error(model.compute_logits(hidden), expected) < 0.015  # measured 0.7%


def test_untied_model_with_qkv_bias_is_the_float_model_over_dequantized_weights(gemm_only):
    config = dataclasses.replace(TINY, attention_bias=True, tie_word_embeddings=False)
    weights = tiny_weights(config)
    g = torch.Generator().manual_seed(1)
    weights["lm_head.weight"] = torch.randn(config.vocab_size, config.hidden_size, generator=g)
    for i in range(config.num_layers):
        for proj, rows in (("q", config.num_heads), ("k", config.num_kv_heads), ("v", config.num_kv_heads)):
            weights[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.randn(rows * config.head_dim, generator=g)
    # Per-row scales: quantizing q, k, v (gate, up) one by one is quantizing their fused matrix.
    dequantized = {name: Int8Linear.quantize(w).dequantize() if name.endswith("proj.weight") or name == "lm_head.weight"
                   else w for name, w in weights.items()}
    int8 = LlamaModel(config, weights, torch.float32, torch.device("cpu"), 64, quantization="int8")
    reference = LlamaModel(config, dequantized, torch.float32, torch.device("cpu"), 64)
    assert isinstance(int8.embed, FloatLinear) and isinstance(int8.lm_head, Int8Linear)
    assert torch.equal(int8.embed.weight, weights["model.embed_tokens.weight"])  # untied: not quantized
    assert torch.equal(int8.layers[1].qkv.bias, reference.layers[1].qkv.bias)  # bias stays float

    n, block_size = 6, 4
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32))
    logits = []
    for model in (int8, reference):
        kv_cache = torch.zeros(config.num_layers, 2, 2, block_size, config.num_kv_heads, config.head_dim)
        hidden = model.forward(torch.tensor([5, 9, 2, 77, 3, 40]), torch.arange(n), kv_cache, meta)
        logits.append(model.compute_logits(hidden))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


# --- int4 ----------------------------------------------------------------------------------------------------------
def int4_codes(lin: Int4Linear) -> torch.Tensor:
    return lin.codes().long()


def test_int4_weight_is_within_half_a_step_of_the_float_weight_per_group():
    w = random_weight(96, 128)
    w[7, 32:64] = 0.3  # a constant group: scale 0, every weight exactly its offset
    lin = Int4Linear.quantize(w)
    codes = int4_codes(lin)
    assert codes.min() >= 0 and codes.max() <= 15
    for t in (lin.scale, lin.zero):
        assert torch.equal(t, t.bfloat16().float())  # both paths use the same bfloat16 table
    assert lin.scale[7, 1] == 0 and torch.all(lin.dequantize()[7, 32:64] == lin.zero[7, 1])
    step = lin.scale.repeat_interleave(quant.INT4_GROUP_SIZE, dim=1)  # [out, in]
    # Half a step, plus what rounding the offset to bfloat16 can add (2^-9 of its magnitude).
    bound = step * 0.5 + lin.zero.abs().repeat_interleave(quant.INT4_GROUP_SIZE, dim=1) * 2**-8 + 1e-7
    assert ((lin.dequantize() - w).abs() <= bound).all()


def test_int4_reproduces_q4_1_codes():
    """A weight dequantized from a Q4_1 block (q * d + m, q in [0, 15], min and max used) keeps its codes.

    Offsets as in real checkpoints, m ~ -7.5 d (every code of the default model's Q4_1 tensors is reproduced)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (32, 128), generator=g)
    q[:, 0::32], q[:, 1::32] = 0, 15
    d = (torch.rand(32, 4, generator=g) * 0.02 + 1e-3).half().float()
    m = (-d * (6 + 3 * torch.rand(32, 4, generator=g))).half().float()
    w = (q.view(32, 4, 32) * d[..., None] + m[..., None]).view(32, 128)
    lin = Int4Linear.quantize(w)
    assert torch.equal(int4_codes(lin), q)
    assert (lin.dequantize() - w).abs().max() < 1e-3


@pytest.mark.parametrize("num_rows", [1, 3, 64, 65])
def test_int4_forward_matches_the_float_linear(num_rows):
    w, bias = random_weight(208, 128), torch.randn(208) * 0.1
    x = torch.randn(num_rows, 128)
    out = Int4Linear.quantize(w, bias).forward(x)
    assert out.dtype == torch.float32 and out.shape == (num_rows, 208)
    assert rel_error(out, F.linear(x, w, bias)) < 0.15  # 4 bits on Gaussian weights: measured ~8%


@pytest.mark.parametrize("num_rows", [1, 5, 16])
def test_int4pack_and_gemm_paths_agree(num_rows, monkeypatch):
    lin = Int4Linear.quantize(random_weight(256, 576), torch.randn(256) * 0.1)
    assert lin.use_int4pack
    x = torch.randn(num_rows, 576)
    int4pack = lin.forward(x)
    monkeypatch.setattr(quant, "INT4PACK_MAX_ROWS", 0)
    gemm = lin.forward(x)
    torch.testing.assert_close(gemm, F.linear(x, lin.dequantize(), lin.bias), rtol=1e-5, atol=1e-5)
    assert rel_error(int4pack, gemm) < 0.008  # bfloat16 activations and output: measured ~0.2%


def test_int4_shapes_it_cannot_pack_fall_back_to_int8():
    cpu = torch.device("cpu")
    assert isinstance(make_linear(random_weight(48, 64), None, "int4", torch.float32, cpu), Int4Linear)
    assert isinstance(make_linear(random_weight(48, 40), None, "int4", torch.float32, cpu), Int8Linear)  # in % 32
    assert isinstance(make_linear(random_weight(40, 64), None, "int4", torch.float32, cpu), Int8Linear)  # out % 16
    with pytest.raises(ValueError, match="codes must be"):
        Int4Linear(torch.zeros(40, 64, dtype=torch.uint8), torch.zeros(40, 2), torch.zeros(40, 2))


def test_int4_engine_quantizes_the_layers_and_keeps_an_int8_head():
    float_engine, int4_engine = tiny_engine(), tiny_engine(quantization="int4")
    assert int4_engine.fingerprint == quantized_fingerprint(float_engine.fingerprint, "int4")
    model = int4_engine.runner.model
    assert all(isinstance(lin, Int4Linear) for layer in model.layers
               for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert model.embed is model.lm_head and isinstance(model.lm_head, Int8Linear)
    float_bytes = float_engine.runner.model.decode_weight_bytes()
    assert model.decode_weight_bytes() < float_bytes / 4
    hidden = torch.randn(4, 64)
    # The head is int8 as in the int8 engine: logits match float's as closely.
    assert rel_error(model.compute_logits(hidden), float_engine.runner.model.compute_logits(hidden)) < 0.015


# --- int8 LM head logits -------------------------------------------------------------------------------------------
def test_int8_head_recomputes_its_top_logits_in_float32():
    head = Int8Linear.quantize(random_weight(500, 64), torch.randn(500) * 0.1)
    x = torch.randn(3, 64) * 4
    assert head._takes_int8pack(x)
    exact = F.linear(x, head.dequantize(), head.bias)  # what the GEMM path gives every logit
    rounded = head.forward(x).float()
    got = head.logits(x)
    top = rounded.topk(quant.LOGITS_EXACT_TOP_K, dim=-1).indices  # the ones recomputed
    torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert (rounded.gather(1, top) - exact.gather(1, top)).abs().max() > 1e-3  # bfloat16 output, really rounded
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(got[rest], rounded[rest])  # the others stay as int8pack_mm gave them
    assert torch.equal(got.argmax(dim=-1), exact.argmax(dim=-1))


def test_int8_head_breaks_a_bfloat16_tie_by_the_float32_logit():
    qweight = torch.full((32, 64), 100, dtype=torch.int8)
    qweight[1, 0] = 101  # row 1's logit exceeds row 0's by 0.8 / 256 = 0.003, under bfloat16's 0.125 at 20
    qweight[2:] = 0
    head = Int8Linear(qweight, torch.full((32,), 2.0**-8))
    x = torch.full((1, 64), 0.8)
    assert head.forward(x)[0, 0] == head.forward(x)[0, 1]  # tied after rounding: argmax would take row 0
    assert head.logits(x).argmax().item() == 1


def test_int8_head_logits_of_a_row_do_not_depend_on_the_batch():
    """Each row's logits, the float32-recomputed top ones included, are bit for bit the same alone as in a batch
    (hidden states as the engine makes them, under inference_mode): a batch-dependent last bit would flip a
    near-tie's greedy token with the batch a sequence decodes in."""
    head = Int8Linear.quantize(random_weight(2048, 576), torch.randn(2048) * 0.1)
    with torch.inference_mode():
        x = torch.randn(quant.INT8PACK_MAX_ROWS + 8, 576) * 4  # more rows than a layer's int8pack path takes
        batched = head.logits(x)
        for i in range(0, x.shape[0], 5):
            assert torch.equal(head.logits(x[i:i + 1]), batched[i:i + 1]), i
            assert torch.equal(head.logits(x[i:i + 3]), batched[i:i + 3][:x.shape[0] - i]), i


def test_quantized_weights_are_placed_on_the_huge_page_chunks():
    """What the CPU kernels stream each step sits on kvstore.malloc_tuning.on_huge_pages' chunks (not a mapping of
    its own on small pages), and the forward is unchanged by where it sits."""
    from kvstore.malloc_tuning import WEIGHT_CHUNK_BYTES

    w = random_weight(1024, 576)
    x = torch.randn(3, 576)
    int4, int8 = Int4Linear.quantize(w), Int8Linear.quantize(w)
    for t in (int4.packed, int4.scale_zero, int8.qweight):
        assert t.untyped_storage().nbytes() >= WEIGHT_CHUNK_BYTES and t.data_ptr() % 64 == 0
    # what they hold is their own bytes, not the chunk's
    assert held_bytes(int4) == int4.packed.nbytes + int4.scale_zero.nbytes
    assert held_bytes(int8) == int8.qweight.nbytes + int8.scale.nbytes + int8.scale_bf16.nbytes
    torch.testing.assert_close(int4.forward(x), F.linear(x, int4.dequantize()), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(int8.forward(x), F.linear(x, int8.dequantize()), rtol=2e-2, atol=2e-2)
