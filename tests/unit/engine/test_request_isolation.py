"""Penalties through the real engine, and failures confined to the request that caused them: one request's
sampling raises (engine.faults) while others decode beside it; the engine loop refuses work after stop."""

import threading

import pytest

from engine.engine_loop import EngineLoop, LoopStopped
from engine.errors import RequestFailedError
from engine.faults import SAMPLING_FAULTS
from engine.llm import LLM
from engine.loader import LoadedModel
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason
from tests.unit.gateway.word_tokenizer import word_tokenizer
from tiny_model import TINY, run, tiny_engine, tiny_weights

PROMPTS = [[5, 9, 9, 12, 3, 40], [7, 7, 7, 7, 1, 2, 3, 4, 5], [60, 61, 62]]
PENALIZED = [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.5),
    SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True, frequency_penalty=1.2),
    SamplingParams(max_tokens=10, temperature=0.7, seed=4, ignore_eos=True, presence_penalty=1.5,
                   repetition_penalty=1.2),
]


def test_penalties_in_a_batch_with_seeds_give_each_request_its_solo_tokens():
    together = run(tiny_engine(), PROMPTS, PENALIZED)
    alone = [run(tiny_engine(), [p], [params])[0] for p, params in zip(PROMPTS, PENALIZED)]
    assert together == alone and all(len(t) == 10 for t in together)
    plain = run(tiny_engine(), PROMPTS[:1], [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)])
    strong = run(tiny_engine(), PROMPTS[:1], [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                             presence_penalty=2.0, frequency_penalty=2.0)])
    assert len(set(strong[0])) > len(set(plain[0]))   # the penalty changed what greedy picks


def tiny_llm() -> LLM:
    loaded = LoadedModel(config=TINY, weights=tiny_weights(), tokenizer=word_tokenizer(""),
                         fingerprint="tiny-random")
    return LLM(model="tiny-random", loaded=loaded, progress=False, num_kv_blocks=64, block_size=4, dtype="float32")


def test_offline_llm_generates_with_every_penalty():
    outputs = tiny_llm().generate(PROMPTS, PENALIZED)
    assert [o.outputs[0].token_ids for o in outputs] == run(tiny_engine(), PROMPTS, PENALIZED)
    assert all(o.outputs[0].finish_reason == "length" and o.outputs[0].error is None for o in outputs)


def test_offline_llm_fails_only_the_request_whose_sampling_raises():
    llm = tiny_llm()
    expected = run(tiny_engine(), PROMPTS, PENALIZED)
    with SAMPLING_FAULTS.armed("offline-1"):           # the second prompt's id: LLM numbers them from 0
        outputs = llm.generate(PROMPTS, PENALIZED)
    assert outputs[1].outputs[0].finish_reason == "error" and "injected sampling fault" in outputs[1].outputs[0].error
    assert [outputs[i].outputs[0].token_ids for i in (0, 2)] == [expected[0], expected[2]]
    assert llm.engine.kv.pool.get_num_used_blocks() == 0


def test_offline_stream_of_a_failing_request_raises_request_failed():
    llm = tiny_llm()
    with SAMPLING_FAULTS.armed("offline-0"), pytest.raises(RequestFailedError, match="injected sampling fault"):
        list(llm.stream(PROMPTS[0], PENALIZED[0]))
    assert llm.engine.kv.pool.get_num_used_blocks() == 0


def test_a_fault_mid_decode_fails_that_request_and_frees_its_blocks_while_others_finish():
    engine = tiny_engine()
    expected = run(tiny_engine(), PROMPTS, PENALIZED)
    seqs = [engine.add_request(f"r{i}", p, params) for i, (p, params) in enumerate(zip(PROMPTS, PENALIZED))]
    for _ in range(4):                                  # prefill + 3 decode steps, then r1's sampling raises
        engine.step()
    assert len(seqs[1].output_token_ids) == 4 and seqs[1].block_ids
    SAMPLING_FAULTS.arm("r1")
    try:
        outputs = engine.step()
    finally:
        SAMPLING_FAULTS.disarm("r1")
    failed = [o for o in outputs if o.seq is seqs[1]]
    assert len(failed) == 1 and failed[0].finished and failed[0].new_token_ids == []
    assert seqs[1].finish_reason is FinishReason.ERROR and seqs[1].block_ids == []
    while engine.has_unfinished():
        engine.step()
    assert [seqs[0].output_token_ids, seqs[2].output_token_ids] == [expected[0], expected[2]]
    assert engine.kv.pool.get_num_used_blocks() == 0


def test_engine_loop_stream_of_a_failing_request_raises_and_the_others_complete():
    loop = EngineLoop(tiny_engine()).start()
    try:
        expected = run(tiny_engine(), PROMPTS, PENALIZED)
        with SAMPLING_FAULTS.armed("s1"):
            streams = [loop.open_stream(f"s{i}", lambda e, i=i: e.add_request(f"s{i}", PROMPTS[i], PENALIZED[i]))
                       for i in range(3)]
            with pytest.raises(RequestFailedError, match="injected sampling fault"):
                list(streams[1])
        assert [[t for out in streams[i] for t in out.new_token_ids] for i in (0, 2)] == [expected[0], expected[2]]
        assert loop.call(lambda e: e.kv.pool.get_num_used_blocks()) == 0
    finally:
        loop.stop()


def test_open_stream_and_call_after_stop_raise_instead_of_blocking():
    loop = EngineLoop(tiny_engine()).start()
    loop.stop()
    result: dict[str, BaseException] = {}

    def open_after_stop():
        try:
            loop.open_stream("late", lambda e: e.add_request("late", [1, 2, 3], PENALIZED[0]))
        except BaseException as exc:
            result["open"] = exc

    thread = threading.Thread(target=open_after_stop, daemon=True)
    thread.start()
    thread.join(30)  # a bound on a hang, not a timing assertion: the call must return at all
    assert isinstance(result.get("open"), LoopStopped)
    with pytest.raises(LoopStopped):
        loop.call(lambda e: None)
