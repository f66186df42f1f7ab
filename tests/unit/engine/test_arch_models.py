"""Each supported architecture against Hugging Face transformers: a tiny random model made here from its config
class, saved with save_pretrained (safetensors), loaded by the offline engine; logits and greedy tokens compared.

Weights are random at unit activation scale, norms perturbed (an all-ones or all-zeros norm would hide a missing or
doubled (1 + weight) offset). The prompt is longer than the sliding window, so windowed layers
really drop positions, and generation runs past it.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_gguf import CHAT_TEMPLATE, tiny_vocab, write_tiny_gguf

from engine.gguf_loader import load_gguf_tokenizer
from engine.llm import LLM
from engine.model import AttentionMetadata
from engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers", reason="the dev extra provides transformers")

VOCAB = len(tiny_vocab()[0])
WINDOW = 5
# Measured max |logit difference| vs transformers in float32: 2.4e-6 to 5.7e-6 (1.1e-5 from GGUF) on logits of
# magnitude 5 to 70. The bound leaves room for other BLAS builds.
LOGIT_ATOL = 1e-4
PROMPT = [5, 17, 99, 3, 250, 42, 7, 300, 11, 64, 128, 9, 33]  # 13 tokens > WINDOW
NUM_GENERATED = 12

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=0, pad_token_id=0)


def _configs():
    t = transformers
    return {
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, dict(head_dim=16, tie_word_embeddings=False)),
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM,
                   dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                        final_logit_softcapping=10.0, layer_types=["sliding_attention", "full_attention"])),
        "gemma3": (t.Gemma3TextConfig, t.Gemma3ForCausalLM,
                   dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1000000.0}})),
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM, dict(sliding_window=WINDOW)),
        "phi3-partial-rotary": (t.Phi3Config, t.Phi3ForCausalLM,
                                dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5})),
        # original context 64 < the model's 256: transformers uses the short factors up to 64 tokens, as pdserve
        # does with max_model_len 64
        "phi3-longrope": (t.Phi3Config, t.Phi3ForCausalLM,
                          dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                "original_max_position_embeddings": 64,
                                                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                "long_factor": [2.0 + i for i in range(8)]})),
        "mixtral": (t.MixtralConfig, t.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
        "qwen3-yarn": (t.Qwen3Config, t.Qwen3ForCausalLM,
                       dict(head_dim=16, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                          "original_max_position_embeddings": 64})),
    }


def _randomize(model, seed: int) -> None:
    """Weights of unit-scale activations (transformers' 0.02 init gives logits of ~0.5, where softcaps and
    near-ties hide mistakes); norms perturbed around their init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # [out, in] or stacked experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / p.shape[-1] ** 0.5)


def _write_tokenizer(path) -> None:
    gguf_path = path.parent / f"{path.name}-tokenizer.gguf"
    write_tiny_gguf(gguf_path)
    load_gguf_tokenizer(gguf_path).backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"}))


def _build(name: str, tmp_path_factory, **engine_kwargs):
    """(transformers model, pdserve LLM) over the same saved directory."""
    config_cls, model_cls, extra = _configs()[name]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**COMMON, **extra)).eval()
    _randomize(hf, seed=1)
    path = tmp_path_factory.mktemp(name) / "model"
    hf.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, block_size=4, progress=False,
              max_model_len=max_model_len(name), **engine_kwargs)
    return hf, llm


@pytest.fixture(scope="module", params=list(_configs()))
def arch_pair(request, tmp_path_factory):
    """(name, transformers model, pdserve LLM) over the same saved directory."""
    return request.param, *_build(request.param, tmp_path_factory)


def max_model_len(name: str) -> int | None:
    return 64 if "longrope" in name else None


def _engine_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """Prefill `token_ids` into scratch blocks of the engine's own cache; logits of every position."""
    runner = llm.engine.runner
    n = len(token_ids)
    block_ids = list(range(runner.num_blocks - -(-n // runner.block_size), runner.num_blocks))
    slots = [block_ids[p // runner.block_size] * runner.block_size + p % runner.block_size for p in range(n)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots),
                             block_tables=torch.tensor([block_ids], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32))
    hidden = runner.model.forward(torch.tensor(token_ids), torch.arange(n), runner.kv_cache, meta)
    return runner.model.compute_logits(hidden)


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(torch.argmax(model(torch.tensor([out])).logits[0, -1])))
    return out[len(ids):]


def test_prompt_logits_match_transformers(arch_pair):
    name, hf, llm = arch_pair
    with torch.inference_mode():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    ours = _engine_logits(llm, PROMPT)
    diff = (ours - expected).abs().max().item()
    print(f"{name}: max |logit diff| vs transformers {diff:.2e} (logits up to {expected.abs().max().item():.1f})")
    assert diff < LOGIT_ATOL
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_greedy_tokens_and_logprobs_match_transformers(arch_pair):
    """Through LLM.generate: prefill, then decode steps one token at a time through the paged cache."""
    name, hf, llm = arch_pair
    expected = _hf_greedy(hf, PROMPT, NUM_GENERATED)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=NUM_GENERATED, temperature=0.0, ignore_eos=True,
                                                logprobs=0))[0].outputs[0]
    assert out.token_ids == expected
    with torch.inference_mode():
        hf_logprobs = torch.log_softmax(hf(torch.tensor([PROMPT + expected])).logits[0].float(), dim=-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(hf_logprobs[len(PROMPT) - 1 + i, expected[i]].item(), abs=LOGIT_ATOL)


def test_batched_decode_matches_single(arch_pair):
    """Two sequences of different lengths decoded in one batch give each one's own greedy tokens."""
    name, hf, llm = arch_pair
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT, PROMPT[3:10]]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert together == [_hf_greedy(hf, p, 6) for p in prompts]


def test_int8_quantization_covers_every_expert(tmp_path_factory):
    """quantization="int8" quantizes each expert's matrices (the router stays float) and stays close to float32."""
    from engine.quant import FloatLinear, Int8Linear

    _, float32 = _build("mixtral", tmp_path_factory)
    _, int8 = _build("mixtral", tmp_path_factory, quantization="int8")
    moe = int8.engine.runner.model.layers[0].mlp
    assert isinstance(moe.router, FloatLinear)
    assert all(isinstance(w, Int8Linear) for w in moe.gate_up + moe.down)
    diff = (_engine_logits(int8, PROMPT) - _engine_logits(float32, PROMPT)).abs().max().item()
    assert 0 < diff < 0.5  # int8 rounding moves the logits (of magnitude ~5), a little
