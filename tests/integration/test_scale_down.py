"""Scale-down: a decode worker that gets SIGTERM drains (WorkerHandle.stop) instead of dropping its streams.

    under load      real processes (1 prefill + 2 decode workers, the default model, a real redis-server) and a
                    gateway: SIGTERM one decode worker while 8 streams run. Every stream either completes (a
                    finish reason, all its tokens: the greedy tokens of the offline engine) or fails with a
                    retryable status (UNAVAILABLE / RESOURCE_EXHAUSTED), never a silent truncation; the worker
                    leaves the index, exits cleanly, and new requests go to the survivor; no KV block is left
                    on the survivors
    the drain       in process (tiny random model): once draining, Reserve is UNAVAILABLE and health NOT_SERVING
                    (main and health-only port) while a reservation made before still decodes to its end; the
                    drain ends as soon as nothing is left; a stream still running at the drain timeout ends
                    UNAVAILABLE; a draining prefill worker refuses Prefill (UNAVAILABLE) and still answers Stats

Waits are bounded polls or joins; nothing asserts a duration.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import start_server as start_decode
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from protos.convert import sampling_to_pb
from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvstore.embedded_redis import EmbeddedRedis
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.server import start_server as start_prefill
from tests.integration.cluster import RPC_TIMEOUT_S, START_TIMEOUT_S, Cluster, Reference, assert_idle
from tests.unit.engine.tiny_model import tiny_engine

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
PROMPTS = ["Write a story about a lighthouse keeper.", "List the planets of the solar system.",
           "Explain how a bicycle works.", "Describe the water cycle.", "What is a prime number?",
           "Tell me about the history of tea.", "How do bees make honey?", "Why is the sky blue?"]
MAX_TOKENS = [24, 160, 48, 200, 32, 120, 64, 180]      # some finish within the drain, some are cut by it
DRAIN_TIMEOUT_S = 3.0


def greedy(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def wait_for(condition, what: str, timeout_s: float = START_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result


@contextlib.contextmanager
def draining_cluster(model_path):
    """p0, d0 and d1 registered in a real redis-server; the decode workers drain for DRAIN_TIMEOUT_S."""
    with EmbeddedRedis() as redis:
        cluster = Cluster(model_path, redis)
        try:
            cluster.start_worker("prefill", "p0")
            for worker_id in ("d0", "d1"):
                cluster.start_worker("decode", worker_id, drain_timeout_s=DRAIN_TIMEOUT_S)
            cluster.reference = Reference(model_path)
            cluster.wait_registered("p0", "d0", "d1")
            yield cluster
        finally:
            cluster.close()


@pytest.mark.slow
def test_sigterm_on_a_decode_worker_under_load_completes_or_fails_retryably(default_model_path):
    with draining_cluster(default_model_path) as cluster:
        gateway = cluster.gateway()
        expected = {i: cluster.reference(p, max_tokens=n, ignore_eos=True)[1]
                    for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))}
        started = threading.Barrier(len(PROMPTS) + 1, timeout=RPC_TIMEOUT_S)
        channel = grpc.insecure_channel(f"127.0.0.1:{gateway.port}")
        stub = generation_pb2_grpc.GenerationStub(channel)

        def run(i: int):
            """(decode worker, tokens, finish reason or None, error code or None)."""
            call = stub.Generate(generation_pb2.GenerateRequest(text=PROMPTS[i], sampling=greedy(MAX_TOKENS[i])),
                                 timeout=RPC_TIMEOUT_S)
            tokens, finish, first = [], None, True
            try:
                for chunk in call:
                    tokens.extend(chunk.token_ids)
                    if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        finish = chunk.finish_reason
                    if first and tokens:
                        first = False
                        started.wait()
                code = None
            except grpc.RpcError as err:
                code = err.code()
            finally:
                if first:
                    started.abort()
            worker = dict(call.trailing_metadata() or ()).get("pdserve-decode-worker")
            return worker, tokens, finish, code

        try:
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                futures = [pool.submit(run, i) for i in range(len(PROMPTS))]
                started.wait()                               # every stream has its first token
                cluster.procs["d0"].terminate()              # SIGTERM mid-load
                results = [f.result(timeout=RPC_TIMEOUT_S) for f in futures]

            served_by = [worker for worker, *_ in results]
            assert "d0" in served_by and "d1" in served_by, served_by       # the drain had streams to handle
            for i, (worker, tokens, finish, code) in enumerate(results):
                if code is None:
                    assert finish is not None, f"stream {i} on {worker} ended without a finish reason"
                    assert tokens == expected[i], f"stream {i} on {worker}"
                else:
                    assert code in RETRYABLE, f"stream {i} on {worker}: {code}"
                    assert worker == "d0" and tokens == expected[i][:len(tokens)]

            wait_for(lambda: "d0" not in {w.worker_id for w in cluster.index.list_workers()}, "d0 to deregister")
            assert cluster.procs["d0"].wait(RPC_TIMEOUT_S) == 0             # it drained and exited by itself
            cluster.stop_worker("d0")
            for i in (0, 4):                                 # new requests: the survivor serves them whole
                call = stub.Generate(generation_pb2.GenerateRequest(text=PROMPTS[i], sampling=greedy(MAX_TOKENS[i])),
                                     timeout=RPC_TIMEOUT_S)
                chunks = list(call)
                assert [t for c in chunks for t in c.token_ids] == expected[i]
                assert dict(call.trailing_metadata())["pdserve-decode-worker"] == "d1"
            assert_idle(cluster.wait_idle("p0", "d1"))
        finally:
            channel.close()


# ------------------------------------------------------------------------------------------------ in process
ENGINE = EngineConfig(model="tiny-random", num_kv_blocks=256, block_size=4, dtype="float32")
PROMPT = list(range(3, 40))


def reserve(stub, rid: str, max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return stub.Reserve(worker_pb2.ReserveRequest(
        request=worker_pb2.WorkerRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling_to_pb(params),
                                         seed=5), lease_ms=60_000), timeout=RPC_TIMEOUT_S)


def health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_a_draining_decode_worker_refuses_reserve_and_finishes_what_it_took():
    handle = start_decode(DecodeWorkerConfig("d0", None, health_port=0), ENGINE, engine=tiny_engine())
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        taken = reserve(stub, "taken", max_tokens=16)                # before the drain: no KV yet, not decoding
        stopping = threading.Thread(target=handle.stop, kwargs={"grace_s": RPC_TIMEOUT_S})
        stopping.start()
        wait_for(lambda: health(handle.server.health_port) == health_pb2.HealthCheckResponse.NOT_SERVING,
                 "NOT_SERVING on the health port")
        assert health(handle.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            reserve(stub, "late", max_tokens=16)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
        assert stopping.is_alive()                                   # the reservation keeps the drain waiting
        messages = list(stub.Decode(worker_pb2.DecodeRequest(request_id="taken", handle=taken.target.handle,
                                                             prefill_locally=True), timeout=RPC_TIMEOUT_S))
        assert sum(len(m.token_ids) for m in messages) == 16
        assert messages[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        stopping.join(RPC_TIMEOUT_S)                                 # nothing left: the drain ends now
        assert not stopping.is_alive()


def test_a_stream_still_running_at_the_drain_timeout_ends_unavailable():
    handle = start_decode(DecodeWorkerConfig("d0", None), ENGINE, engine=tiny_engine())
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        res = reserve(stub, "long", max_tokens=ENGINE_MAX_TOKENS)
        stream = stub.Decode(worker_pb2.DecodeRequest(request_id="long", handle=res.target.handle,
                                                      prefill_locally=True), timeout=RPC_TIMEOUT_S)
        received = len(next(stream).token_ids)
        handle.stop(grace_s=0)                                       # no time left for it
        with pytest.raises(grpc.RpcError) as info:
            for message in stream:
                received += len(message.token_ids)
                assert message.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED, "finished before the stop"
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert received < ENGINE_MAX_TOKENS


ENGINE_MAX_TOKENS = 900
"""Close to the tiny engine's context (1024 tokens): far more steps than the stop takes to begin."""


def test_a_draining_prefill_worker_refuses_new_prefills_and_still_answers_stats():
    decode = start_decode(DecodeWorkerConfig("d0", None), ENGINE, engine=tiny_engine())
    prefill = start_prefill(PrefillWorkerConfig("p0", None, health_port=0,
                                                decode_endpoints=(f"127.0.0.1:{decode.port}",)),
                            ENGINE, engine=tiny_engine())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{decode.port}") as dc, \
                grpc.insecure_channel(f"127.0.0.1:{prefill.port}") as pc:
            target = reserve(worker_pb2_grpc.DecodeWorkerStub(dc), "r", max_tokens=4).target
            pstub = worker_pb2_grpc.PrefillWorkerStub(pc)
            prefill.server.start_draining()                          # what SIGTERM does first
            assert health(prefill.server.health_port) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as info:
                pstub.Prefill(worker_pb2.PrefillRequest(request=worker_pb2.WorkerRequest(
                    request_id="r", prompt_token_ids=PROMPT, sampling=sampling_to_pb(SamplingParams(max_tokens=4)),
                    seed=5), target=target), timeout=RPC_TIMEOUT_S)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
            stats = pstub.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT_S)
            assert (stats.worker_id, stats.used_blocks, stats.running, stats.waiting) == ("p0", 0, 0, 0)
    finally:
        prefill.stop(grace_s=0)
        decode.stop(grace_s=0)
