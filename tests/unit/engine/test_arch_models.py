"""Each supported architecture against Hugging Face transformers: a tiny random model (tiny_hf), saved with
save_pretrained (safetensors), loaded by the offline engine; logits and greedy tokens compared.
"""

from __future__ import annotations

import pytest
import torch
from tiny_hf import PROMPT, architectures, assert_greedy, hf_next_token_logits, max_model_len, write_tiny_model

from engine.llm import LLM
from engine.model import AttentionMetadata
from engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers", reason="the dev extra provides transformers")

# Measured max |logit difference| vs transformers in float32: 2.4e-6 to 5.7e-6 (1.1e-5 from GGUF) on logits of
# magnitude 5 to 70. The bound leaves room for other BLAS builds.
LOGIT_ATOL = 1e-4
NUM_GENERATED = 12


def _build(name: str, tmp_path_factory, **engine_kwargs):
    """(transformers model, pdserve LLM) over the same saved directory."""
    path = tmp_path_factory.mktemp(name) / "model"
    hf = write_tiny_model(path, name)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, block_size=4, progress=False,
              max_model_len=max_model_len(name), **engine_kwargs)
    return hf, llm


@pytest.fixture(scope="module", params=list(architectures()))
def arch_pair(request, tmp_path_factory):
    """(name, transformers model, pdserve LLM) over the same saved directory."""
    return request.param, *_build(request.param, tmp_path_factory)


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
    out = llm.generate([PROMPT], SamplingParams(max_tokens=NUM_GENERATED, temperature=0.0, ignore_eos=True,
                                                logprobs=0))[0].outputs[0]
    assert len(out.token_ids) == NUM_GENERATED
    hf_logits = hf_next_token_logits(hf, PROMPT, out.token_ids)
    assert hf_logits.argmax(-1).tolist() == out.token_ids
    hf_logprobs = torch.log_softmax(hf_logits, dim=-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(hf_logprobs[i, out.token_ids[i]].item(), abs=LOGIT_ATOL)


def test_batched_decode_matches_single(arch_pair):
    """Two sequences of different lengths decoded in one batch give each one's own greedy tokens."""
    name, hf, llm = arch_pair
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT, PROMPT[3:10]]
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert len(out.outputs[0].token_ids) == 6
        assert_greedy(hf, prompt, out.outputs[0].token_ids)


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
