"""The gateway when its decode worker hangs or dies: real worker processes, a real redis-server, real signals.

    SIGSTOP mid-stream   the stream ends with UNAVAILABLE after the tokens already sent (inter-token timeout),
                         never hangs; SIGCONT in teardown, and the worker's blocks come back
    SIGKILL              grpc.health.v1 and HTTP /health turn NOT_SERVING / 503 while the dead worker's
                         registration is still in the index (the gateway learns it from the broken connection,
                         not from the TTL), new requests are UNAVAILABLE; a new decode worker brings both back

Waits are bounded polls; nothing asserts a duration.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.cluster import RPC_TIMEOUT_S, START_TIMEOUT_S, assert_idle, running_cluster

pytestmark = pytest.mark.slow

TOKEN_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def cluster(default_model_path):
    with running_cluster(default_model_path, [("decode", "d0")]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def gateway(cluster):
    return cluster.gateway(token_timeout_s=TOKEN_TIMEOUT_S)


def grpc_health(gateway, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status


def http_health(gateway) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{gateway.http_port}/health", timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def wait_for(condition, what: str, timeout_s: float = START_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_a_stream_toward_a_stopped_worker_fails_unavailable_with_the_tokens_produced(cluster, gateway):
    pid = cluster.procs["d0"].pid
    received = []
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(
            text="Count to one thousand:", sampling=common_pb2.SamplingParams(max_tokens=1500, ignore_eos=True,
                                                                              temperature=0.0)))  # no deadline
        hang_guard = threading.Timer(RPC_TIMEOUT_S, call.cancel)    # a hang fails the test (CANCELLED)
        hang_guard.start()
        try:
            for chunk in call:
                received.extend(chunk.token_ids)
                if len(received) >= 4:
                    break
            os.kill(pid, signal.SIGSTOP)                     # hung: its connection stays open, nothing comes
            with pytest.raises(grpc.RpcError) as info:
                for chunk in call:
                    received.extend(chunk.token_ids)
        finally:
            os.kill(pid, signal.SIGCONT)
            hang_guard.cancel()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "sent nothing" in info.value.details() and f"after {len(received)} tokens" in info.value.details()
    assert len(received) < 1500
    assert_idle(cluster.wait_idle())                         # the abort reached d0 once it ran again


def test_health_follows_a_killed_decode_worker_and_comes_back_with_a_new_one(cluster, gateway):
    assert grpc_health(gateway) == health_pb2.HealthCheckResponse.SERVING and http_health(gateway) == 200
    cluster.stop_worker("d0", kill=True)                     # SIGKILL: no deregistration
    wait_for(lambda: grpc_health(gateway) == health_pb2.HealthCheckResponse.NOT_SERVING, "NOT_SERVING")
    assert http_health(gateway) == 503
    assert grpc_health(gateway, "pdserve.v1.Generation") == health_pb2.HealthCheckResponse.NOT_SERVING
    assert grpc_health(gateway, "liveness") == health_pb2.HealthCheckResponse.SERVING    # no restart for this
    assert "d0" in {w.worker_id for w in cluster.index.list_workers()}   # its registration has not expired
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(generation_pb2_grpc.GenerationStub(channel).Generate(
                generation_pb2.GenerateRequest(text="Hello"), timeout=RPC_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    cluster.start_worker("decode", "d1")
    cluster.wait_registered("d1")
    wait_for(lambda: grpc_health(gateway) == health_pb2.HealthCheckResponse.SERVING, "SERVING")
    assert http_health(gateway) == 200
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        chunks = list(generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(
            text="The capital of France is", sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)),
            timeout=RPC_TIMEOUT_S))
    assert chunks[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{gateway.http_port}/health", timeout=10).read())
    assert body["decode_workers"] == 1
