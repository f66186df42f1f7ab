"""Two gateways in front of one pool (one prefill and one decode worker, each its own process, one real
redis-server). Gateway A runs in the test process (Cluster.gateway); gateway B is a `pdserve gateway` process
with the same settings, given only the Redis URL (PDSERVE_REDIS_URL): it finds the workers through the index
alone. The gateways share nothing else, so each answers correctly on its own, a prompt one of them prefilled
is a prefix-cache hit through the other, and neither leaves a block, sequence or reservation on the workers.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling_params import SamplingParams
from kvstore.embedded_redis import free_ports
from tests.integration.cluster import (BLOCK_SIZE, IDLE_TIMEOUT_S, MAX_MODEL_LEN, REPO, RPC_TIMEOUT_S,
                                       START_TIMEOUT_S, assert_idle, running_cluster)

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
QUESTIONS = [FRANCE,
             [{"role": "user", "content": "Name two colors."}],
             [{"role": "user", "content": "What is 2 + 2?"}],
             [{"role": "user", "content": "Say hello in Spanish."}]]



def wait_until(condition, what: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s (last value {value!r})"
        time.sleep(0.1)


class Gateway:
    """Where a gateway's HTTP API is, and how many requests it has in flight."""

    def __init__(self, name: str, http_port: int, num_inflight) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{http_port}"
        self._num_inflight = num_inflight

    @property
    def num_inflight(self) -> int:
        return self._num_inflight()

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=RPC_TIMEOUT_S) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()
        except OSError as err:
            return 0, str(err)

    def chat(self, messages: list[dict], max_tokens: int = 24) -> dict:
        body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode()
        request = urllib.request.Request(self.url + "/v1/chat/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=RPC_TIMEOUT_S) as response:
            assert response.status == 200
            return json.loads(response.read())


def requests_in_flight(gateway: Gateway) -> int:
    """pdserve_requests_in_flight from the gateway's /metrics."""
    status, text = gateway.get("/metrics")
    assert status == 200, text
    return int(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "pdserve_requests_in_flight"))


@pytest.fixture(scope="module")
def cluster(default_model_path):
    with running_cluster(default_model_path, [("prefill", "p0"), ("decode", "d0")]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def gateway_a(cluster) -> Gateway:
    handle = cluster.gateway()
    return Gateway("A", handle.http_port, lambda: handle.num_inflight)


@pytest.fixture(scope="module")
def gateway_b(cluster, tmp_path_factory):
    """`pdserve gateway` with Cluster.gateway()'s settings as flags, and the Redis URL in its environment."""
    port, http_port = free_ports(2)
    log_path = Path(tmp_path_factory.mktemp("gateway-b")) / "gateway.log"
    argv = ["gateway", "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port),
            "--model", str(cluster.model_path), "--block-size", str(BLOCK_SIZE), "--max-model-len",
            str(MAX_MODEL_LEN), "--lease-ms", "60000", "--local-prefill-threshold", "0", "--drain-timeout", "5",
            "--insecure-internal"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve", *argv], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PDSERVE_REDIS_URL": cluster.redis.url})
    gateway = Gateway("B", http_port, None)
    gateway._num_inflight = lambda: requests_in_flight(gateway)

    def serving() -> bool:
        assert proc.poll() is None, f"gateway B exited:\n{log_path.read_text(errors='replace')}"
        return gateway.get("/health")[0] == 200

    try:
        wait_until(serving, "gateway B serves", START_TIMEOUT_S)
        yield gateway
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def expected_chat(cluster, messages: list[dict], max_tokens: int = 24) -> str:
    return cluster.reference.llm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0))[0] \
        .outputs[0].text


def assert_nothing_left(cluster, *gateways: Gateway) -> None:
    """No request in flight on either gateway, and no block, sequence or reservation on any worker."""
    wait_until(lambda: all(g.num_inflight == 0 for g in gateways), "the gateways finish", IDLE_TIMEOUT_S)
    assert_idle(cluster.wait_idle())


def test_both_gateways_find_the_pool_through_redis(gateway_a, gateway_b):
    for gateway in (gateway_a, gateway_b):
        status, body = gateway.get("/health")
        assert (status, json.loads(body)) == (200, {"status": "ok", "decode_workers": 1, "prefill_workers": 1})


def test_alternating_requests_are_answered_correctly_by_both(cluster, gateway_a, gateway_b):
    gateways = (gateway_a, gateway_b)
    for turn in range(2 * len(QUESTIONS)):                        # A, B, A, B, ...: each question through both
        gateway, messages = gateways[turn % 2], QUESTIONS[turn // 2]
        answer = gateway.chat(messages)
        assert answer["choices"][0]["message"]["content"] == expected_chat(cluster, messages), gateway.name
    assert "Paris" in gateway_a.chat(FRANCE)["choices"][0]["message"]["content"]
    assert "Paris" in gateway_b.chat(FRANCE)["choices"][0]["message"]["content"]
    assert_nothing_left(cluster, gateway_a, gateway_b)


@pytest.mark.parametrize("first,second", [("a", "b"), ("b", "a")])
def test_a_prompt_prefilled_through_one_gateway_is_cached_through_the_other(cluster, gateway_a, gateway_b, first,
                                                                             second):
    gateways = {"a": gateway_a, "b": gateway_b}
    # A system prompt seen by no earlier request, so the first request is a cold run (the chat template puts it
    # first: every block of this prompt is new).
    system = (f"You answer geography questions for the {first}-then-{second} team, in one short sentence, and "
              "you never add anything else. ") * 3
    messages = [{"role": "system", "content": system}, *FRANCE]
    cold = gateways[first].chat(messages)
    warm = gateways[second].chat(messages)
    prompt_tokens = cold["usage"]["prompt_tokens"]
    assert prompt_tokens >= 4 * BLOCK_SIZE
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (prompt_tokens // BLOCK_SIZE - 1) * BLOCK_SIZE   # every full block, or all but the last
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert "Paris" in warm["choices"][0]["message"]["content"]
    assert_nothing_left(cluster, gateway_a, gateway_b)


def test_concurrent_requests_through_both_gateways_leave_nothing_behind(cluster, gateway_a, gateway_b):
    jobs = [((gateway_a, gateway_b)[i % 2], QUESTIONS[i % len(QUESTIONS)]) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: job[0].chat(job[1]), jobs))
    for (gateway, messages), answer in zip(jobs, answers):
        assert answer["choices"][0]["message"]["content"] == expected_chat(cluster, messages), gateway.name
    assert_nothing_left(cluster, gateway_a, gateway_b)
