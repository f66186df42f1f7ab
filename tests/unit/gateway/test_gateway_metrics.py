"""GatewayMetrics: exact samples for a scripted request (explicit clock values), separate registries per gateway,
worker gauges from index records, and the status code each error is recorded with."""
from __future__ import annotations

import asyncio

import pytest

from engine.errors import InvalidRequestError
from engine.sequence import FinishReason
from gateway.metrics import GatewayMetrics
from gateway.request_types import (ClientGone, DeadlineExceeded, NoWorkerAvailable, OutputChunk, Overloaded,
                                   RequestTrace, ShuttingDown, Timings, Usage, WorkerFailed, error_code)
from kvstore.local_index import WorkerInfo


def sample(metrics: GatewayMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def run_request(metrics: GatewayMetrics, trace: RequestTrace, timings: Timings, code: str = "OK") -> None:
    recorder = metrics.request("http", "completions", arrival=100.0, trace=trace)
    recorder.start()
    assert sample(metrics, "pdserve_requests_in_flight", api="http") == 1
    recorder.chunk(OutputChunk("a", (1,)), now=100.5)                # first token: TTFT 0.5
    recorder.chunk(OutputChunk("", ()), now=100.6)                   # no token: nothing timed
    recorder.chunk(OutputChunk("b", (2, 3)), now=100.9)              # ITL 0.4
    recorder.chunk(OutputChunk("c", (4,), finish_reason=FinishReason.LENGTH, usage=Usage(20, 4, 16),
                               timings=timings), now=101.1)          # ITL 0.2; E2E 1.1; TPOT 0.6 / 3
    recorder.end(code)
    recorder.end(code)                                               # idempotent


def test_a_finished_disaggregated_request_is_counted_and_timed():
    m = GatewayMetrics()
    run_request(m, RequestTrace(), Timings(queue_ms=20.0, prefill_ms=300.0, transfer_ms=4.0, ttft_ms=500.0,
                                           transport="shm", transfer_bytes=4096))
    assert sample(m, "pdserve_requests_total", api="http", endpoint="completions", code="OK") == 1
    assert sample(m, "pdserve_requests_in_flight", api="http") == 0
    assert sample(m, "pdserve_time_to_first_token_seconds_count", api="http") == 1
    assert sample(m, "pdserve_time_to_first_token_seconds_sum", api="http") == pytest.approx(0.5)
    assert sample(m, "pdserve_inter_token_latency_seconds_count", api="http") == 2
    assert sample(m, "pdserve_inter_token_latency_seconds_sum", api="http") == pytest.approx(0.6)
    assert sample(m, "pdserve_time_per_output_token_seconds_sum", api="http") == pytest.approx(0.2)
    assert sample(m, "pdserve_e2e_request_latency_seconds_sum", api="http") == pytest.approx(1.1)
    assert sample(m, "pdserve_generation_tokens_total") == 4
    assert sample(m, "pdserve_prompt_tokens_total") == 20
    assert sample(m, "pdserve_prefix_cache_hit_tokens_total") == 16
    assert sample(m, "pdserve_kv_transfer_bytes_total", transport="shm") == 4096
    assert sample(m, "pdserve_kv_transfer_seconds_sum", transport="shm") == pytest.approx(0.004)
    assert sample(m, "pdserve_request_queue_seconds_sum") == pytest.approx(0.02)
    assert sample(m, "pdserve_request_prefill_seconds_sum") == pytest.approx(0.3)
    assert sample(m, "pdserve_local_prefill_total", reason="short") is None


def test_a_local_prefill_counts_its_reason_and_no_transfer():
    m = GatewayMetrics()
    run_request(m, RequestTrace(local_reason="short"), Timings(1.0, 2.0, 0.0, 3.0, "local", 0))
    assert sample(m, "pdserve_local_prefill_total", reason="short") == 1
    assert sample(m, "pdserve_kv_transfer_bytes_total", transport="local") is None


def test_a_cancelled_request_is_counted_by_code_without_end_to_end_timings():
    m = GatewayMetrics()
    recorder = m.request("grpc", "chat", arrival=0.0, trace=RequestTrace())
    recorder.start()
    recorder.chunk(OutputChunk("a", (1,)), now=0.25)
    recorder.end("CANCELLED")
    assert sample(m, "pdserve_requests_total", api="grpc", endpoint="chat", code="CANCELLED") == 1
    assert sample(m, "pdserve_time_to_first_token_seconds_count", api="grpc") == 1
    assert sample(m, "pdserve_e2e_request_latency_seconds_count", api="grpc") is None
    assert sample(m, "pdserve_prompt_tokens_total") == 0


def test_each_gateway_has_its_own_registry():
    a, b = GatewayMetrics(), GatewayMetrics()
    run_request(a, RequestTrace(), Timings(1.0, 2.0, 0.0, 3.0, "local", 0))
    assert sample(a, "pdserve_requests_total", api="http", endpoint="completions", code="OK") == 1
    assert sample(b, "pdserve_requests_total", api="http", endpoint="completions", code="OK") is None


def test_worker_gauges_follow_the_latest_worker_list():
    m = GatewayMetrics()
    m.set_workers([WorkerInfo("d0", "decode", capacity_blocks=100, free_blocks=60, running=3, waiting=2),
                   WorkerInfo("p0", "prefill", capacity_blocks=50, free_blocks=50)])
    assert sample(m, "pdserve_worker_kv_blocks_used", worker="d0", role="decode") == 40
    assert sample(m, "pdserve_worker_kv_blocks_free", worker="d0", role="decode") == 60
    assert sample(m, "pdserve_worker_running_seqs", worker="d0", role="decode") == 3
    assert sample(m, "pdserve_worker_waiting_seqs", worker="d0", role="decode") == 2
    m.set_workers([WorkerInfo("p0", "prefill", capacity_blocks=50, free_blocks=10, running=1)])
    assert sample(m, "pdserve_worker_running_seqs", worker="d0", role="decode") is None
    assert sample(m, "pdserve_worker_kv_blocks_used", worker="p0", role="prefill") == 40
    assert b"pdserve_worker_kv_blocks_used{role=\"prefill\",worker=\"p0\"} 40.0" in m.exposition()


@pytest.mark.parametrize("exc, code", [
    (None, "OK"),
    (InvalidRequestError("prompt", "empty"), "INVALID_ARGUMENT"),
    (Overloaded("full"), "RESOURCE_EXHAUSTED"),
    (NoWorkerAvailable("none"), "UNAVAILABLE"),
    (WorkerFailed("crashed"), "UNAVAILABLE"),
    (ShuttingDown("draining"), "UNAVAILABLE"),
    (DeadlineExceeded("late"), "DEADLINE_EXCEEDED"),
    (ClientGone("reset"), "CANCELLED"),
    (asyncio.CancelledError(), "CANCELLED"),
    (GeneratorExit(), "CANCELLED"),
    (KeyError("bug"), "INTERNAL"),
])
def test_error_code_of_each_error(exc, code):
    assert error_code(exc) == code


def test_the_queue_depth_gauge_reads_the_orchestrator_at_each_scrape():
    m = GatewayMetrics()
    depth = [3]
    m.track_queue(lambda: depth[0])
    assert "pdserve_gateway_queued_requests 3.0" in m.exposition().decode()
    depth[0] = 0
    assert "pdserve_gateway_queued_requests 0.0" in m.exposition().decode()
