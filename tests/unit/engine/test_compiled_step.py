"""The compiled decode step (engine.compiled_step) against the eager engine and transformers, on a tiny random
Llama. One engine compiled for batch size 2 serves every test (a compile takes tens of seconds on a small CPU):
batch 1 runs padded to 2, batch 2 exactly, larger batches and prefill steps eager."""

import pytest
import torch
from test_engine_tiny import prompts
from tiny_model import run, tiny_engine, tiny_hf_model

import kernels
from engine.compiled_step import CompiledDecodeStep
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers", reason="the dev extra provides transformers")


@pytest.fixture(scope="module")
def compiled_engine():
    engine = tiny_engine(compile_decode=True, compile_batch_sizes=(2,), max_model_len=256)
    assert engine.runner.compiled is not None
    return engine


class _Counting:
    """Counts the steps the compiled graph runs (to prove the tests exercise it)."""

    def __init__(self, compiled: CompiledDecodeStep) -> None:
        self.compiled, self.runs = compiled, 0
        self._run = compiled.run

    def __enter__(self):
        def counted(batch):
            self.runs += 1
            return self._run(batch)
        self.compiled.run = counted
        return self

    def __exit__(self, *exc):
        del self.compiled.run


def _hf_greedy(ids: list[int], n: int) -> list[int]:
    model = tiny_hf_model()
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(torch.argmax(model(torch.tensor([out])).logits[0, -1])))
    return out[len(ids):]


def test_greedy_matches_transformers_and_eager(compiled_engine):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ps = prompts(2, seed=5)
    with _Counting(compiled_engine.runner.compiled) as counter:
        alone = run(compiled_engine, ps[:1], [greedy])       # batch 1, padded to 2
        together = run(compiled_engine, ps, [greedy] * 2)    # batch 2
    assert counter.runs == 2 * 5
    expected = [_hf_greedy(p, 6) for p in ps]
    assert alone == expected[:1] and together == expected == run(tiny_engine(), ps, [greedy] * 2)


def test_uneven_batch_with_seeds_matches_eager(compiled_engine):
    """3 rows (eager: over the largest size), then 2 (compiled), then 1 (compiled, padded) as sequences end."""
    ps = prompts(3, seed=6)
    params = [SamplingParams(max_tokens=2 + 2 * i, temperature=0.8, seed=10 + i, ignore_eos=True) for i in range(3)]
    with _Counting(compiled_engine.runner.compiled) as counter:
        outputs = run(compiled_engine, ps, params)
    assert counter.runs == 4
    assert outputs == run(tiny_engine(), ps, params)


def test_padding_rows_write_no_kv():
    """The attention op skips rows of context length 0 (padding): the cache holds only the real row's K/V."""
    torch.manual_seed(0)
    kv_cache = torch.zeros(1, 2, 4, 4, 2, 16)  # [L, 2, blocks, block_size, kv_heads, D]
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    tables = torch.tensor([[1, 0], [0, 0]], dtype=torch.int32)
    with torch.inference_mode():
        out = torch.ops.pdserve.paged_decode_attention(
            q, k, v, kv_cache, 0, torch.tensor([5, -1]), tables, torch.tensor([2, 0], dtype=torch.int32),
            torch.arange(3, dtype=torch.int32), 0.25, None, None)
        expected_cache = torch.zeros_like(kv_cache)
        kernels.write_kv(k[:1], v[:1], expected_cache[0, 0], expected_cache[0, 1], torch.tensor([5]))
        expected = kernels.paged_attention(q[:1], expected_cache[0, 0], expected_cache[0, 1], tables[:1],
                                           torch.tensor([2], dtype=torch.int32),
                                           torch.tensor([0, 1], dtype=torch.int32), 0.25)
    assert torch.equal(kv_cache, expected_cache)
    assert torch.equal(out[:1], expected) and torch.equal(out[1], torch.zeros(4, 16))


def test_stats_report_compile_seconds(compiled_engine):
    assert compiled_engine.stats().decode_compile_seconds > 0
    assert tiny_engine().stats().decode_compile_seconds == 0


def test_compile_batch_sizes_are_validated():
    for sizes in ((), (0, 2)):
        with pytest.raises(ValueError, match="compile_batch_sizes"):
            EngineConfig(model="m", compile_batch_sizes=sizes)
