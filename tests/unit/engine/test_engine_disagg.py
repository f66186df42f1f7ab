"""Disaggregation hooks of the engine on the tiny random Llama: prefill on one engine, decode on another."""

import dataclasses

import pytest
import torch

import kernels
from engine.block_lease import LeaseState
from engine.config import EngineConfig
from engine.errors import OverloadedError
from engine.sampling_params import SamplingParams
from test_engine_tiny import prompts
from tiny_model import run, tiny_engine

PARAMS = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)]


def prefill_then_decode(prefill, decode, rid, prompt, params, seed):
    """What the two workers do for one request, minus the network."""
    reserved = decode.reserve(rid, prompt, params, seed=seed)
    num_hit_blocks = reserved.num_computed_tokens // decode.kv.block_size
    seq = prefill.add_request(rid, prompt, dataclasses.replace(params, max_tokens=1), seed=seed, hold_blocks=True)
    while not seq.is_finished:
        prefill.step()
    staging = kernels.gather_blocks(prefill.runner.kv_cache, torch.tensor(seq.block_ids[num_hit_blocks:]))
    lease = decode.get_lease(rid)
    lease.pin(LeaseState.RESERVED, LeaseState.RECEIVING)   # what the KvTransfer receiver does around the write
    kernels.scatter_blocks(staging, decode.runner.kv_cache, torch.tensor(reserved.block_ids[num_hit_blocks:]))
    assert not lease.unpin(LeaseState.COMMITTED)
    assert prefill.abort(rid) and not prefill.abort(rid)
    decode.start_reserved(rid, seq.output_token_ids[0])
    while decode.has_unfinished():
        decode.step()
    return reserved


@pytest.mark.parametrize("params", PARAMS)
def test_prefill_on_one_engine_decode_on_another_equals_one_engine(params):
    ps = prompts(4, seed=11, lo=5, hi=40)
    expected = run(tiny_engine(), ps, [params] * 4)
    prefill, decode = tiny_engine(), tiny_engine()
    got = [prefill_then_decode(prefill, decode, f"r{i}", p, params, seed=params.seed or 0).output_token_ids
           for i, p in enumerate(ps)]
    if params.seed is None:
        expected = run(tiny_engine(), ps, [dataclasses.replace(params, seed=0)] * 4)
    assert got == expected
    for engine in (prefill, decode):
        assert engine.stats().used_blocks == 0 and engine.stats().held == 0


def test_decode_worker_reuses_its_own_prefix_and_needs_fewer_blocks():
    prefill, decode = tiny_engine(), tiny_engine()
    prefix = prompts(1, seed=12, lo=17, hi=18)[0]               # 4 full blocks of 4 + 1 token
    params = PARAMS[0]
    first = prefill_then_decode(prefill, decode, "a", prefix + [9, 9], params, seed=1)
    second = prefill_then_decode(prefill, decode, "b", prefix + [7, 7, 7], params, seed=1)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 16
    cold = run(tiny_engine(), [prefix + [7, 7, 7]], [params])[0]
    assert second.output_token_ids == cold


def test_local_prefill_of_a_reservation_equals_normal_run():
    ps = prompts(3, seed=13)
    expected = run(tiny_engine(), ps, [PARAMS[0]] * 3)
    engine = tiny_engine()
    seqs = [engine.reserve(f"r{i}", p, PARAMS[0]) for i, p in enumerate(ps)]
    for s in seqs:
        engine.start_reserved(s.request_id)
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in seqs] == expected


def test_first_token_that_ends_the_request_finishes_at_once():
    engine = tiny_engine()
    engine.reserve("a", [1, 2, 3], SamplingParams(max_tokens=1))
    engine.get_lease("a").pin(LeaseState.RESERVED, LeaseState.RECEIVING)
    engine.get_lease("a").unpin(LeaseState.COMMITTED)
    [out] = engine.start_reserved("a", 42)
    assert out.finished and out.request_finished and out.seq.output_token_ids == [42]
    assert engine.stats().used_blocks == 0 and not engine.has_unfinished()


def test_abort_releases_reserved_and_held_blocks_exactly_once():
    engine = tiny_engine()
    engine.reserve("r", list(range(1, 20)), PARAMS[0])
    held = engine.add_request("h", list(range(1, 10)), dataclasses.replace(PARAMS[0], max_tokens=1),
                              hold_blocks=True)
    while not held.is_finished:
        engine.step()
    assert engine.stats().held == 1 and engine.stats().reserved == 1
    assert engine.abort("r") and engine.abort("h")
    assert not engine.abort("r") and not engine.abort("h")
    assert engine.stats().used_blocks == 0


def test_reserve_without_room_is_overload_and_leaks_nothing():
    engine = tiny_engine(num_kv_blocks=30, max_model_len=100)
    engine.reserve("a", list(range(1, 90)), PARAMS[0])          # 23 blocks
    with pytest.raises(OverloadedError):
        engine.reserve("b", list(range(1, 60)), PARAMS[0])      # 15 more do not fit
    engine.abort("a")
    assert engine.stats().used_blocks == 0


def test_engine_loop_stop_fails_waiting_callers_instead_of_hanging():
    from engine.engine_loop import EngineLoop, LoopStopped

    loop = EngineLoop(tiny_engine(num_kv_blocks=30, max_model_len=100)).start()
    loop.call(lambda e: e.reserve("hog", list(range(1, 90)), PARAMS[0]))       # 23 of 30 blocks, never started
    stream = loop.open_stream("s", lambda e: e.add_request("s", list(range(1, 41)), PARAMS[0]))  # needs 11
    assert loop.call(lambda e: e.stats()).waiting == 1                       # cannot be scheduled
    loop.stop()
    with pytest.raises(LoopStopped):
        stream.get(timeout=30)
    with pytest.raises(LoopStopped):
        loop.call(lambda e: e.stats())
    stream.close()


def test_a_bfloat16_kv_cache_moves_between_engines_and_decodes_as_one_engine_does():
    """kv_cache_dtype="bfloat16" with float32 compute: the blocks a prefill engine writes (rounded to bfloat16)
    gathered and scattered into a decode engine's cache give the tokens one such engine gives alone."""
    params = PARAMS[0]
    ps = prompts(4, seed=12, lo=5, hi=40)
    expected = run(tiny_engine(kv_cache_dtype="bfloat16"), ps, [params] * 4)
    prefill, decode = tiny_engine(kv_cache_dtype="bfloat16"), tiny_engine(kv_cache_dtype="bfloat16")
    assert prefill.runner.kv_cache.dtype == decode.runner.kv_cache.dtype == torch.bfloat16
    got = [prefill_then_decode(prefill, decode, f"r{i}", p, params, seed=0).output_token_ids
           for i, p in enumerate(ps)]
    assert got == expected
    for engine in (prefill, decode):
        assert engine.stats().used_blocks == 0 and engine.stats().held == 0


def test_a_bfloat16_kv_cache_holds_twice_the_blocks_in_the_same_memory():
    budget = 2**20
    as_float32 = tiny_engine(num_kv_blocks=None, kv_cache_memory=budget)
    as_bfloat16 = tiny_engine(num_kv_blocks=None, kv_cache_memory=budget, kv_cache_dtype="bfloat16")
    assert as_float32.runner.kv_cache.dtype == torch.float32
    assert as_bfloat16.runner.num_blocks == 2 * as_float32.runner.num_blocks
    assert as_bfloat16.runner.kv_cache.nbytes == as_float32.runner.kv_cache.nbytes
    assert as_float32.runner.kv_dtype == torch.float32 and as_bfloat16.runner.model.dtype == torch.float32


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kv_cache_dtype": "int8"}, "must be one of"),
    ({"kv_cache_dtype": "float32", "device": "cuda"}, "device 'cuda'.*on CPU without tensor parallelism"),
    ({"kv_cache_dtype": "bfloat16", "tensor_parallel_size": 2}, "tensor_parallel_size 2.*without tensor parallelism"),
    ({"kv_cache_dtype": "float32", "dtype": "bfloat16"}, "only 'bfloat16' under float32 compute"),
])
def test_kv_cache_dtype_is_validated_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=f"EngineConfig.kv_cache_dtype.*{message}"):
        EngineConfig(model="m", **kwargs)
    EngineConfig(model="m", kv_cache_dtype="bfloat16", dtype="bfloat16", device="cuda")  # the compute dtype: fine
