"""A real cluster whose pools run at different tensor-parallel degrees: a prefill worker at TP=2 pushes the
prompt's KV (every head once on the wire, one payload slice per sending rank) to a decode worker at TP=3 (each rank
takes its heads as the re-sharding plan says), over the default shm transport. Greedy tokens equal the offline
TP=1 engine's, the response's Timings report the plan's bytes and slices, each worker's Stats the bytes its ranks
exchanged for the transfer (kv_resharding_bytes), a repeated prompt hits the decode worker's prefix cache (delta
transfer: nothing sent), prefill TP=2 -> decode TP=1 and prefill TP=1 -> decode TP=2 answer like 1P + 1D at TP=1,
and a rank that dies takes its worker down (exit status EXIT_RANK_FAILED, the request fails UNAVAILABLE) instead
of hanging.

The model is the tiny random GGUF of the unit tests (4 query / 2 KV heads): at TP=3 KV head 0 is replicated. (The
default model's uneven 2 + 1 KV heads at TP=2 are covered by tests/integration/test_kv_transfer.py's sliced
pushes and, for the pairs of degrees on the default model, by bench/bench_tp_transfer.py: four default-model
workers take minutes to start on a loaded CI machine.)
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import grpc
import pytest

from engine.engine_loop import EXIT_RANK_FAILED
from kvstore.embedded_redis import EmbeddedRedis
from protos.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.cluster import RPC_TIMEOUT_S, Cluster, Reference, generate_greedy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "engine"))
from tiny_gguf import write_tiny_gguf

PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]  # 20 tokens: 1 full block
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-cluster") / "tiny.gguf"
    write_tiny_gguf(path)
    with EmbeddedRedis() as redis:
        cluster = Cluster(path, redis)
        try:
            cluster.start_worker("prefill", "p0", engine_kwargs={"tensor_parallel_size": 2})
            cluster.start_worker("decode", "d0", engine_kwargs={"tensor_parallel_size": 3,
                                                                "tensor_parallel_timeout_s": 10.0})
            cluster.reference = Reference(path)
            cluster.wait_registered("p0", "d0")
            yield cluster
        finally:
            cluster.close()


def rank_pids(pid: int) -> list[int]:
    """The tensor-parallel rank processes (multiprocessing spawn children) of process `pid`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
            pids.append(int(entry))
    return pids


def test_prefill_tp2_to_decode_tp3_answers_like_tp1(cluster):
    gateway = cluster.gateway()
    expected = cluster.reference(PROMPT, max_tokens=NUM_TOKENS, ignore_eos=True)[1]
    token_ids, last, metadata = generate_greedy(gateway.port, PROMPT, NUM_TOKENS)
    assert metadata["pdserve-prefill-workers"] == "p0" and metadata["pdserve-decode-worker"] == "d0"
    assert last.timings.transfer_bytes > 0  # the prompt's KV moved between the differently sharded pools
    assert token_ids == expected
    # Raw float32 on the wire, every head: p0's rank 1 holds 1 of the 2 KV heads (half the bytes gathered to rank
    # 0); d0's ranks 1 and 2 hold KV heads 0 and 1 (rank 0 hands them as many bytes as arrived).
    p0, d0 = cluster.stats("p0"), cluster.stats("d0")
    assert (p0.tensor_parallel_size, d0.tensor_parallel_size) == (2, 3)
    assert p0.kv_resharding_bytes == last.timings.transfer_bytes // 2
    assert d0.kv_resharding_bytes == last.timings.transfer_bytes
    # The plan 2 -> 3 over 2 KV heads: kv 0 from p0's rank 0 to d0's ranks 0 and 1, kv 1 from rank 1 to rank 2
    assert last.timings.kv_reshard_slices == 3
    assert last.timings.kv_reshard_bytes == last.timings.transfer_bytes * 3 // 2
    again, last, _ = generate_greedy(gateway.port, PROMPT, NUM_TOKENS)  # d0 holds the prompt's full block now: only the rest moves
    assert again == expected
    assert last.usage.cached_tokens >= 16


@pytest.fixture
def tp1_and_tp2_workers(cluster):
    """p1 (TP=1), d1 (TP=1) and d2 (TP=2) beside p0 (TP=2) for one test; stopped after it (deregistered), so
    the gateway of the other tests sees p0 and d0 only."""
    added = [("prefill", "p1", 1), ("decode", "d1", 1), ("decode", "d2", 2)]
    try:
        for role, worker_id, tp in added:
            cluster.start_worker(role, worker_id, engine_kwargs={"tensor_parallel_size": tp})
        cluster.wait_registered(*(worker_id for _, worker_id, _ in added))
        yield cluster
    finally:
        for _, worker_id, _ in added:
            if worker_id in cluster.procs:
                cluster.stop_worker(worker_id)


def disaggregate(cluster, prefill_worker: str, decode_worker: str, prompt: list[int], max_tokens: int):
    """One greedy request through the chosen pair (Reserve on D, Prefill on P pushing to it, Decode on D), as the
    gateway runs it, with its own cache salt (a cold transfer): (token ids, PrefillResponse)."""
    request = worker_pb2.WorkerRequest(request_id=f"{prefill_worker}-{decode_worker}", prompt_token_ids=prompt,
                                       sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                          ignore_eos=True),
                                       cache_salt=f"{prefill_worker}-{decode_worker}", seed=1)
    with cluster.channel(decode_worker, "decode") as dc, cluster.channel(prefill_worker, "prefill") as pc:
        decode, prefill = worker_pb2_grpc.DecodeWorkerStub(dc), worker_pb2_grpc.PrefillWorkerStub(pc)
        target = decode.Reserve(worker_pb2.ReserveRequest(request=request, lease_ms=60_000), timeout=30).target
        first = prefill.Prefill(worker_pb2.PrefillRequest(request=request, target=target), timeout=RPC_TIMEOUT_S)
        messages = list(decode.Decode(worker_pb2.DecodeRequest(request_id=request.request_id, handle=target.handle,
                                                               first_token_id=first.first_token_id),
                                      timeout=RPC_TIMEOUT_S))
    return [first.first_token_id, *(t for m in messages for t in m.token_ids)], first


def test_prefill_and_decode_at_tp2_and_tp1_answer_like_tp1(tp1_and_tp2_workers):
    cluster = tp1_and_tp2_workers
    prompt = PROMPT * 2  # 40 tokens: 2 full blocks and a partial one, all pushed
    baseline, base = disaggregate(cluster, "p1", "d1", prompt, NUM_TOKENS)  # 1P + 1D at TP=1
    assert len(baseline) == NUM_TOKENS and base.transfer_bytes > 0
    assert (base.reshard_bytes, base.reshard_slices) == (base.transfer_bytes, 1)  # one rank each side
    for pair in [("p0", "d1"), ("p1", "d2")]:
        tokens, first = disaggregate(cluster, *pair, prompt, NUM_TOKENS)
        assert tokens == baseline, pair
        assert first.transfer_bytes == base.transfer_bytes, pair  # every KV head once on the wire
        # 2 -> 1: kv 0 from rank 0, kv 1 from rank 1, both to rank 0; 1 -> 2: kv 0 to rank 0, kv 1 to rank 1
        assert (first.reshard_bytes, first.reshard_slices) == (base.transfer_bytes, 2), pair
    # d2's rank 0 sent rank 1 its KV head: half the payload
    assert cluster.stats("d2").kv_resharding_bytes == base.transfer_bytes // 2


def test_a_dead_rank_takes_its_worker_down(cluster):
    gateway = cluster.gateway()
    worker = cluster.procs["d0"]
    ranks = rank_pids(worker.pid)
    assert len(ranks) == 2  # ranks 1 and 2 of d0; rank 0 is the worker itself
    os.kill(ranks[0], signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as info:
        generate_greedy(gateway.port, PROMPT, NUM_TOKENS)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert worker.wait(timeout=60) == EXIT_RANK_FAILED
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in ranks[1:]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}/cmdline").exists() and Path(f"/proc/{pid}/cmdline").read_bytes()
                   for pid in ranks[1:])  # the other rank exited too
