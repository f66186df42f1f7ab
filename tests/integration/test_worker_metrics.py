"""Metrics and health-only ports of real processes: a prefill and a decode worker (their own processes, the default
model, a real redis-server) and a gateway, each with --metrics-port and --health-port.

    metrics      scraped over HTTP after one request: every worker series the autoscalers and dashboards use exists
                 with model_name (the gateway's model name) and role, and counts what the request did (prompt
                 tokens computed on the prefill worker, the same KV bytes sent and received, steps, queue times);
                 every name either process exposes follows the Prometheus naming rules
    health port  answers grpc.health.v1 with the main server's statuses, and serves nothing else (a DecodeWorker
                 or Generation RPC there is UNIMPLEMENTED)
    engine side  (in process, tiny random model) the prefill pool's signal counts the prompt tokens not computed
                 yet, chunked prefill included; a step reports the prompt tokens it computed and the queue times
"""
from __future__ import annotations

import re
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling_params import SamplingParams
from kvstore.embedded_redis import EmbeddedRedis, free_ports
from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from protos.worker_metrics import LoadSnapshot
from tests.integration.cluster import RPC_TIMEOUT_S, Cluster, assert_idle
from tests.unit.engine.tiny_model import tiny_engine

pytestmark = pytest.mark.slow

WORKER_METRICS = {
    "pdserve_num_requests_running": "gauge", "pdserve_num_requests_waiting": "gauge",
    "pdserve_waiting_prompt_tokens": "gauge", "pdserve_kv_blocks_used": "gauge", "pdserve_kv_blocks_free": "gauge",
    "pdserve_kv_cache_usage_ratio": "gauge", "pdserve_num_preemptions_total": "counter",
    "pdserve_engine_step_seconds": "histogram", "pdserve_prompt_tokens_total": "counter",
    "pdserve_request_queue_time_seconds": "histogram", "pdserve_kv_transfer_bytes_total": "counter",
    "pdserve_kv_transfer_seconds_total": "counter", "pdserve_request_failures_total": "counter",
}
NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
UNITS = ("seconds", "bytes", "ratio")
SUFFIXES = ("_bucket", "_count", "_sum", "_created", "_total")



@pytest.fixture(scope="module")
def cluster(default_model_path):
    with EmbeddedRedis() as redis:
        cluster = Cluster(default_model_path, redis)
        ports = free_ports(4)
        cluster.ports = {"p0": tuple(ports[:2]), "d0": tuple(ports[2:])}    # (metrics, health)
        try:
            for role, worker_id in (("prefill", "p0"), ("decode", "d0")):
                metrics_port, health_port = cluster.ports[worker_id]
                cluster.start_worker(role, worker_id, metrics_port=metrics_port, health_port=health_port)
            cluster.wait_registered("p0", "d0")
            yield cluster
        finally:
            cluster.close()


@pytest.fixture(scope="module")
def gateway(cluster):
    return cluster.gateway(metrics_port=0, health_port=0)


@pytest.fixture(scope="module")
def served(cluster, gateway):
    """One greedy request through P and D; the model name ListModels reports."""
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        chunks = list(stub.Generate(generation_pb2.GenerateRequest(
            text="The capital of France is", sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0)),
            timeout=RPC_TIMEOUT_S))
        name = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=RPC_TIMEOUT_S).models[0].name
    assert chunks[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    assert chunks[-1].timings.transport in ("grpc", "shm")          # the KV went from p0 to d0
    assert_idle(cluster.wait_idle())       # the load gauges follow between the loop's steps (scrape_settled)
    return name


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def samples(text: str) -> dict[str, list]:
    """Sample name -> its samples."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(text: str, name: str, **labels) -> float:
    return sum(s.value for s in samples(text).get(name, []) if labels.items() <= s.labels.items())


def naming_violations(text: str) -> list[str]:
    """Prometheus naming rules for every `# TYPE` of an exposition: a valid name without colons (those are for
    recording rules), counters end in _total and only counters do, a unit appears only as the suffix, in its base
    form (no _ms, _milliseconds, _percent)."""
    bad = []
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        if not NAME.fullmatch(name) or ":" in name:
            bad.append(f"{name}: not a valid name without colons")
        base = name[:-len("_total")] if name.endswith("_total") else name
        if kind == "counter" and not name.endswith("_total"):
            bad.append(f"{name}: a counter not ending in _total")
        if kind != "counter" and name.endswith("_total"):
            bad.append(f"{name}: a {kind} ending in _total")
        for unit in UNITS:
            if f"_{unit}_" in base + "_" and not base.endswith(f"_{unit}") and not base.endswith("_created"):
                bad.append(f"{name}: unit {unit} not the suffix")
        if re.search(r"_(ms|milliseconds|percent|perc|kb|mb)(_|$)", name):
            bad.append(f"{name}: a non-base unit")
    return bad


@pytest.mark.parametrize("worker_id, role", [("p0", "prefill"), ("d0", "decode")])
def test_every_worker_metric_is_exposed_with_model_name_and_role(cluster, served, worker_id, role):
    text = scrape(cluster.ports[worker_id][0])
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    for name, kind in WORKER_METRICS.items():
        assert types.get(name) == kind, f"{name} ({kind}) missing from {worker_id}: {sorted(types)}"
    by_name = samples(text)
    for name in WORKER_METRICS:
        sample_names = [n for n in by_name if n == name or n.startswith(name + "_") and n.endswith(SUFFIXES)]
        assert sample_names, f"{name} has no samples"
        for n in sample_names:
            for s in by_name[n]:
                assert (s.labels.get("model_name"), s.labels.get("role")) == (served, role), (n, s.labels)
    assert naming_violations(text) == []


def scrape_settled(port: int, timeout_s: float = 10.0) -> str:
    """The exposition once its load gauges show no request and no block: the loop thread publishes them between
    steps, so the first scrape after the Stats RPC reported idle can still show the last step's load."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(port)
        load = [value(text, name) for name in ("pdserve_num_requests_running", "pdserve_num_requests_waiting",
                                               "pdserve_kv_blocks_used")]
        if not any(load) or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_worker_metrics_count_what_the_request_did(cluster, served):
    p, d = scrape_settled(cluster.ports["p0"][0]), scrape_settled(cluster.ports["d0"][0])
    assert value(p, "pdserve_prompt_tokens_total") > 0             # p0 computed the prompt ...
    assert value(d, "pdserve_prompt_tokens_total") == 0            # ... d0 received it
    sent, received = value(p, "pdserve_kv_transfer_bytes_total"), value(d, "pdserve_kv_transfer_bytes_total")
    assert sent > 0 and sent == received
    for text in (p, d):
        assert value(text, "pdserve_engine_step_seconds_count") > 0
        assert value(text, "pdserve_request_queue_time_seconds_count") >= 1
        assert value(text, "pdserve_kv_transfer_seconds_total") > 0
        assert value(text, "pdserve_num_requests_running") == value(text, "pdserve_num_requests_waiting") == 0
        assert value(text, "pdserve_waiting_prompt_tokens") == 0
        assert value(text, "pdserve_kv_blocks_used") == 0 and value(text, "pdserve_kv_cache_usage_ratio") == 0
        assert value(text, "pdserve_kv_blocks_free") > 0
        failed = [s for s in samples(text)["pdserve_request_failures_total"] if s.value]
        assert failed == []


def test_a_refused_request_counts_as_a_failure_by_reason(cluster, served):
    port = cluster.ports["d0"][0]
    before = value(scrape(port), "pdserve_request_failures_total", reason="FAILED_PRECONDITION")
    with grpc.insecure_channel(cluster.endpoint("d0")) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
                worker_pb2.DecodeRequest(request_id="nobody", handle="none", first_token_id=1), timeout=RPC_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert value(scrape(port), "pdserve_request_failures_total", reason="FAILED_PRECONDITION") == before + 1


def test_gateway_metrics_port_serves_its_registry(gateway, served):
    text = scrape(gateway.metrics_port)
    assert value(text, "pdserve_requests_total", api="grpc", endpoint="generate", code="OK") >= 1
    assert {"pdserve_time_to_first_token_seconds", "pdserve_gateway_queued_requests",
            "pdserve_worker_kv_blocks_free"} <= set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    assert {s.labels["worker"] for s in samples(text)["pdserve_worker_kv_blocks_free"]} == {"p0", "d0"}
    assert naming_violations(text) == []
    http_api = scrape(gateway.http_port)                       # the HTTP API keeps its own /metrics
    assert re.findall(r"^# TYPE .*$", http_api, re.MULTILINE) == re.findall(r"^# TYPE .*$", text, re.MULTILINE)


def health(port: int, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status


def test_worker_health_port_answers_health_only(cluster):
    port = cluster.ports["d0"][1]
    assert health(port) == health_pb2.HealthCheckResponse.SERVING
    assert health(port, "pdserve.v1.DecodeWorker") == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            worker_pb2_grpc.DecodeWorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(cluster.endpoint("d0")) as channel:    # the main port serves it
        assert worker_pb2_grpc.DecodeWorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10).worker_id == "d0"
    assert health(cluster.ports["p0"][1], "pdserve.v1.PrefillWorker") == health_pb2.HealthCheckResponse.SERVING


def test_gateway_health_port_answers_health_only(gateway):
    assert health(gateway.health_port) == health_pb2.HealthCheckResponse.SERVING
    assert health(gateway.health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(f"127.0.0.1:{gateway.health_port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            generation_pb2_grpc.GenerationStub(channel).ListModels(generation_pb2.ListModelsRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_waiting_prompt_tokens_and_step_records_follow_chunked_prefill():
    engine = tiny_engine(max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add_request("a", list(range(3, 43)), params)              # 40 prompt tokens
    engine.add_request("b", list(range(100, 110)), params)           # 10 (no prefix shared with a)
    assert LoadSnapshot.of(engine).waiting_prompt_tokens == 50
    engine.step()                                                    # 32 of a's tokens (the step's budget)
    assert (engine.last_step.num_prompt_tokens, len(engine.last_step.queue_times_s)) == (32, 1)
    assert LoadSnapshot.of(engine).waiting_prompt_tokens == 18       # a's last 8 and all of b
    engine.step()                                                    # a's 8 and b's 10: b is first scheduled
    assert (engine.last_step.num_prompt_tokens, len(engine.last_step.queue_times_s)) == (18, 1)
    assert LoadSnapshot.of(engine).waiting_prompt_tokens == 0
    engine.step()                                                    # decoding only
    assert (engine.last_step.num_prompt_tokens, engine.last_step.queue_times_s) == (0, ())
