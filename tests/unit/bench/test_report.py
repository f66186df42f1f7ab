"""The report's split of the prefix-cache scenario into cold and cached requests."""

from __future__ import annotations

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.report import cold_and_cached
from pdserve.bench.workloads import BenchRequest


def req(session: int, i: int) -> BenchRequest:
    return BenchRequest(f"r{session}-{i}", (1, 2, 3), 4, session_id=session)


def rec(ttft_s: float, success: bool = True) -> RequestRecord:
    return RequestRecord(prompt_len=3, start_s=0.0, chunk_times_s=[ttft_s, ttft_s + 0.1], output_len=2,
                         success=success)


def test_first_request_of_each_session_is_cold_the_rest_cached():
    requests = [req(0, 0), req(1, 0), req(0, 1), req(1, 1), req(0, 2)]
    records = [rec(2.0), rec(3.0), rec(0.2), rec(0.3), rec(0.25)]
    cold, cached = cold_and_cached(requests, records)
    assert cold == [2000.0, 3000.0]
    assert cached == [200.0, 300.0, 250.0]


def test_failed_requests_are_left_out():
    cold, cached = cold_and_cached([req(0, 0), req(0, 1)], [rec(2.0, success=False), rec(0.2)])
    assert cold == [] and cached == [200.0]
