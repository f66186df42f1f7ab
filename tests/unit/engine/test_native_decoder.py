"""The native decoder (kernels.cpu_ops.DecoderLayers: a pure decode batch through every layer in one C call)
against the Python layer loop over the same kernels: the same logits bit for bit, through the engine's own
steps (mixed prompt lengths, sliding windows, q/k/v biases, partial rotary, every native matmul kind), and
nothing taken that it cannot run."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import PROMPT, write_tiny_model

from engine.llm import LLM
from engine.model import AttentionMetadata
from engine.sampling_params import SamplingParams
from kernels import cpu_matmul, cpu_ops

pytest.importorskip("transformers", reason="the dev extra provides transformers (tiny checkpoints)")
pytestmark = pytest.mark.skipif(not (cpu_ops.available() and cpu_matmul.available()),
                                reason="the native CPU kernels need a C compiler")

PROMPTS = [PROMPT, PROMPT[:5], PROMPT[3:] + PROMPT]  # 13, 5 and 23 tokens: decode steps of mixed context lengths


class Counting:
    """The model's native decoder, counting the steps it ran (returned hidden states, not None)."""

    def __init__(self, decoder: cpu_ops.DecoderLayers) -> None:
        self.decoder, self.steps = decoder, 0

    def __call__(self, *args):
        out = self.decoder(*args)
        self.steps += out is not None
        return out


def generate(llm: LLM, prompts, native: bool):
    model = llm.engine.runner.model
    decoder = model.native_decoder
    counting = Counting(decoder.decoder if isinstance(decoder, Counting) else decoder)
    model.native_decoder = counting if native else None
    llm.engine.kv.pool.clear_cache()  # both runs prefill every prompt cold
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    finally:
        model.native_decoder = counting.decoder
    return [(o.token_ids, [(t.logprob, t.top) for t in o.logprobs]) for o in outs], counting.steps


def assert_native_equals_loop(llm: LLM, prompts) -> None:
    assert llm.engine.runner.model.native_decoder is not None
    native, steps = generate(llm, prompts, native=True)
    loop, loop_steps = generate(llm, prompts, native=False)
    assert steps >= 9 and loop_steps == 0  # every decode step after the prompts' ran natively
    assert native == loop


@pytest.mark.parametrize("name,quantization,cpu_matmul", [
    ("llama", "int4", "native-bf16"), ("llama", "int8", "native-bf16"), ("llama", "int8", "native"),
    ("llama", "int4", "native"), ("qwen2", "int4", "native-bf16"), ("phi3", "int8", "native-bf16"),
    ("phi3-partial-rotary", "int4", "native-bf16")])
def test_tiny_models_decode_the_same_bits_natively(name, quantization, cpu_matmul, tmp_path):
    """llama3 RoPE scaling, qwen2's q/k/v biases, phi3's sliding window (13 > its 8-token window), a rotary
    half the head: through the engine, batch of three, with logprobs."""
    path = tmp_path / "model"
    write_tiny_model(path, name)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, block_size=4, progress=False,
              quantization=quantization, cpu_matmul=cpu_matmul)
    assert_native_equals_loop(llm, PROMPTS)


@pytest.fixture(scope="module")
def default_llm(default_model_path):
    return LLM(model=str(default_model_path), progress=False, num_kv_blocks=64, num_threads=2)


def test_default_model_decodes_the_same_bits_natively(default_llm):
    tokenizer = default_llm.tokenizer
    prompts = [tokenizer.encode(t) for t in ("What is the capital of France?", "Write a haiku about rain.", "1, 2,")]
    assert_native_equals_loop(default_llm, prompts)


def test_models_it_cannot_run_have_none(tmp_path):
    """Float weights (no native matmul) and per-head q/k norms (Qwen3) keep the layer loop."""
    for name, quantization in (("llama", None), ("qwen3", "int4")):
        path = tmp_path / name
        write_tiny_model(path, name)
        llm = LLM(model=str(path), dtype="float32", num_kv_blocks=16, block_size=4, progress=False,
                  quantization=quantization)
        assert llm.engine.runner.model.native_decoder is None, name


def _decode_meta(block_tables: list[list[int]], seq_lens: list[int], block_size: int) -> AttentionMetadata:
    slots = [table[(n - 1) // block_size] * block_size + (n - 1) % block_size
             for table, n in zip(block_tables, seq_lens)]
    return AttentionMetadata(slot_mapping=torch.tensor(slots),
                             block_tables=torch.tensor(block_tables, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_on_a_cache_of_either_dtype_equals_the_loop(default_llm, dtype):
    """The C side reads and writes float32 and bfloat16 caches, as the ops it calls do."""
    runner = default_llm.engine.runner
    model = runner.model
    cache = torch.randn(runner.kv_cache.shape[:2] + (8,) + runner.kv_cache.shape[3:]).to(dtype)
    meta = _decode_meta([[0, 1, 2], [5, 4, 0]], [40, 19], runner.block_size)
    ids, positions = torch.tensor([17, 4000]), torch.tensor([39, 18])
    loop_cache = cache.clone()
    decoder = model.native_decoder
    model.native_decoder = counting = Counting(decoder)
    try:
        native = model.forward(ids, positions, cache, meta)
    finally:
        model.native_decoder = decoder
    loop = model.hidden_states(ids, positions, loop_cache, meta, model.attention)
    assert counting.steps == 1  # the forward above ran natively
    assert torch.equal(native, loop) and torch.equal(cache, loop_cache)


def test_batches_it_does_not_take_run_the_loop_and_bad_ids_are_named(default_llm):
    runner = default_llm.engine.runner
    model, decoder = runner.model, runner.model.native_decoder
    cache = torch.zeros(runner.kv_cache.shape[:2] + (8,) + runner.kv_cache.shape[3:])
    h = torch.randn(2, decoder.hidden)
    ids, positions = torch.tensor([17, 40]), torch.tensor([39, 18])
    meta = _decode_meta([[0, 1, 2], [5, 4, 0]], [40, 19], runner.block_size)
    args = (positions, cache, meta.slot_mapping, meta.block_tables, meta.seq_lens)
    # two tokens of one sequence (a prefill chunk), not one token each of two
    assert decoder(h, *args, torch.tensor([0, 0, 2], dtype=torch.int32)) is None
    bad = _decode_meta([[0, 8, 2], [5, 4, 0]], [40, 19], runner.block_size)  # block 8 of 8 blocks
    assert decoder(h, positions, cache, bad.slot_mapping, bad.block_tables, bad.seq_lens, bad.query_start_loc) is None
    assert decoder(h, torch.tensor([39, 10**6]), *args[1:], meta.query_start_loc) is None  # beyond the RoPE table
    beyond_table = torch.tensor([40, 3 * runner.block_size + 1], dtype=torch.int32)  # more than its 3 blocks
    assert decoder(h, *args[:4], beyond_table, meta.query_start_loc) is None
    assert not cache.any()  # nothing written by a batch it did not take
    with pytest.raises(ValueError, match="block_tables"):  # the loop names what is wrong
        model.forward(ids, positions, cache, bad)
