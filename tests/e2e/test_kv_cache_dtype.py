"""kv_cache_dtype="bfloat16" on the real default model: float32 compute over a KV cache of half the bytes."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.e2e.test_default_model import BATCH_PROMPTS, PROMPTS, engine_last_logits, engine_prefill

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_kv_bf16(default_model_path) -> LLM:
    """The default load (the file's codes kept) with the KV cache in bfloat16; llm_kept is the same with float32."""
    return LLM(model=str(default_model_path), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory=64 * 2**20,
               progress=False)


def test_the_cache_is_bfloat16_and_holds_twice_the_tokens(llm_kv_bf16, llm_kept):
    assert llm_kv_bf16.engine.runner.kv_cache.dtype == torch.bfloat16
    assert llm_kept.engine.runner.kv_cache.dtype == torch.float32
    assert llm_kv_bf16.engine.runner.num_blocks == 2 * llm_kept.engine.runner.num_blocks


def test_perplexity_stays_within_a_percent_of_the_float32_cache(llm_kv_bf16, llm_kept):
    """What the rounding costs, where it counts: the default model's perplexity over 512 tokens of held-out text
    (bench/bench_quality.py's text; 0.1% over all of it there). Its chat answer to "What is the capital of
    France?" is not a test here: it starts on a near tie (README, "Native CPU matmuls") that the rounding flips."""
    text = (Path(__file__).resolve().parents[2] / "bench/data/shakespeare_eval.txt").read_text(encoding="utf-8")
    ids = llm_kept.tokenizer.encode(text)[:512]
    ours, reference = perplexity(llm_kv_bf16, ids), perplexity(llm_kept, ids)
    print(f"perplexity over {len(ids)} tokens: bfloat16 cache {ours:.3f}, float32 cache {reference:.3f}")
    assert abs(ours / reference - 1) < 0.01


def perplexity(llm, ids: list[int]) -> float:
    """exp of the mean next-token loss of one prefill over `ids`."""
    logits = llm.engine.runner.model.compute_logits(engine_prefill(llm, ids)[:-1]).float()
    return math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_stay_close_to_the_float32_cache(llm_kv_bf16, llm_kept, prompt):
    ids = llm_kv_bf16.tokenizer.encode(prompt)
    ours, reference = engine_last_logits(llm_kv_bf16, ids), engine_last_logits(llm_kept, ids)
    assert torch.argmax(ours) == torch.argmax(reference)
    print(f"max |logit diff| vs the float32 cache: {(ours - reference).abs().max().item():.3f}")
    assert (ours - reference).abs().max().item() < 0.5


def test_decoded_tokens_are_the_argmax_of_one_prefill_over_them(llm_kv_bf16):
    """Decode steps read the cache as the prompt's prefill does (both attend over its bfloat16 rows): one cold
    prefill of prompt + generated tokens puts each generated token at the argmax of the position before it."""
    for prompt in PROMPTS:
        ids = llm_kv_bf16.tokenizer.encode(prompt)
        generated = llm_kv_bf16.generate([ids], GREEDY)[0].outputs[0].token_ids
        llm_kv_bf16.engine.kv.pool.clear_cache()
        full = ids + generated[:-1]
        logits = [engine_last_logits(llm_kv_bf16, full[:n]) for n in range(len(ids), len(full) + 1)]
        assert [int(torch.argmax(row)) for row in logits] == generated, prompt


def test_batch_invariance_and_prefix_cache_hits(llm_kv_bf16):
    together = [o.outputs[0].token_ids for o in llm_kv_bf16.generate(BATCH_PROMPTS, GREEDY)]
    alone = [llm_kv_bf16.generate(p, GREEDY)[0].outputs[0].token_ids for p in BATCH_PROMPTS]
    assert together == alone
    ids = llm_kv_bf16.tokenizer.encode(" ".join(BATCH_PROMPTS))
    assert len(ids) >= 32
    llm_kv_bf16.generate([ids[:32] + [11]], GREEDY)
    warm = llm_kv_bf16.generate([ids[:32] + [13]], GREEDY)[0]
    assert warm.num_cached_tokens == 32
    llm_kv_bf16.engine.kv.pool.clear_cache()
    cold = llm_kv_bf16.generate([ids[:32] + [13]], GREEDY)[0]
    assert cold.num_cached_tokens == 0 and warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert llm_kv_bf16.engine.stats().used_blocks == 0
