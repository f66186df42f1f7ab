"""The report's split of the prefix-cache scenario into cold and cached requests, and its batch-1 TPOT goal rows
(1P+1D against the one-process engine and against colocated serving)."""

from __future__ import annotations

from pathlib import Path

from pdserve.bench import report
from pdserve.bench.metrics import RequestRecord, summarize
from pdserve.bench.report import cold_and_cached
from pdserve.bench.runner import RunConfig, RunResult
from pdserve.bench.suite import COLOCATED, ENGINE, ONE_P_ONE_D_LEND, SuiteConfig, SuiteResults, build_scenarios
from pdserve.bench.workloads import RAW, BenchRequest


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


def _batch1_run(tpot_s: float) -> RunResult:
    records = [RequestRecord(prompt_len=3, start_s=0.0, chunk_times_s=[0.1 + i * tpot_s for i in range(9)],
                             output_len=9, success=True, request_id=f"r{i}") for i in range(3)]
    return RunResult("batch1", RunConfig(max_concurrency=1), records, 1.0, summarize(records, 1.0))


def test_batch1_runs_colocated_and_the_goals_split_1p1d_tpot_into_serving_and_disaggregation(tmp_path: Path):
    cfg = SuiteConfig(out_dir=tmp_path, systems=(ENGINE, ONE_P_ONE_D_LEND, COLOCATED), only=("batch1",))
    scenarios = build_scenarios(cfg, RAW, (1000, 30000))
    assert scenarios["batch1"].systems == (ENGINE, ONE_P_ONE_D_LEND, COLOCATED)
    results = SuiteResults(cfg, scenarios)
    results.runs[("batch1", ENGINE)] = _batch1_run(0.005)
    results.runs[("batch1", COLOCATED)] = _batch1_run(0.006)
    results.runs[("batch1", ONE_P_ONE_D_LEND)] = _batch1_run(0.0063)
    goals = "\n".join(report._goals(results))
    assert "| batch-1 TPOT, 1P+1D / the one-process engine on the same cores | pdserve-1p1d-lend | 1.26x | <= 1.1x " \
           "| **no** |" in goals
    assert "(serving's share) | pdserve-colocated | 1.20x | — | — |" in goals
    assert "(disaggregation's share) | pdserve-1p1d-lend | 1.05x | — | — |" in goals
    results.runs[("batch1", ONE_P_ONE_D_LEND)] = _batch1_run(0.0054)
    assert "| pdserve-1p1d-lend | 1.08x | <= 1.1x | yes |" in "\n".join(report._goals(results))
    del results.runs[("batch1", COLOCATED)]   # a run without colocated: only the goal row
    goals = "\n".join(report._goals(results))
    assert "share)" not in goals and "| pdserve-1p1d-lend | 1.08x | <= 1.1x | yes |" in goals
