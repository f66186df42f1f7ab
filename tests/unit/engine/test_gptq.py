"""GPTQ checkpoints made by `pdserve quantize` from a tiny random transformers Llama: the packed tensors against a
dequantization written here from the format's definition, pdserve's greedy tokens against the float model over
those weights, the GPTQ objective against round-to-nearest, and bad checkpoints and flags."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tiny_hf import COMMON, calibration_text, write_tiny_llama
from tiny_hf import GPTQ_PROMPT as PROMPT

import engine.quant as quant
from engine.config import EngineConfig
from engine.gptq import HessianAccumulator, gptq_quantize, hessian_error, rtn_quantize
from engine.gptq_linear import GPTQLinear
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel, ModelLoadError, load_model
from engine.model import AttentionMetadata
from engine.sampling_params import SamplingParams
from pdserve.cli import main

pytest.importorskip("transformers", reason="the dev extra provides transformers")

VARIANTS = {  # name -> pdserve quantize flags
    "gptq4-g32": ["--method", "gptq", "--bits", "4", "--group-size", "32"],
    "gptq4-g32-act-order-asym": ["--method", "gptq", "--bits", "4", "--group-size", "32", "--act-order", "--no-sym"],
    "gptq8-g32-act-order-asym-v2": ["--method", "gptq", "--bits", "8", "--group-size", "32", "--act-order",
                                    "--no-sym", "--checkpoint-format", "gptq_v2"],
    "rtn4-g32": ["--method", "rtn", "--bits", "4", "--group-size", "32"],
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{variant: checkpoint directory}, plus "float": the source."""
    root = tmp_path_factory.mktemp("gptq")
    source = root / "float"
    write_tiny_llama(source)
    calibration = root / "calibration.txt"
    calibration.write_text(calibration_text())
    dirs = {"float": source}
    for name, flags in VARIANTS.items():
        assert main(["quantize", *flags, "--calibration", str(calibration), "--seq-len", "32", "--num-samples", "16",
                     "--quiet", "--out", str(root / name), str(source)]) == 0
        dirs[name] = root / name
    return dirs


def reference_dequantize(tensors: dict[str, np.ndarray], prefix: str, qconfig: dict) -> np.ndarray:
    """W [out, in] from the format's definition: qweight packs 32/bits codes of consecutive inputs per int32 (low
    bits first), qzeros packs zero points of consecutive outputs the same way (v1: stored as zero - 1);
    W[j, i] = (q[i, j] - z[g_idx[i], j]) * scales[g_idx[i], j]."""
    bits = qconfig["bits"]
    per_word, mask = 32 // bits, (1 << bits) - 1
    qweight = tensors[prefix + ".qweight"].view(np.uint32)          # [in / per_word, out]
    qzeros = tensors[prefix + ".qzeros"].view(np.uint32)            # [groups, out / per_word]
    scales = tensors[prefix + ".scales"].astype(np.float64)         # [groups, out]
    g_idx = tensors[prefix + ".g_idx"].astype(np.int64)             # [in]
    in_features, out_features = qweight.shape[0] * per_word, qweight.shape[1]
    q = np.zeros((in_features, out_features), dtype=np.int64)
    for word in range(qweight.shape[0]):
        for k in range(per_word):
            q[word * per_word + k] = (qweight[word] >> np.uint32(bits * k)) & mask
    z = np.zeros((qzeros.shape[0], out_features), dtype=np.int64)
    for col in range(qzeros.shape[1]):
        for k in range(per_word):
            z[:, col * per_word + k] = (qzeros[:, col] >> np.uint32(bits * k)) & mask
    if qconfig["checkpoint_format"] == "gptq":
        z += 1
    w = np.empty((out_features, in_features))
    for i in range(in_features):
        w[:, i] = (q[i] - z[g_idx[i]]) * scales[g_idx[i]]
    return w


@pytest.mark.parametrize("name", list(VARIANTS))
def test_pdserve_dequantizes_exactly_what_the_format_defines(checkpoints, name):
    path = checkpoints[name]
    qconfig = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "gptq" and qconfig["desc_act"] == ("--act-order" in VARIANTS[name])
    tensors = load_file(path / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.qweight"].dtype == np.int32
    assert tensors["model.layers.0.self_attn.q_proj.scales"].dtype == np.float16
    assert "model.layers.0.self_attn.q_proj.weight" not in tensors
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, block_size=4, progress=False)
    layer = llm.engine.runner.model.layers[1]
    assert isinstance(layer.qkv, GPTQLinear) and isinstance(layer.mlp.down, GPTQLinear)
    fused = {"qkv": LINEARS[:3], "o": LINEARS[3:4], "gate_up": LINEARS[4:6], "down": LINEARS[6:]}
    for ours, names in ((layer.qkv, fused["qkv"]), (layer.o, fused["o"]), (layer.mlp.gate_up, fused["gate_up"]),
                        (layer.mlp.down, fused["down"])):
        expected = np.concatenate([reference_dequantize(tensors, f"model.layers.1.{n}", qconfig) for n in names])
        np.testing.assert_allclose(ours.dequantize().numpy(), expected, rtol=0, atol=1e-6)
    if "act-order" in name and qconfig["group_size"] != -1:
        g_idx = tensors["model.layers.1.mlp.down_proj.g_idx"]
        assert not np.array_equal(g_idx, np.sort(g_idx))  # inputs really were reordered


def _float_engine_over(path) -> LLMEngine:
    """The float model whose linears are the checkpoint's dequantized weights (other tensors as stored)."""
    gptq = load_model(path, dtype=torch.float32, progress=False)
    weights = {name: w if isinstance(w, torch.Tensor)
               else GPTQLinear(w, None, torch.device("cpu")).dequantize() for name, w in gptq.weights.items()}
    loaded = LoadedModel(config=gptq.config, weights=weights, tokenizer=gptq.tokenizer, fingerprint="dequantized")
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, block_size=4), loaded=loaded)


def _greedy(engine: LLMEngine, prompt: list[int]) -> list[int]:
    seq = engine.add_request("r", prompt, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return seq.output_token_ids


@pytest.mark.parametrize("name", ["gptq4-g32-act-order-asym", "gptq8-g32-act-order-asym-v2", "rtn4-g32"])
def test_greedy_tokens_equal_the_float_model_over_the_dequantized_weights(checkpoints, name, monkeypatch):
    # float32 activations on both sides: the int4 linears take their exact (GEMM) path
    monkeypatch.setattr(quant, "INT4PACK_MAX_ROWS", 0)
    llm = LLM(model=str(checkpoints[name]), dtype="float32", num_kv_blocks=64, block_size=4, progress=False)
    assert _greedy(llm.engine, PROMPT) == _greedy(_float_engine_over(checkpoints[name]), PROMPT)


def test_int4pack_path_stays_close_to_the_exact_path(checkpoints):
    """The CPU decode path (bfloat16 activations and scales) against the exact GEMM path on the same linear."""
    lin = LLM(model=str(checkpoints["gptq4-g32-act-order-asym"]), dtype="float32", num_kv_blocks=16, block_size=4,
              progress=False).engine.runner.model.layers[0].mlp.gate_up
    assert lin.int4 is not None and lin.perm is not None
    x = torch.randn(3, COMMON["hidden_size"])
    exact = x @ lin.dequantize().t()
    assert ((lin.forward(x) - exact).norm() / exact.norm()).item() < 0.01  # measured ~0.3%


def _prompt_logits(path, token_ids: list[int]) -> torch.Tensor:
    """Logits of every position of `token_ids`, prefilled into the engine's own cache."""
    runner = LLM(model=str(path), dtype="float32", num_kv_blocks=64, block_size=4, progress=False).engine.runner
    n = len(token_ids)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.arange(-(-n // 4))[None].int(),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32))
    hidden = runner.model.forward(torch.tensor(token_ids), torch.arange(n), runner.kv_cache, meta)
    return runner.model.compute_logits(hidden)


def test_gptq_model_is_closer_to_the_float_model_than_round_to_nearest(checkpoints, monkeypatch):
    """Same bits, groups and grids: on text like the calibration's, GPTQ's logits are nearer float32's."""
    monkeypatch.setattr(quant, "INT4PACK_MAX_ROWS", 0)
    ids = [int(w[1:]) for w in calibration_text(seed=7).split()[:48]]  # held-out text, same distribution
    ref = _prompt_logits(checkpoints["float"], ids)
    errors = {name: ((_prompt_logits(checkpoints[name], ids) - ref).norm() / ref.norm()).item()
              for name in ("gptq4-g32", "rtn4-g32")}
    print(f"relative logit error vs float32: {errors}")
    assert errors["gptq4-g32"] < errors["rtn4-g32"], errors


def test_gptq_beats_round_to_nearest_on_the_hessian_weighted_error():
    g = torch.Generator().manual_seed(0)
    # inputs with a few strongly active, correlated features (what real activations look like)
    basis = torch.randn(32, 128, generator=g) * torch.linspace(3.0, 0.1, 128)
    x = torch.randn(2048, 32, generator=g) @ basis + 0.1 * torch.randn(2048, 128, generator=g)
    acc = HessianAccumulator(128)
    for chunk in x.split(500):
        acc.add(chunk)
    torch.testing.assert_close(acc.hessian, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)
    w = torch.randn(64, 128, generator=g) * 0.05
    for bits, group_size, sym in ((4, 32, True), (4, -1, False), (8, 128, True)):
        rtn = hessian_error(w, rtn_quantize(w, bits, group_size, sym).dequantize(), acc.hessian)
        for act_order in (False, True):
            q = gptq_quantize(w, acc.hessian, bits, group_size, sym, act_order=act_order)
            err = hessian_error(w, q.dequantize(), acc.hessian)
            assert err < 0.8 * rtn, (bits, group_size, sym, act_order, err, rtn)
            assert q.codes.min() >= 0 and q.codes.max() < 2 ** bits


def test_bad_quantization_config_is_refused_naming_the_key(checkpoints, tmp_path):
    import shutil

    path = tmp_path / "bad"
    shutil.copytree(checkpoints["gptq4-g32"], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantization_config.bits"):
        load_model(path, progress=False)
    config["quantization_config"] |= {"bits": 4, "group_size": 16}  # scales hold groups of 32
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"scales has \d+ groups; group_size 16 over"):
        load_model(path, progress=False)


def test_tensor_parallelism_refuses_a_gptq_checkpoint_and_shards_the_float_one(checkpoints):
    from engine.parallel.shard import rank_shards, shard_weights

    for name, refused in (("gptq4-g32", True), ("float", False)):
        loaded = load_model(checkpoints[name], progress=False)
        shard = rank_shards(loaded.config, 2, None)[1]
        if refused:
            with pytest.raises(ValueError, match="does not shard GPTQ checkpoints"):
                shard_weights(loaded.config, loaded.weights, shard)
        else:
            sliced = shard_weights(loaded.config, loaded.weights, shard)
            assert sliced["model.layers.0.mlp.up_proj.weight"].shape[0] == len(shard.intermediate)


def test_quantize_flags_are_checked(checkpoints, tmp_path, capsys):
    source = str(checkpoints["float"])
    assert main(["quantize", "--method", "rtn", "--act-order", "--out", str(tmp_path / "x"), source]) == 2
    assert "act_order needs method gptq" in capsys.readouterr().err
    assert main(["quantize", "--method", "gptq", "--out", str(tmp_path / "x"), source]) == 2
    assert "--calibration FILE is required" in capsys.readouterr().err
    assert main(["quantize", "--method", "rtn", "--out", str(tmp_path / "x"), str(checkpoints["gptq4-g32"])]) == 2
    assert "already quantized" in capsys.readouterr().err


def test_transformers_gptq_loader_reads_the_same_weights(checkpoints):
    """transformers (through optimum + gptqmodel, when installed) loads the checkpoint: its float16
    dequantization is ours up to float16 rounding, and its logits agree."""
    pytest.importorskip("gptqmodel", reason="gptqmodel is not installed (transformers' GPTQ backend)")
    pytest.importorskip("optimum", reason="optimum is not installed (transformers' GPTQ integration)")
    import transformers

    path = checkpoints["gptq4-g32-act-order-asym"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu")
    ours = load_model(path, progress=False).weights
    for i in range(COMMON["num_hidden_layers"]):
        for linear in LINEARS:
            module = hf.get_submodule(f"model.layers.{i}.{linear}")
            expected = GPTQLinear(ours[f"model.layers.{i}.{linear}.weight"], None, torch.device("cpu")).dequantize()
            w = module.dequantize_weight().float().t()  # gptqmodel returns [in, out]
            torch.testing.assert_close(w, expected, rtol=2 ** -10, atol=1e-6)
    with torch.inference_mode():
        theirs = hf(torch.tensor([PROMPT])).logits[0].float()
    mine = _prompt_logits(path, PROMPT)
    # measured 1.2% of the largest logit (gptqmodel dequantizes in float16)
    assert (mine - theirs).abs().max().item() < 0.05 * theirs.abs().max().item()


def test_a_gguf_source_is_quantized_from_its_dequantized_weights(tmp_path):
    """A GGUF file quantizes like a directory: config.json and tokenizer.json are written from its metadata."""
    from tiny_gguf import write_tiny_gguf

    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source)
    out = tmp_path / "rtn"
    assert main(["quantize", "--method", "rtn", "--bits", "4", "--group-size", "32", "--quiet", "--out", str(out),
                 str(source)]) == 0
    gguf, gptq = load_model(source, progress=False, keep_quantized=False), load_model(out, progress=False)
    assert gptq.config == gguf.config
    assert gptq.tokenizer.encode("hello world") == gguf.tokenizer.encode("hello world")
    w = gguf.weights["model.layers.0.mlp.up_proj.weight"]
    q = GPTQLinear(gptq.weights["model.layers.0.mlp.up_proj.weight"], None, torch.device("cpu")).dequantize()
    step = (w.amax(dim=1) - w.amin(dim=1)).max() / 15
    assert (q - w).abs().max() <= step  # round to nearest on groups no wider than the row
