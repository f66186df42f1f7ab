"""How much CPU other jobs took while a run was measured (Linux /proc).

On a shared machine a system can look slow only because something else ran at the same time, and servers
whose threads wait for each other at every step (llama.cpp's threadpool) lose far more than their share. So
every run reports `others_cores`: CPU-seconds used by processes that are not the benchmark's (busy time of all
CPUs from /proc/stat minus the CPU time of this process and of the servers it started) per wall second.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass


def parse_proc_stat(text: str) -> tuple[int, int]:
    """(busy ticks, total ticks) of all CPUs from /proc/stat's first line; idle and iowait are not busy,
    guest time is already inside user time."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            fields = [int(v) for v in line.split()[1:]]
            user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
            busy = user + nice + system + irq + softirq + steal
            return busy, busy + idle + iowait
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def parse_pid_stat(text: str) -> int:
    """utime + stime ticks of a process (all its threads) from /proc/PID/stat."""
    fields = text[text.rindex(")") + 2:].split()  # the command name may contain spaces and parentheses
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of the whole line


@dataclass(frozen=True)
class CpuSample:
    wall_s: float
    busy_s: float
    """All CPUs' busy seconds since boot."""
    ours_s: float
    """CPU seconds of this process and the given server processes."""


def sample(pids: Iterable[int] = ()) -> CpuSample:
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        busy, _ = parse_proc_stat(f.read())
    ours = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ours += parse_pid_stat(f.read())
        except OSError:  # it exited: its time is lost to the count, which then overstates the others
            pass
    own = os.times()
    return CpuSample(time.monotonic(), busy / ticks, ours / ticks + own.user + own.system)


def others_cores(before: CpuSample, after: CpuSample) -> float:
    """Average number of CPUs other processes kept busy between two samples (>= 0)."""
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        return 0.0
    others = (after.busy_s - before.busy_s) - (after.ours_s - before.ours_s)
    return max(0.0, others / wall)


def wait_quiet(max_wait_s: float, threshold_cores: float = 0.25, window_s: float = 2.0) -> float:
    """Wait (at most `max_wait_s`) until other processes keep fewer than `threshold_cores` CPUs busy over a
    `window_s` window; returns the last window's figure (call it when the benchmark itself is idle)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        before = sample()
        time.sleep(window_s)
        others = others_cores(before, sample())
        if others < threshold_cores or time.monotonic() + window_s > deadline:
            return others
