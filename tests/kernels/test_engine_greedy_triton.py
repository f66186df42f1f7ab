"""End to end: the engine's greedy tokens with the Triton kernels equal those of the torch reference path.

A random-weight Llama-shaped model (GQA 4:1, two layers), prompts of several lengths, one of them sharing a
16-token prefix with another (a prefix-cache hit: prefill attention over cached blocks), a token budget small
enough to chunk the longest prompt, then decode steps with several sequences: every kernel the engine calls (KV
write, prefill and decode attention, RMSNorm with and without residual, rotary) runs on both paths. On CPU the
Triton kernels run in the interpreter (`kernels.set_backend("triton")`); on CUDA (`gpu`) the same engine runs
compiled, in float32 and bfloat16, against the reference path on the same device.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import kernels
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel
from engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "engine"))
from tiny_model import TINY, run, tiny_weights  # noqa: E402

CONFIG = dataclasses.replace(TINY, vocab_size=256, hidden_size=128, intermediate_size=256, num_heads=8,
                             num_kv_heads=2, head_dim=16)
PREFIX = [5, 17, 99, 3, 42, 8, 77, 120, 64, 31, 2, 250, 11, 90, 45, 7]  # one whole 16-token block
PROMPTS = [PREFIX + [13, 14, 15], [9], list(range(30, 70)), PREFIX + [200, 201]]
NEW_TOKENS = 6


def tiny_gqa_engine(device: str, dtype: str, **config) -> LLMEngine:
    """An engine over CONFIG's random weights, 64 blocks of 16 slots."""
    loaded = LoadedModel(config=CONFIG, weights=tiny_weights(CONFIG, seed=3), tokenizer=None,
                         fingerprint="tiny-random-gqa")
    return LLMEngine(EngineConfig(model="tiny-random-gqa", device=device, dtype=dtype, num_kv_blocks=64,
                                  block_size=16, **config), loaded=loaded)


def greedy_tokens(backend: str, device: str, dtype: str,
                  params: SamplingParams | None = None) -> list[list[int]]:
    """Tokens of PROMPTS (greedy unless `params` says otherwise) from an engine on `device` with `backend`."""
    engine = tiny_gqa_engine(device, dtype, max_num_batched_tokens=32)
    params = params or SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    kernels.set_backend(backend)
    try:
        first = run(engine, PROMPTS[:1], [params])  # caches PREFIX's block for the last prompt
        rest = run(engine, PROMPTS[1:], [params] * (len(PROMPTS) - 1))
    finally:
        kernels.set_backend("auto")
    assert engine.kv.pool.get_num_used_blocks() == 0  # every block released
    return first + rest


def test_engine_greedy_tokens_triton_equal_torch():
    reference = greedy_tokens("torch", "cpu", "float32")
    assert all(len(tokens) == NEW_TOKENS for tokens in reference)
    assert greedy_tokens("triton", "cpu", "float32") == reference


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_greedy_tokens_triton_equal_torch_cuda(dtype):
    reference = greedy_tokens("torch", "cuda", dtype)
    ours = greedy_tokens("auto", "cuda", dtype)  # auto: Triton on CUDA tensors
    if dtype == "float32":
        assert ours == reference
    else:  # bf16 rounds differently in each path: a near-tie may flip, so one sequence of four may differ
        assert sum(a == b for a, b in zip(ours, reference)) >= len(PROMPTS) - 1, (ours, reference)


# Every option the sampler applies to logits, each on the model's device (engine.step_batch.run_step leaves the
# logits there): penalties, logit bias, min_tokens with stop ids, temperature with top-k / top-p / min-p, logprobs.
SAMPLED = [
    SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3, logit_bias=((7, 5.0),)),
    SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, min_p=0.1, repetition_penalty=1.3, seed=8,
                   ignore_eos=True),
    SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, frequency_penalty=0.5, presence_penalty=0.4, seed=9,
                   min_tokens=NEW_TOKENS, stop_token_ids=(3, 4)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("params", SAMPLED, ids=["greedy-logprobs-bias", "topk-topp", "minp-repetition",
                                                  "penalties-min-tokens"])
def test_engine_sampling_on_cuda_equals_cpu(params):
    """float32 both ways: the sampler on CUDA logits picks the tokens it picks on CPU ones (the noise of seeded
    rows comes from a CPU generator on both)."""
    assert greedy_tokens("auto", "cuda", "float32", params) == greedy_tokens("torch", "cpu", "float32", params)


def _cuda_step_inputs(device: str) -> dict[str, tuple]:
    """(input_ids, positions, AttentionMetadata) of a decode step (3 sequences at 5, 17 and 33 tokens) and of a
    20-token prefill, over distinct blocks of 16 slots."""
    from engine.model import AttentionMetadata

    def tensors(ids, positions, slots, tables, seq_lens, starts, max_query_len):
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            max_query_len=max_query_len, max_seq_len=max(seq_lens))
        return (torch.tensor(ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device), meta)

    return {"decode": tensors([1, 2, 3], [4, 16, 32], [4, 2 * 16, 5 * 16], [[0, 0, 0], [1, 2, 0], [3, 4, 5]],
                              [5, 17, 33], [0, 1, 2, 3], 1),
            "prefill": tensors(list(range(20)), list(range(20)), list(range(6 * 16, 6 * 16 + 20)), [[6, 7]], [20],
                               [0, 20], 20)}


@pytest.mark.gpu
def test_forward_queues_its_kernels_without_a_device_sync():
    """A step's forward never waits on the GPU (AttentionMetadata carries the batch's bounds from the host), so
    the host runs ahead while kernels execute; torch raises on any synchronizing call inside. Without the
    bounds the attention reads them from the device, and the check catches that."""
    engine = tiny_gqa_engine("cuda", "bfloat16")
    model, kv_cache = engine.runner.model, engine.runner.kv_cache
    steps = _cuda_step_inputs("cuda")
    with torch.inference_mode():
        for ids, positions, meta in steps.values():
            model.forward(ids, positions, kv_cache, meta)  # Triton compiles outside the checked region
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for ids, positions, meta in steps.values():
                model.forward(ids, positions, kv_cache, meta)
            ids, positions, meta = steps["decode"]
            meta = dataclasses.replace(meta, max_query_len=None)
            with pytest.raises(RuntimeError, match="synchroniz"):
                model.forward(ids, positions, kv_cache, meta)
        finally:
            torch.cuda.set_sync_debug_mode(0)
