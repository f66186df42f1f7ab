"""Tensor-parallel engines over the tiny random model: N gloo ranks give TP=1's greedy tokens and logprobs,
shard quantized weights into the unsharded codes, keep per-rank KV caches that gather back to TP=1's, and fail
with TensorParallelError (never a hang) when a rank stops answering."""

import datetime
import os
import signal
import time

import pytest
import torch
from tiny_model import TINY, tiny_engine

from engine.config import EngineConfig
from engine.parallel.ranks import TensorParallelError, TensorParallelGroup
from engine.parallel.shard import rank_shards
from engine.quant import Int4Linear, Int8Linear
from engine.sampling_params import SamplingParams
from kvstore.reshard_plan import plan_reshard
from kvstore.transfer import DecodedBlocks

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11]]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)


def generate(engine):
    seqs = [engine.add_request(f"r{engine.num_steps}-{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    while engine.has_unfinished():
        engine.step()
    return seqs


@pytest.fixture(scope="module")
def engines():
    made = {}
    yield lambda key, **kwargs: made[key] if key in made else made.setdefault(key, tiny_engine(**kwargs))
    for engine in made.values():
        engine.close()


def test_tp2_matches_tp1_tokens_and_logprobs(engines):
    # TP=3 (KV head 0 replicated, uneven intermediate and vocabulary) runs in the cluster test, at the same cost.
    ref = generate(engines("tp1"))
    got = generate(engines("tp2", tensor_parallel_size=2))
    for a, b in zip(ref, got):
        assert b.output_token_ids == a.output_token_ids
        for la, lb in zip(a.output_logprobs, b.output_logprobs):
            assert [t for t, _ in lb.top] == [t for t, _ in la.top]
            assert lb.logprob == pytest.approx(la.logprob, abs=1e-4)
            assert [v for _, v in lb.top] == pytest.approx([v for _, v in la.top], abs=1e-4)


def test_rank_kv_cache_holds_its_heads_and_moves_by_the_plan(engines):
    tp1, tp2 = engines("tp1"), engines("tp2", tensor_parallel_size=2)
    assert tp2.runner.kv_cache.shape[4] == 1 and tp1.runner.kv_cache.shape[4] == 2  # one of 2 KV heads each
    assert tp2.runner.num_blocks == tp1.runner.num_blocks
    assert tp2.runner.rank_kv_heads() == (range(1), range(1, 2))
    ids = [0, 1, 2, 5]
    sent = tp2.runner.tp.gather_kv(tp2.runner.kv_cache, ids)   # one payload slice per rank: [L, 2, n, bs, 1, D]
    assert sent.sender_kv_heads == (range(1), range(1, 2)) and [c.shape[4] for c in sent.caches] == [1, 1]
    full = tp1.runner.kv_cache[:, :, ids]  # [L, 2, n, bs, 2, D]
    assert full.abs().sum() > 0  # the tests above wrote these blocks (same allocation on both engines)
    torch.testing.assert_close(torch.cat(sent.caches, dim=4), full, atol=1e-5, rtol=1e-5)
    moved = tp2.runner.tp.num_kv_bytes_moved
    empty = tp2.runner.tp.gather_kv(tp2.runner.kv_cache, [])  # a delta transfer with nothing left to send
    assert [c.shape[2] for c in empty.caches] == [0, 0] and tp2.runner.tp.num_kv_bytes_moved == moved
    assert moved == full[:, :, :, :, 1:].numel() * 4  # rank 1 sent its one head, float32
    # A TP=1 payload (one slice of both heads) into free blocks, each rank its head by the plan; then back.
    plan = plan_reshard((range(2),), tp2.runner.rank_kv_heads())
    payload = ((range(2), DecodedBlocks("raw", full.permute(2, 0, 1, 3, 4, 5).contiguous(), None)),)
    tp2.runner.write_received(plan, payload, [200, 201, 202, 203])
    assert tp2.runner.tp.num_kv_bytes_moved == 2 * moved  # rank 0 sent rank 1 its head
    assert torch.equal(tp2.runner.kv_cache[:, :, 200:204], full[:, :, :, :, :1])  # rank 0 keeps KV head 0
    back = tp2.runner.tp.gather_kv(tp2.runner.kv_cache, [200, 201, 202, 203])
    assert torch.equal(torch.cat(back.caches, dim=4), full)


@pytest.mark.parametrize("quantization,cls", [("int8", Int8Linear), ("int4", Int4Linear)])
def test_quantized_shards_are_the_unsharded_codes(engines, quantization, cls):
    ref_engine = engines(quantization, quantization=quantization)
    tp_engine = engines(f"{quantization}-tp2", quantization=quantization, tensor_parallel_size=2)
    assert [s.output_token_ids for s in generate(tp_engine)] == [s.output_token_ids for s in generate(ref_engine)]
    ref, rank0 = ref_engine.runner.model.layers[0], tp_engine.runner.model.layers[0]
    shard = rank_shards(TINY, 2, quantization)[0]
    d = TINY.head_dim
    o, down = rank0.o.inner, rank0.mlp.inner.down
    assert isinstance(o, cls) and isinstance(down, cls)
    cols = slice(shard.intermediate.start, shard.intermediate.stop)
    if cls is Int8Linear:  # row-parallel: the unsharded per-row scale, the unsharded codes' columns
        assert torch.equal(o.qweight, ref.o.qweight[:, :shard.heads.q_heads.stop * d])
        assert torch.equal(o.scale, ref.o.scale)
        assert torch.equal(down.qweight, ref.down.qweight[:, cols])
    else:  # int4 groups of 32 inputs: the slice holds whole groups, each quantized as before
        assert torch.equal(down.dequantize(), ref.down.dequantize()[:, cols])
        assert torch.equal(o.dequantize(), ref.o.dequantize()[:, :shard.heads.q_heads.stop * d])
    gate_up_rows = torch.cat([torch.arange(cols.start, cols.stop), TINY.intermediate_size + torch.arange(
        cols.start, cols.stop)])
    assert torch.equal(rank0.mlp.inner.gate_up.dequantize(), ref.gate_up.dequantize()[gate_up_rows])


def test_n_choices_fork_their_partial_prompt_block_on_every_rank(engines):
    # 10 tokens over blocks of 4: each forked choice copies the partial block, which every rank must do.
    prompt, params = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38], SamplingParams(max_tokens=4, temperature=1.0, seed=5,
                                                                             ignore_eos=True, n=3)

    def choices(engine):
        seq = engine.add_request(f"n3-{engine.num_steps}", prompt, params)
        found = {0: seq}
        while engine.has_unfinished():
            for out in engine.step():
                if out.seq.group_id == seq.request_id:
                    found[out.seq.choice_index] = out.seq
        return [found[i].output_token_ids for i in sorted(found)]

    want = choices(engines("tp1"))
    assert len(want) == 3 and len({tuple(c) for c in want}) > 1
    assert choices(engines("tp2", tensor_parallel_size=2)) == want


class _ExitOnLoad:
    """Unpickling this in a rank process ends it before it joins the process group."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_rank_that_dies_before_joining_fails_the_start():
    config = EngineConfig(model="tiny-random", tensor_parallel_size=2, num_kv_blocks=8, block_size=4)
    shards = rank_shards(TINY, 2, None)
    with pytest.raises(TensorParallelError, match="rank 1 exited with status 3 before joining"):
        TensorParallelGroup.start(config, TINY, {"exit": _ExitOnLoad()}, shards, 64, 8, torch.float32)


def test_config_validation():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(model="x", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_timeout_s"):
        EngineConfig(model="x", tensor_parallel_timeout_s=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be in \[1, num_heads=4\]"):
        tiny_engine(tensor_parallel_size=5)


def _wait_dead(process, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not process.is_alive()


def test_stopped_rank_times_out_the_collective_and_ends_the_worker(engines):
    # Last in the module: it takes the module's TP=2 engine down (the fixture's close is idempotent). A rank that
    # dies outright is the cluster test's case (tests/integration/test_tensor_parallel_cluster.py).
    engine = engines("tp2", tensor_parallel_size=2)
    engine.runner.tp.group.set_timeout(datetime.timedelta(seconds=2))
    rank1 = engine.runner.tp._processes[0]
    os.kill(rank1.pid, signal.SIGSTOP)  # alive but silent: only the collective's timeout ends the wait
    engine.add_request("stuck", PROMPTS[0], SamplingParams(max_tokens=2))
    with pytest.raises(TensorParallelError, match="tensor-parallel step"):
        engine.step()
    assert _wait_dead(rank1)  # closed: the stopped rank is killed
    engine.add_request("after", PROMPTS[0], SamplingParams(max_tokens=2))
    with pytest.raises(TensorParallelError):  # and the worker cannot go on
        engine.step()
