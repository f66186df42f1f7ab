"""The real default model through the offline engine, checked against Hugging Face transformers."""

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.model import AttentionMetadata
from engine.sampling_params import SamplingParams
from tests.batching import assert_same_alone_as_batched

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
]
# Measured max |logit difference| vs transformers in float32: 1.5e-5 to 2.5e-5 on logits of magnitude ~20;
# the bound leaves room for other BLAS builds.
LOGIT_ATOL = 1e-3


def engine_last_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """Prefill `token_ids` into scratch blocks of the engine's own cache and return the last-position logits."""
    hidden = engine_prefill(llm, token_ids)
    return llm.engine.runner.model.compute_logits(hidden[-1:])[0]


def engine_prefill(llm, token_ids: list[int]) -> torch.Tensor:
    """The hidden states of one prefill of `token_ids` into scratch blocks of the engine's own cache."""
    runner = llm.engine.runner
    n = len(token_ids)
    num_blocks = -(-n // runner.block_size)
    block_ids = list(range(runner.num_blocks - num_blocks, runner.num_blocks))   # any blocks will do
    slots = [block_ids[p // runner.block_size] * runner.block_size + p % runner.block_size for p in range(n)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=torch.tensor([block_ids], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32))
    return runner.model.forward(torch.tensor(token_ids), torch.arange(n), runner.kv_cache, meta)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_last_logits_match_transformers(llm, hf_model, prompt):
    ids = llm.tokenizer.encode(prompt)
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0, -1].float()
    ours = engine_last_logits(llm, ids)
    assert torch.argmax(ours) == torch.argmax(expected)
    print(f"max |logit diff| vs transformers: {(ours - expected).abs().max().item():.2e}")
    assert (ours - expected).abs().max().item() < LOGIT_ATOL


def test_32_greedy_tokens_match_transformers(llm, hf_model):
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        ours = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
        assert ours.outputs[0].token_ids == hf_greedy(hf_model, ids, 32)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding, re-running the whole sequence each step (no cache: nothing to disagree about)."""
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(torch.argmax(model(torch.tensor([out])).logits[0, -1])))
    return out[len(ids):]


def test_capital_of_france_is_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


BATCH_PROMPTS = [
    "The quick brown fox",
    "In 1492, Columbus",
    "Water boils at",
    "The best way to learn programming is",
    "Photosynthesis is the process by which",
    "import numpy as np\n",
    "My favourite food is",
    "The three primary colours are",
]


def test_batch_invariance_of_greedy_tokens(llm):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(BATCH_PROMPTS, params)]
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in BATCH_PROMPTS]
    assert together == alone


def test_preemption_under_a_small_pool_gives_same_tokens(llm, default_model_path, default_model):
    from engine.llm import LLM

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = [o.outputs[0].token_ids for o in llm.generate(BATCH_PROMPTS, params)]
    small = LLM(model=str(default_model_path), dtype="float32", num_kv_blocks=10, max_model_len=160,
                enable_prefix_caching=False, progress=False, loaded=default_model)  # llm's float32 weights
    tight = small.generate(BATCH_PROMPTS, params)
    assert [o.outputs[0].token_ids for o in tight] == roomy
    assert small.engine.stats().preemptions > 0
    assert small.engine.stats().used_blocks == 0


def test_prefix_cache_hit_reports_cached_tokens_and_same_tokens(llm):
    shared = ("You are a meticulous assistant. Answer briefly and precisely, citing the facts you rely on. "
              "Never invent details you are not sure about. If a question is ambiguous, say which reading "
              "you chose and why, then answer that reading in one or two sentences.")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = llm.tokenizer.encode(shared)
    assert len(ids) >= 48
    first = llm.generate([ids[:48] + llm.tokenizer.encode(" Question one?")], params)[0]
    second_ids = ids[:48] + llm.tokenizer.encode(" What is two plus two?")
    warm = llm.generate([second_ids], params)[0]
    assert warm.num_cached_tokens == 48
    llm.engine.kv.pool.clear_cache()
    cold = llm.generate([second_ids], params)[0]
    assert cold.num_cached_tokens == 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert first.outputs[0].token_ids


@pytest.mark.parametrize("prompt, params, field", [
    ("", SamplingParams(), "prompt"),
    ("word " * 9000, SamplingParams(), "prompt"),
    ("Hi", SamplingParams(temperature=-0.5), "temperature"),
    ("Hi", SamplingParams(top_p=0.0), "top_p"),
    ("Hi", SamplingParams(top_p=1.01), "top_p"),
    ("Hi", SamplingParams(max_tokens=0), "max_tokens"),
])
def test_bad_input_names_the_field(llm, prompt, params, field):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(prompt, params)
    assert e.value.field == field and field in str(e.value)
    assert not llm.engine.has_unfinished()


def test_kept_codes_hold_the_files_bytes_and_still_answer_paris(llm_kept, default_model_path):
    """keep_quantized_weights keeps the file's codes: the Q4_1 layers as int4 (codes held once, bfloat16 scale and
    zero per 32), the Q8_0 embedding / LM head as int8, so loaded weight memory is within 1.3x of the file's
    tensor bytes (measured: 90.7 MiB of 92.1 MiB) and far below float32's (~513 MiB)."""
    from gguf import GGUFReader

    from engine.quant import Int4Linear, Int8Linear

    tensors = GGUFReader(str(default_model_path)).tensors
    engine, model = llm_kept.engine, llm_kept.engine.runner.model
    assert engine.file_tensor_bytes == sum(int(t.n_bytes) for t in tensors)
    float32_bytes = 4 * sum(int(t.n_elements) for t in tensors)
    assert engine.weight_memory_bytes <= 1.3 * engine.file_tensor_bytes
    assert engine.weight_memory_bytes < float32_bytes / 4
    assert isinstance(model.lm_head, Int8Linear) and model.embed is model.lm_head
    assert all(isinstance(lin, Int4Linear) for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up,
                                                                                    layer.down))
    out = llm_kept.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"


def test_kept_codes_give_a_sequence_the_same_tokens_and_logprobs_alone_as_in_a_batch(llm_kept):
    """With one thread, a sequence's greedy tokens and logprobs do not depend on what it is batched with: every
    int4 layer, the int8 head and decode attention compute each row on its own (bfloat16 activations would turn
    any batch-dependent last bit into a different token on a near tie: "def fibonacci(n):" has one, its top two
    0.04 apart, and batched with others it used to go another way at its 14th token)."""
    assert_same_alone_as_batched(llm_kept, max_tokens=16)


# --- weight-only quantization ----------------------------------------------------------------------------------
LONG_PROMPT = ("The history of science is the study of the development of science and scientific knowledge, "
               "including both the natural and social sciences. ") * 3  # 73 tokens: prefill takes the GEMM path
# Measured max |logit difference| vs float32 on these 12 prompts (logits of magnitude 17-35): int8 0.66 to 1.28,
# int4 0.51 to 1.18 (its codes are the checkpoint's own Q4_1 codes; the rest is bfloat16 rounding), the default
# kept codes (keep_quantized_weights) 0.43 to 0.94 (the same int4 layers; the LM head int8 from the file's Q8_0 codes).
QUANTIZED_LOGIT_ATOL = 2.0
# float32's top-1 leads its runner-up by 0.04 to 3.0 here; under this margin a flip is within the error above.
TOP1_MARGIN = 0.5


def test_int8_capital_of_france_is_paris(llm_int8):
    out = llm_int8.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("quantized", ["llm_int8", "llm_int4", "llm_kept"])
def test_quantized_logits_stay_close_to_float32(llm, quantized, request):
    llm_q = request.getfixturevalue(quantized)
    prompts = PROMPTS + BATCH_PROMPTS + [LONG_PROMPT]
    assert len(llm.tokenizer.encode(LONG_PROMPT)) > 32
    flips = []
    for prompt in prompts:
        ids = llm.tokenizer.encode(prompt)
        expected, ours = engine_last_logits(llm, ids), engine_last_logits(llm_q, ids)
        print(f"max |logit diff| {quantized} vs float32: {(ours - expected).abs().max().item():.2f}")
        assert (ours - expected).abs().max().item() < QUANTIZED_LOGIT_ATOL
        if torch.argmax(ours) != torch.argmax(expected):
            top2 = expected.topk(2).values
            flips.append((prompt, (top2[0] - top2[1]).item()))
    print(f"{quantized} top-1 flips: {flips}")
    # Measured: int8 none; int4 one, "import numpy as np\n" (float32 margin 0.10); kept one, "def fibonacci"
    # (margin 0.04).
    assert all(margin < TOP1_MARGIN for _, margin in flips), flips
    assert len(flips) <= 1, flips


def test_int8_model_has_its_own_fingerprint(llm, llm_int8):
    from engine.quant import quantized_fingerprint

    assert llm_int8.engine.fingerprint == quantized_fingerprint(llm.engine.fingerprint, "int8")
    assert llm_int8.engine.fingerprint != llm.engine.fingerprint


def test_int4_keeps_every_q4_1_code_of_the_checkpoint(default_model_path):
    """Int4Linear.quantize of a Q4_1 tensor's weights (q * d + m per block of 32) gives back the file's codes q."""
    import numpy as np
    from gguf import GGUFReader

    from engine.quant import Int4Linear

    q4_1 = [t for t in GGUFReader(str(default_model_path)).tensors if t.tensor_type.name == "Q4_1"]
    assert len(q4_1) == 210  # every layer matrix of SmolLM2-135M's file
    for tensor in q4_1:
        blocks = np.asarray(tensor.data).reshape(-1, 20)  # Q4_1 block: fp16 d, fp16 m, 16 bytes of nibbles
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        codes = np.concatenate([blocks[:, 4:] & 15, blocks[:, 4:] >> 4], axis=1)  # elements 0-15, then 16-31
        rows = tensor.data.shape[0]
        weight = torch.from_numpy((codes * d + m).reshape(rows, -1))
        lin = Int4Linear.quantize(weight)
        assert torch.equal(lin.codes(), torch.from_numpy(codes.reshape(rows, -1))), tensor.name
