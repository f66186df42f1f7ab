"""Parsing /proc for the 'other jobs' CPU figure, on fixed text."""

from __future__ import annotations

import pytest

from pdserve.bench.cpumeter import CpuSample, others_cores, parse_pid_stat, parse_proc_stat

PROC_STAT = """cpu  100 5 50 800 20 3 2 10 7 0
cpu0 50 2 25 400 10 1 1 5 0 0
intr 12345
"""


def test_proc_stat_busy_and_total():
    busy, total = parse_proc_stat(PROC_STAT)
    assert busy == 100 + 5 + 50 + 3 + 2 + 10  # guest (7) is inside user already
    assert total == busy + 800 + 20


def test_proc_stat_without_aggregate_line():
    with pytest.raises(ValueError):
        parse_proc_stat("cpu0 1 2 3 4\n")


def test_pid_stat_with_spaces_and_parens_in_the_name():
    fields = ["S", "1", "1", "1", "0", "-1", "4194304", "10", "0", "0", "0", "123", "45"] + ["0"] * 30
    text = "4242 (llama server (x)) " + " ".join(fields)
    assert parse_pid_stat(text) == 123 + 45


def test_others_cores():
    before = CpuSample(wall_s=10.0, busy_s=100.0, ours_s=20.0)
    after = CpuSample(wall_s=12.0, busy_s=104.0, ours_s=23.0)  # 4 CPU-s busy in 2 s, 3 of them ours
    assert others_cores(before, after) == pytest.approx(0.5)
    assert others_cores(after, after) == 0.0
    assert others_cores(before, CpuSample(12.0, 101.0, 23.0)) == 0.0  # never negative
