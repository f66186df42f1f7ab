"""n > 1 choices: one prefill, choices forked on the prompt's blocks (shared by reference count, the partial block
copied), each with its own seed stream; every block returns to the pool on every way out."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import kernels
from engine.block_lease import LeaseState
from engine.engine_loop import EngineLoop
from engine.errors import InvalidRequestError, RequestFailedError
from engine.faults import SAMPLING_FAULTS
from engine.kv_cache_manager import KVCacheManager
from engine.llm import LLM
from engine.sampler import choice_seed
from engine.sampling_params import MAX_CHOICES, SamplingParams
from engine.sequence import Sequence
from tiny_model import run, tiny_engine, tiny_loaded

SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]           # 10 tokens: 2 full blocks of 4 + 2 tokens


# --- KV accounting (pure) -------------------------------------------------------------------------------------
def _computed(kv: KVCacheManager, request_id: str, prompt: list[int]) -> Sequence:
    seq = Sequence(request_id, list(prompt), SAMPLED, 1)
    kv.allocate(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    return seq


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(num_blocks=12, block_size=4, root_hash=1)
    parent = _computed(kv, "p", PROMPT)
    assert parent.block_ids == [0, 1, 2]
    children = [Sequence(f"p/{i}", list(PROMPT), SAMPLED, 2, parent_id="p", choice_index=i) for i in (1, 2)]
    assert kv.can_fork(parent)
    assert [kv.fork(parent, c) for c in children] == [(2, 3), (2, 4)]
    assert [c.block_ids for c in children] == [[0, 1, 3], [0, 1, 4]]
    assert [kv.pool.get_ref_count(b) for b in range(6)] == [3, 3, 1, 1, 1, 0]
    assert all(c.num_computed_tokens == 10 for c in children)
    kv.free(children[0])                      # a choice that ends first frees its own references only
    assert [kv.pool.get_ref_count(b) for b in range(6)] == [2, 2, 1, 0, 1, 0]
    kv.free(parent)
    assert [kv.pool.get_ref_count(b) for b in range(6)] == [1, 1, 0, 0, 1, 0]
    kv.free(children[1])
    assert kv.pool.get_num_free_blocks() == 12
    with pytest.raises(ValueError):           # exactly once: a second free of a choice's blocks is refused
        kv.pool.free([4])


def test_fork_of_a_prompt_on_a_block_boundary_copies_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4, root_hash=1)
    parent = _computed(kv, "p", PROMPT[:8])
    child = Sequence("p/1", PROMPT[:8], SAMPLED, 2)
    assert kv.can_fork(parent) and kv.fork(parent, child) is None
    assert child.block_ids == [0, 1] and [kv.pool.get_ref_count(b) for b in range(4)] == [2, 2, 0, 0]


def test_fork_needs_a_free_block_for_the_partial_copy():
    kv = KVCacheManager(num_blocks=3, block_size=4, root_hash=1)
    parent = _computed(kv, "p", PROMPT)
    assert not kv.can_fork(parent)


# --- the engine -----------------------------------------------------------------------------------------------
def _run_choices(engine, request_id, prompt, params, **kwargs):
    seq = engine.add_request(request_id, prompt, params, **kwargs)
    choices = {0: seq}
    num_prompt_computed = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.seq.group_id == request_id:
                choices[out.seq.choice_index] = out.seq
        num_prompt_computed += engine.last_step.num_prompt_tokens
    return [choices[i].output_token_ids for i in sorted(choices)], num_prompt_computed


def test_choices_compute_the_prompt_once_and_each_follow_their_own_seed():
    engine = tiny_engine()
    got, num_prompt_computed = _run_choices(engine, "a", PROMPT, dataclasses.replace(SAMPLED, n=3))
    assert num_prompt_computed == len(PROMPT)
    assert len(got) == 3 and len({tuple(c) for c in got}) == 3
    # choice i is the completion of an n=1 request seeded choice_seed(seed, i): batch- and n-independent
    alone = run(tiny_engine(), [PROMPT] * 3, [dataclasses.replace(SAMPLED, seed=choice_seed(5, i)) for i in range(3)])
    assert got == alone
    assert engine.stats().used_blocks == 0 and engine.stats().running == 0


def test_choices_are_the_same_in_another_batch_and_greedy_choices_are_identical():
    engine = tiny_engine()
    engine.add_request("other", [7] * 13, dataclasses.replace(SAMPLED, seed=9, max_tokens=5))
    got, _ = _run_choices(engine, "a", PROMPT, dataclasses.replace(SAMPLED, n=3))
    expected, _ = _run_choices(tiny_engine(), "a", PROMPT, dataclasses.replace(SAMPLED, n=3))
    assert got == expected
    greedy, _ = _run_choices(tiny_engine(), "g", PROMPT, SamplingParams(max_tokens=6, temperature=0.0, n=3,
                                                                          ignore_eos=True))
    assert greedy[0] == greedy[1] == greedy[2]


def test_offline_generate_returns_n_outputs_per_prompt():
    llm = LLM("tiny-random", loaded=tiny_loaded(), num_kv_blocks=256, block_size=4, dtype="float32")
    llm.tokenizer = SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)))   # the tiny model has none
    outs = llm.generate([PROMPT, PROMPT[:5]], [dataclasses.replace(SAMPLED, n=2), SAMPLED])
    assert [len(o.outputs) for o in outs] == [2, 1]
    expected, _ = _run_choices(tiny_engine(), "x", PROMPT, dataclasses.replace(SAMPLED, n=2))
    assert [c.token_ids for c in outs[0].outputs] == expected
    assert llm.engine.stats().used_blocks == 0


def test_a_choice_ending_on_its_first_token_and_abort_mid_decode_release_every_block():
    engine = tiny_engine(num_kv_blocks=16)
    _run_choices(engine, "one", PROMPT, dataclasses.replace(SAMPLED, n=4, max_tokens=1))
    assert engine.stats().used_blocks == 0
    engine.add_request("b", PROMPT, dataclasses.replace(SAMPLED, n=3, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.stats().running == 3 and engine.stats().used_blocks == 3 + 2  # 2 shared + 3 partial copies
    assert engine.abort("b") and not engine.abort("b")
    assert engine.stats().used_blocks == 0 and not engine.has_unfinished()


def test_a_choice_with_no_block_for_its_copy_recomputes_and_still_matches():
    expected, _ = _run_choices(tiny_engine(), "a", PROMPT, dataclasses.replace(SAMPLED, n=3, max_tokens=3))
    engine = tiny_engine(num_kv_blocks=4, enable_prefix_caching=False)    # prompt 3 blocks + 1: one copy fits
    got, _ = _run_choices(engine, "a", PROMPT, dataclasses.replace(SAMPLED, n=3, max_tokens=3))
    assert got == expected
    assert engine.stats().used_blocks == 0


def test_one_choice_failing_fails_the_request_and_frees_the_others():
    loop = EngineLoop(tiny_engine()).start()
    try:
        params = dataclasses.replace(SAMPLED, n=3, max_tokens=30)
        with SAMPLING_FAULTS.armed("f/2"):
            stream = loop.open_stream("f", lambda e: e.add_request("f", PROMPT, params))
            with pytest.raises(RequestFailedError):
                list(stream)
        stats = loop.call(lambda e: e.stats())
        assert stats.used_blocks == 0 and stats.running == 0
    finally:
        loop.stop()


def test_disaggregated_choices_equal_one_engine():
    params = dataclasses.replace(SAMPLED, n=3)
    expected, _ = _run_choices(tiny_engine(), "r", PROMPT, params)
    prefill, decode = tiny_engine(), tiny_engine()
    reserved = decode.reserve("r", PROMPT, params, seed=5)
    seq = prefill.add_request("r", PROMPT, dataclasses.replace(params, max_tokens=1), seed=5, hold_blocks=True)
    while not seq.is_finished:
        prefill.step()
    assert len(seq.choice_first_tokens) == 2
    staging = kernels.gather_blocks(prefill.runner.kv_cache, torch.tensor(seq.block_ids))
    lease = decode.get_lease("r")
    lease.pin(LeaseState.RESERVED, LeaseState.RECEIVING)
    kernels.scatter_blocks(staging, decode.runner.kv_cache, torch.tensor(reserved.block_ids))
    assert not lease.unpin(LeaseState.COMMITTED)
    assert prefill.abort("r") and prefill.stats().used_blocks == 0
    with pytest.raises(InvalidRequestError):
        decode.start_reserved("r", seq.output_token_ids[0], None, seq.choice_first_tokens[:1])
    assert decode.start_reserved("r", seq.output_token_ids[0], None, seq.choice_first_tokens) == []
    choices = {0: reserved}
    while decode.has_unfinished():
        for out in decode.step():
            choices[out.seq.choice_index] = out.seq
    assert [choices[i].output_token_ids for i in range(3)] == expected
    assert decode.stats().used_blocks == 0


def test_n_is_bounded():
    with pytest.raises(InvalidRequestError, match="n"):
        SamplingParams(n=MAX_CHOICES + 1).validate()
    with pytest.raises(InvalidRequestError, match="n"):
        SamplingParams(n=0).validate()
