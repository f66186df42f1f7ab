"""Goodput under SLOs from idle figures: the mixed workload, the SLO formula, attainment, the highest rate at 90%,
and the suite's goodput report section (from records, no servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.bench import goodput, report
from pdserve.bench.metrics import RequestRecord, summarize
from pdserve.bench.runner import RunConfig, RunResult
from pdserve.bench.suite import (COLOCATED, GOODPUT_SYSTEMS, LLAMA_SERVER, ONE_P_ONE_D_LEND, ONE_P_ONE_D_PINNED,
                                 SuiteConfig, SuiteResults, build_scenarios, family)
from pdserve.bench.workloads import RAW, mixed_workload, prompt_class


def rec(request_id: str, ttft_s: float, tpot_s: float, output_len: int = 5, success: bool = True) -> RequestRecord:
    times = [ttft_s + i * tpot_s for i in range(output_len)]
    return RequestRecord(prompt_len=10, start_s=0.0, chunk_times_s=times, output_len=output_len, success=success,
                         request_id=request_id)


def test_mixed_workload_has_the_asked_share_and_lengths_and_is_seeded():
    requests = mixed_workload(40, 0.25, (300, 400), 20, 8, 16, seed=3)
    assert requests == mixed_workload(40, 0.25, (300, 400), 20, 8, 16, seed=3)
    long = [r for r in requests if prompt_class(r.request_id) == "long"]
    short = [r for r in requests if prompt_class(r.request_id) == "short"]
    assert len(long) == 10 and len(short) == 30
    assert all(300 <= r.prompt_len <= 400 and r.max_tokens == 8 for r in long)
    assert all(10 <= r.prompt_len <= 30 and r.max_tokens == 16 for r in short)
    assert [prompt_class(r.request_id) for r in requests] != ["long"] * 10 + ["short"] * 30  # interleaved
    assert len({r.request_id for r in requests}) == 40
    with pytest.raises(ValueError, match="long_len"):
        mixed_workload(4, 0.5, (10, 5), 20, 8, 16)
    with pytest.raises(ValueError, match="not from mixed_workload"):
        prompt_class("random-0")


def test_slos_are_the_scales_times_the_idle_medians_per_class():
    idle = goodput.idle_figures([rec("long-0", 2.0, 0.05), rec("long-1", 4.0, 0.05), rec("short-0", 0.1, 0.04),
                                 rec("short-1", 0.3, 0.06), rec("short-2", 0.2, 0.05, success=False)])
    assert idle.ttft_ms == pytest.approx({"long": 3000.0, "short": 200.0})
    assert idle.tpot_ms == pytest.approx(50.0)
    slos = goodput.slos_from_idle(idle, ttft_scale=3, tpot_scale=2)
    assert slos.ttft_ms == pytest.approx({"long": 9000.0, "short": 600.0}) and slos.tpot_ms == pytest.approx(100.0)
    assert slos.of("short-7") == {"ttft": pytest.approx(600.0), "tpot": pytest.approx(100.0)}
    with pytest.raises(ValueError, match="no completed short"):
        goodput.idle_figures([rec("long-0", 2.0, 0.05)])


def test_a_request_counts_only_when_it_meets_both_slos_of_its_class():
    slos = goodput.GoodputSlos({"long": 5000.0, "short": 500.0}, 100.0, 2.0, 2.0)
    records = [rec("long-0", 4.0, 0.09),   # meets both
               rec("short-0", 0.4, 0.05),  # meets both
               rec("short-1", 0.6, 0.05),  # short TTFT too long (a long prompt's TTFT would do)
               rec("long-1", 1.0, 0.2),    # TPOT too long
               rec("short-2", 0.1, 0.01, success=False)]
    assert [r.request_id for r in goodput.meeting(records, slos)] == ["long-0", "short-0"]
    assert goodput.attainment(records, slos) == pytest.approx(0.4)
    assert goodput.goodput(records, 4.0, slos) == pytest.approx(0.5)


@pytest.mark.parametrize("points, expected", [
    ({0.1: 1.0, 0.2: 0.95, 0.4: 0.5}, 0.2 + 0.2 * (0.95 - 0.9) / (0.95 - 0.5)),
    ({0.1: 1.0, 0.2: 0.92}, 0.2),
    ({0.1: 0.8, 0.2: 1.0}, None),
    ({0.1: 1.0, 0.2: 0.5, 0.3: 1.0}, 0.1 + 0.1 * 0.1 / 0.5),  # the first miss ends it
    ({}, None),
])
def test_highest_rate_at_90_percent_interpolates_to_the_first_miss(points, expected):
    value = goodput.max_rate_at(points)
    assert value == (pytest.approx(expected) if expected is not None else None)


def _run(label: str, rate: float, records: list[RequestRecord], duration_s: float = 10.0) -> RunResult:
    return RunResult(label, RunConfig(request_rate=rate), records, duration_s, summarize(records, duration_s),
                     meta={"others_cores": 0.05})


def test_the_suite_builds_goodput_scenarios_that_share_nothing_across_rates_and_reports_them(tmp_path: Path):
    cfg = SuiteConfig(out_dir=tmp_path, systems=GOODPUT_SYSTEMS, only=("goodput",), goodput_rates=(0.1, 0.2),
                      goodput_requests=8, goodput_long_len=(100, 200), goodput_ttft_scale=2, goodput_tpot_scale=2)
    scenarios = build_scenarios(cfg, RAW, (1000, 30000))
    assert list(scenarios) == ["goodput-idle", "goodput@0.1", "goodput@0.2"]
    assert {family(name) for name in scenarios} == {"goodput"}
    assert all(s.systems == GOODPUT_SYSTEMS for s in scenarios.values())
    idle = scenarios["goodput-idle"].requests
    assert {r.prompt_len for r in idle if prompt_class(r.request_id) == "long"} == {200}
    first, second = (scenarios[f"goodput@{rate:g}"].requests for rate in (0.1, 0.2))
    assert {r.prompt_ids[:4] for r in first}.isdisjoint({r.prompt_ids[:4] for r in second})

    results = SuiteResults(cfg, scenarios)
    results.runs[("goodput-idle", COLOCATED)] = _run("idle", float("inf"), [rec("long-0", 1.0, 0.05),
                                                                             rec("short-0", 0.1, 0.05)])
    # SLOs: long TTFT 2000 ms, short 200 ms, TPOT 100 ms
    good = [rec("long-0", 1.5, 0.05), rec("short-0", 0.15, 0.05)]
    late = [rec("long-0", 1.5, 0.05), rec("short-0", 0.5, 0.05)]
    results.runs[("goodput@0.1", COLOCATED)] = _run("c", 0.1, good)
    results.runs[("goodput@0.2", COLOCATED)] = _run("c", 0.2, late)
    results.runs[("goodput@0.1", ONE_P_ONE_D_PINNED)] = _run("d", 0.1, good)
    results.runs[("goodput@0.2", ONE_P_ONE_D_PINNED)] = _run("d", 0.2, good)
    results.runs[("goodput@0.1", ONE_P_ONE_D_LEND)] = _run("l", 0.1, good)
    results.runs[("goodput@0.2", ONE_P_ONE_D_LEND)] = _run("l", 0.2, late)
    summary = report.goodput_summary(results)
    assert summary["slos"]["ttft_ms"] == pytest.approx({"long": 2000.0, "short": 200.0})
    coloc, disagg = summary["systems"][COLOCATED], summary["systems"][ONE_P_ONE_D_PINNED]
    assert [p["attainment"] for p in coloc["points"]] == [1.0, 0.5]
    assert coloc["max_rate_at_90"] == pytest.approx(0.1 + 0.1 * 0.1 / 0.5)
    assert disagg["max_rate_at_90"] == 0.2 and disagg["points"][1]["goodput"] == pytest.approx(0.2)
    # 1P+1D attains at its highest rate (0.2): its capacity is above, the ratio a lower bound, enough for the goal
    assert report.goodput_goal(results) == (pytest.approx(0.2 / 0.12), "highest rate at 90% SLO attainment (1P+1D "
                                            "attains 90% at its highest measured rate: at least this; raise "
                                            "--goodput-rates)", "lower")
    goals = "\n".join(report._goals(results))
    assert "at least this; raise --goodput-rates) | pdserve-1p1d-pinned | 1.67x | >= 1.5x | yes |" in goals
    # each 1P+1D system on its own row: the lending one attains 90% only as far as colocated does
    assert report.goodput_goal(results, ONE_P_ONE_D_LEND)[0] == pytest.approx(1.0)
    assert "| pdserve-1p1d-lend | 1.00x | >= 1.5x |" in goals
    lines = report._goodput(results)
    text = "\n".join(lines)
    assert "TTFT SLO = 2 x idle TTFT" in text and f"| {LLAMA_SERVER} |" not in text
    assert f"| {ONE_P_ONE_D_PINNED} | 0.2 | 0.200 | 100% |" in text
    assert f"| {ONE_P_ONE_D_PINNED} | >= 0.2 |" in text
    assert "--only goodput" in report._non_default_flags(cfg)
    assert "--goodput-long-len 100-200" in report._non_default_flags(cfg)


def test_without_a_rate_at_90_percent_for_both_the_goal_compares_peak_goodputs(tmp_path: Path):
    # Neither system attains 90% at any measured rate. At the highest rate both collapsed (overload, 1.0x): the goal
    # compares what each served best, at whichever rate that was, not the collapse.
    cfg = SuiteConfig(out_dir=tmp_path, systems=GOODPUT_SYSTEMS, only=("goodput",), goodput_rates=(0.1, 0.2, 0.4),
                      goodput_requests=8, goodput_long_len=(100, 200), goodput_ttft_scale=2, goodput_tpot_scale=2)
    results = SuiteResults(cfg, build_scenarios(cfg, RAW, (1000, 30000)))
    results.runs[("goodput-idle", COLOCATED)] = _run("idle", float("inf"), [rec("long-0", 1.0, 0.05),
                                                                             rec("short-0", 0.1, 0.05)])
    good, late = rec("short-0", 0.15, 0.05), rec("short-0", 0.5, 0.05)  # short TTFT SLO: 200 ms
    runs = {COLOCATED: {0.1: [good, late, late], 0.2: [good, good, late, late], 0.4: [good, late, late]},
            ONE_P_ONE_D_PINNED: {0.1: [good, good, late], 0.2: [good] * 7 + [late], 0.4: [good, late, late]}}
    for system, by_rate in runs.items():
        for rate, records in by_rate.items():
            results.runs[(f"goodput@{rate:g}", system)] = _run(system, rate, records)
    ratio, basis, bound = report.goodput_goal(results)
    assert ratio == pytest.approx(0.7 / 0.2)  # both peak at 0.2 req/s: 7 and 2 good requests in 10 s
    assert basis.startswith("peak goodput over the measured rates (1P+1D at 0.2 req/s, colocated at 0.2")
    assert bound is None and report.goal_met(ratio, 1.5, bound)


@pytest.mark.parametrize("attains", [ONE_P_ONE_D_PINNED, COLOCATED])
def test_when_only_one_system_attains_90_percent_the_goal_is_a_bound_from_the_others_lowest_rate(tmp_path: Path,
                                                                                             attains: str):
    # One system attains 90% up to 0.24 req/s (100% at 0.2, 50% at 0.4, interpolated); the other misses it already
    # at 0.1, its lowest measured rate, so its highest rate at 90% lies below 0.1: the ratio is at least (or, the
    # other way round, at most) 0.24 / 0.1.
    cfg = SuiteConfig(out_dir=tmp_path, systems=GOODPUT_SYSTEMS, only=("goodput",), goodput_rates=(0.1, 0.2, 0.4),
                      goodput_requests=8, goodput_long_len=(100, 200), goodput_ttft_scale=2, goodput_tpot_scale=2)
    results = SuiteResults(cfg, build_scenarios(cfg, RAW, (1000, 30000)))
    results.runs[("goodput-idle", COLOCATED)] = _run("idle", float("inf"), [rec("long-0", 1.0, 0.05),
                                                                             rec("short-0", 0.1, 0.05)])
    good, late = rec("short-0", 0.15, 0.05), rec("short-0", 0.5, 0.05)
    other = COLOCATED if attains == ONE_P_ONE_D_PINNED else ONE_P_ONE_D_PINNED
    runs = {attains: {0.1: [good] * 10, 0.2: [good] * 10, 0.4: [good, late]},
            other: {0.1: [good] * 8 + [late] * 2, 0.2: [good] * 9 + [late], 0.4: [late]}}
    for system, by_rate in runs.items():
        for rate, records in by_rate.items():
            results.runs[(f"goodput@{rate:g}", system)] = _run(system, rate, records)
    ratio, basis, bound = report.goodput_goal(results)
    if attains == ONE_P_ONE_D_PINNED:
        assert (ratio, bound) == (pytest.approx(0.24 / 0.1), "lower") and report.goal_met(ratio, 1.5, bound)
        assert "colocated misses 90% already at its lowest measured rate, 0.1 req/s: at least this" in basis
    else:
        assert (ratio, bound) == (pytest.approx(0.1 / 0.24), "upper") and report.goal_met(ratio, 1.5, bound) is False
        assert "1P+1D misses 90% already at its lowest measured rate, 0.1 req/s: at most this" in basis


def test_unknown_scenario_families_are_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="famil"):
        SuiteConfig(out_dir=tmp_path, only=("goodputs",))


def test_the_goodput_plot_is_written(tmp_path: Path):
    pytest.importorskip("matplotlib")
    from pdserve.bench.plots import plot_goodput_vs_rate

    path = plot_goodput_vs_rate({"a": [(0.1, 0.1, 1.0), (0.2, 0.1, 0.5)], "b": [(0.1, 0.05, 0.5)]},
                                tmp_path / "g.png", title="t")
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"


def test_the_ttft_breakdown_takes_the_servers_timings_of_long_requests(tmp_path: Path):
    timed = rec("long-0", 2.0, 0.05)
    timed.server_timings = {"queue_ms": 500.0, "prefill_ms": 1200.0, "transfer_ms": 40.0, "ttft_ms": 1900.0,
                            "transport": "shm", "transfer_bytes": 1 << 20}
    run = _run("d", 0.1, [timed, rec("short-0", 0.1, 0.05)])
    lines = report._ttft_breakdown(SuiteResults(SuiteConfig(out_dir=tmp_path), {}), {ONE_P_ONE_D_PINNED: {0.1: run}})
    assert f"| {ONE_P_ONE_D_PINNED} | 0.1 | 1 | 500 | 1,200 | 40 (shm) | 1,900 |" in lines


def test_slos_can_come_from_an_earlier_runs_results(tmp_path: Path):
    from pdserve.bench.cli import _reference_idle

    earlier = tmp_path / "results.json"
    earlier.write_text('{"meta": {"goodput": {"reference_idle": {"ttft_ms": {"long": 1000.0, "short": 100.0}, '
                       '"tpot_ms": 50.0}}}, "runs": []}')
    idle = _reference_idle(earlier)
    cfg = SuiteConfig(out_dir=tmp_path, systems=(LLAMA_SERVER,), only=("goodput",), goodput_rates=(0.1,),
                      goodput_reference_idle=idle, goodput_reference_source=str(earlier))
    results = SuiteResults(cfg, build_scenarios(cfg, RAW, (1000, 30000)))
    results.runs[("goodput@0.1", LLAMA_SERVER)] = _run("l", 0.1, [rec("long-0", 2.5, 0.1), rec("short-0", 0.2, 0.1)])
    summary = report.goodput_summary(results)
    assert summary["slos"]["ttft_ms"] == pytest.approx({"long": 3000.0, "short": 300.0})
    assert summary["systems"][LLAMA_SERVER]["points"][0]["attainment"] == 1.0
    assert str(earlier) in summary["reference"]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="--goodput-slos-from"):
        _reference_idle(tmp_path / "bad.json")


@pytest.mark.parametrize("ratio,bound,met", [
    (1.6, None, True), (1.4, None, False), (1.6, "lower", True), (1.4, "lower", None), (1.4, "upper", False),
    (1.6, "upper", None), (1.6, "unknown", None), (1.4, "unknown", None)])
def test_a_bound_decides_the_goal_only_on_its_side(ratio, bound, met):
    """A lower bound under the goal (1P+1D attains 90% at every rate measured) is not a miss, nor an upper bound
    over it a pass: the verdict stays open."""
    assert report.goal_met(ratio, 1.5, bound) is met
