"""engine.kv_digests: a prefill step takes the digest of every block it finishes as it writes each layer, and the
digests equal those of the blocks hashed in place after the prefill (what a push would send); blocks a sequence
did not write, and steps that skip the layer loop, get none; freed blocks lose theirs."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_digests import StepDigests, finished_blocks
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kernels import cpu_kv_copy
from kvstore.shm_cache import block_digests_in_place
from tests.unit.engine.tiny_model import tiny_loaded

GREEDY_ONE = SamplingParams(max_tokens=1, temperature=0.0)


def shm_engine(**kw) -> LLMEngine:
    """A prefill worker's engine on one host: the cache in shared memory, digests taken."""
    config = EngineConfig(model="tiny-random", **({"num_kv_blocks": 64, "block_size": 4, "dtype": "float32"} | kw))
    engine = LLMEngine(config, loaded=tiny_loaded(), kv_cache_in_shm=True, kv_digests=True)
    assert engine.runner.kv_digests and engine.runner.kv_segment is not None
    return engine


def prefill(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, Sequence]:
    seqs = {rid: engine.add_request(rid, p, GREEDY_ONE, hold_blocks=True) for rid, p in prompts.items()}
    while engine.has_unfinished():
        engine.step()
    return seqs


def in_place(engine: LLMEngine, block_ids) -> dict[int, bytes]:
    return dict(zip(block_ids, block_digests_in_place(engine.runner.kv_cache, list(block_ids))))


@pytest.mark.skipif(not cpu_kv_copy.available(), reason="no native kv copy library")
@pytest.mark.parametrize("chunk", [7, 10, 2048])  # chunks that end inside a block, and one step per prompt
def test_every_block_a_prefill_wrote_has_the_digest_of_its_bytes(chunk):
    engine = shm_engine(max_num_batched_tokens=chunk, max_num_seqs=4)
    try:
        seqs = prefill(engine, {"a": list(range(3, 40)), "b": list(range(50, 61)), "c": list(range(70, 78))})
        for seq in seqs.values():  # 37 tokens: 10 blocks, the last partial; 11: 3; 8: exactly 2 full
            assert len(seq.block_ids) == -(-seq.num_prompt_tokens // 4)
            assert seq.kv_digests == in_place(engine, seq.block_ids), seq.request_id
            for block_id in seq.block_ids:  # the definition: the block's raw record
                assert seq.kv_digests[block_id] == block_digests_in_place(engine.runner.kv_cache, [block_id])[0]
    finally:
        engine.runner.close()


@pytest.mark.skipif(not cpu_kv_copy.available(), reason="no native kv copy library")
def test_prefix_cache_hits_get_no_digest_and_freed_blocks_lose_theirs():
    engine = shm_engine()
    try:
        first = prefill(engine, {"a": list(range(3, 40))})["a"]
        engine.abort("a")  # released: its full blocks stay in the prefix cache
        assert first.kv_digests == {}
        second = prefill(engine, {"b": list(range(3, 37)) + [99, 98, 97, 96]})["b"]
        assert second.num_cached_tokens == 32  # 8 blocks from the cache, written by "a"
        assert set(second.kv_digests) == set(second.block_ids[8:])
        assert second.kv_digests == in_place(engine, second.block_ids[8:])
    finally:
        engine.runner.close()


def test_a_block_is_finished_by_the_step_that_writes_its_last_slot_or_ends_the_prompt():
    seq = Sequence("r", list(range(10)), GREEDY_ONE, seed=0)  # 10 tokens, blocks of 4: 0-3, 4-7, 8-9
    assert finished_blocks(seq, 0, 3, 4) == []
    assert finished_blocks(seq, 3, 4, 4) == [0]
    assert finished_blocks(seq, 0, 7, 4) == [0]
    assert finished_blocks(seq, 7, 10, 4) == [1, 2]  # the prompt ends: its partial last block goes too
    assert finished_blocks(seq, 0, 10, 4) == [0, 1, 2]


@pytest.mark.skipif(not cpu_kv_copy.available(), reason="no native kv copy library")
def test_a_step_that_skips_a_layer_or_fails_leaves_no_digest():
    engine = shm_engine()
    try:
        seq = prefill(engine, {"a": list(range(3, 12))})["a"]
        cache, blocks = engine.runner.kv_cache, [(seq, b) for b in seq.block_ids]
        seq.kv_digests = {}
        with StepDigests.build(cache, blocks) as digests:
            digests.after_kv_write(1)  # before layer 0: out of order, nothing is taken
            digests.after_kv_write(0)
            digests.after_kv_write(1)
        assert seq.kv_digests == {}
        with StepDigests.build(cache, blocks) as digests:
            digests.after_kv_write(0)  # the last layer never came
        assert seq.kv_digests == {}
        with pytest.raises(RuntimeError), StepDigests.build(cache, blocks) as digests:
            digests.after_kv_write(0)
            digests.after_kv_write(1)
            raise RuntimeError("the step failed after writing every layer")
        assert seq.kv_digests == {}
        with StepDigests.build(cache, blocks) as digests:
            digests.after_kv_write(0)
            digests.after_kv_write(1)
        assert seq.kv_digests == in_place(engine, seq.block_ids)
        assert StepDigests.build(cache, []) is None and StepDigests.build(cache.clone()[:, :, ::2], blocks) is None
    finally:
        engine.runner.close()


def test_an_engine_not_asked_takes_no_digests_and_a_private_cache_asked_does():
    """Only a prefill worker's engine takes them (LLMEngine(kv_digests=True)), in shared memory or not: a
    prefill worker pushing over grpc has a private cache and sends them as well."""
    config = EngineConfig(model="tiny-random", num_kv_blocks=64, block_size=4, dtype="float32")
    engine = LLMEngine(config, loaded=tiny_loaded())
    assert not engine.runner.kv_digests
    assert prefill(engine, {"a": list(range(3, 20))})["a"].kv_digests == {}
    private = LLMEngine(config, loaded=tiny_loaded(), kv_digests=True)
    assert private.runner.kv_digests and private.runner.kv_segment is None
    seq = prefill(private, {"a": list(range(3, 20))})["a"]
    assert seq.kv_digests == in_place(private, seq.block_ids) and len(seq.kv_digests) == len(seq.block_ids)
