"""Metric math on synthetic timestamps with answers worked out by hand (vLLM benchmark_serving definitions)."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.metrics import RequestRecord, meets_slos, parse_slos, percentile, stats_ms, summarize
from pdserve.bench.runner import arrival_offsets


def rec(start: float, times: list[float], output_len: int | None = None, prompt_len: int = 10,
        success: bool = True, cached: int | None = None) -> RequestRecord:
    return RequestRecord(prompt_len=prompt_len, start_s=start, chunk_times_s=list(times),
                         output_len=len(times) if output_len is None else output_len, success=success,
                         cached_tokens=cached)


def test_per_request_ttft_e2el_tpot_itl():
    # sent at 1.0; tokens at 1.5, 1.6, 1.8, 2.1
    r = rec(1.0, [1.5, 1.6, 1.8, 2.1])
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2el_s == pytest.approx(1.1)
    assert r.tpot_s == pytest.approx((1.1 - 0.5) / 3)  # 0.2
    assert r.itls_s == pytest.approx([0.1, 0.2, 0.3])


def test_tpot_uses_token_count_not_chunk_count():
    # 2 chunks carrying 5 tokens in all (a server that batches tokens per message)
    r = rec(0.0, [1.0, 2.0], output_len=5)
    assert r.tpot_s == pytest.approx(1.0 / 4)
    assert r.itls_s == pytest.approx([1.0])  # one ITL per chunk, as vLLM


def test_single_token_request_has_no_tpot_but_counts_zero_for_goodput():
    r = rec(0.0, [0.3])
    assert r.tpot_s is None
    assert r.itls_s == []
    assert meets_slos(r, {"ttft": 400, "tpot": 1})
    assert not meets_slos(r, {"ttft": 200})


def test_summary_throughputs_and_stats():
    a = rec(0.0, [0.1, 0.2, 0.3], prompt_len=100, cached=64)  # ttft 100, tpot 100, e2el 300 (ms)
    b = rec(0.5, [0.8, 1.3], prompt_len=50, cached=0)         # ttft 300, tpot 500, e2el 800
    failed = rec(0.0, [], output_len=0, prompt_len=999, success=False)
    s = summarize([a, b, failed], duration_s=2.0)
    assert (s.completed, s.failed) == (2, 1)
    assert s.total_input_tokens == 150 and s.total_output_tokens == 5
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(2.5)
    assert s.total_token_throughput == pytest.approx(77.5)
    assert s.ttft_ms.mean == pytest.approx(200.0)
    assert s.ttft_ms.std == pytest.approx(100.0)  # population std
    assert s.ttft_ms.median == pytest.approx(200.0)
    assert s.tpot_ms.mean == pytest.approx(300.0)
    assert s.e2el_ms.percentiles["p90"] == pytest.approx(300 + 0.9 * 500)
    assert s.itl_ms.count == 3 and s.itl_ms.mean == pytest.approx(1000 * (0.1 + 0.1 + 0.5) / 3)
    assert s.goodput is None
    assert s.cached_tokens == 64


def test_goodput_counts_requests_meeting_every_slo():
    fast = rec(0.0, [0.1, 0.15, 0.2])        # ttft 100, tpot 50
    slow_first = rec(0.0, [0.6, 0.65, 0.7])  # ttft 600, tpot 50
    slow_decode = rec(0.0, [0.1, 0.4, 0.7])  # ttft 100, tpot 300
    s = summarize([fast, slow_first, slow_decode], duration_s=4.0, slos_ms={"ttft": 500, "tpot": 100})
    assert s.goodput == pytest.approx(1 / 4)
    only_ttft = summarize([fast, slow_first, slow_decode], duration_s=4.0, slos_ms={"ttft": 500})
    assert only_ttft.goodput == pytest.approx(2 / 4)
    boundary = summarize([fast], duration_s=1.0, slos_ms={"ttft": 100.0})  # <= meets the SLO
    assert boundary.goodput == pytest.approx(1.0)


def test_percentile_linear_interpolation_like_numpy():
    values = [15, 20, 35, 40, 50]
    assert percentile(values, 0) == 15
    assert percentile(values, 100) == 50
    assert percentile(values, 50) == 35
    assert percentile(values, 40) == pytest.approx(29.0)  # rank 1.6: 20 + 0.6 * 15
    assert percentile(values, 90) == pytest.approx(46.0)  # rank 3.6: 40 + 0.6 * 10
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_stats_of_nothing_are_zero():
    s = stats_ms([], (50, 99))
    assert (s.mean, s.std, s.median, s.count) == (0.0, 0.0, 0.0, 0)
    assert s.percentiles == {"p50": 0.0, "p99": 0.0}


def test_parse_slos():
    assert parse_slos(["ttft:500", "TPOT:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["ttft:0"]):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_summarize_rejects_bad_input():
    with pytest.raises(ValueError):
        summarize([], duration_s=0.0)
    with pytest.raises(ValueError):
        summarize([], duration_s=1.0, slos_ms={"itl": 5})


def test_arrivals_all_at_once_and_poisson():
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    offsets = arrival_offsets(4000, request_rate=5.0, seed=3)
    assert offsets[0] == 0.0
    assert offsets == sorted(offsets)
    assert offsets == arrival_offsets(4000, request_rate=5.0, seed=3)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.2, rel=0.1)
    # exponential gaps: standard deviation equals the mean; regular arrivals (burstiness >> 1) have far less
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert std == pytest.approx(mean, rel=0.15)
    regular = arrival_offsets(4000, request_rate=5.0, burstiness=100.0, seed=3)
    regular_gaps = [b - a for a, b in zip(regular, regular[1:])]
    assert max(regular_gaps) < 0.4
