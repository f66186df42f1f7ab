"""CPU pinning of worker processes (`--cpu-affinity 0-3,6`, `pdserve up --pin-workers`), Linux only.

A CPU list is written the way taskset and /sys/devices/system/cpu/online write it: comma-separated CPU numbers
and inclusive ranges ("0-3,6"). A pinned process runs only on its CPUs, every thread of it, so its torch threads
(one per pinned CPU: the CLI makes the thread count match) never share a core with another pinned worker. The
gateway and Redis are not pinned: they float over the machine. A worker that borrows another's CPUs while that
one is idle (engine.cpu_share) is pinned with `borrowed=` those CPUs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

_ITEM = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """"0-3,6" -> (0, 1, 2, 3, 6), sorted, each CPU once; ValueError saying what is wrong."""
    cpus: set[int] = set()
    for item in text.split(","):
        match = _ITEM.fullmatch(item)
        if not match:
            raise ValueError(f"{text!r} is not a CPU list (CPU numbers and ranges, e.g. 0-3,6)")
        first = int(match[1])
        last = int(match[2]) if match[2] is not None else first
        if last < first:
            raise ValueError(f"{text!r}: range {first}-{last} runs backwards")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 6) -> "0-3,6" (what parse_cpu_list reads back)."""
    ordered = sorted(set(cpus))
    items: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        items.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(items)


def allowed_cpus() -> tuple[int, ...]:
    """CPUs this process may run on (its affinity mask, which containers narrow), else all of os.cpu_count()."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def check_cpus(cpus: Sequence[int], allowed: Sequence[int]) -> None:
    """ValueError naming the CPUs of `cpus` outside `allowed` (the kernel would silently drop them)."""
    missing = sorted(set(cpus) - set(allowed))
    if missing:
        raise ValueError(f"CPU(s) {format_cpu_list(missing)} not available to this process "
                         f"(available: {format_cpu_list(allowed)})")


BORROWING_SPIN_COUNT = "2000"
"""GOMP_SPINCOUNT of a process that borrows CPUs (unless set already): how many times an idle OpenMP thread polls
for work before it sleeps in the kernel. At libgomp's default, 300,000 (milliseconds of spinning), a borrowing
worker's idle thread spun on after each borrowed step, on the core its partner then stepped on; 2,000 (tens of
microseconds) covers the gaps between one step's parallel regions, not the gaps between steps (BENCHMARKS.md,
"both ways")."""


def pin_process(cpus: Sequence[int], *, borrowed: Sequence[int] = ()) -> None:
    """Restrict every thread of this process, and every thread and child it starts later, to `cpus`.
    (sched_setaffinity(0) would move only the calling thread; threads started at import stay where they were.)

    `borrowed`: CPUs it will also step on at times (engine.cpu_share). Then torch is loaded first, on `cpus` and
    `borrowed` together, with GOMP_SPINCOUNT at BORROWING_SPIN_COUNT: libgomp counts the CPUs it may use once,
    when it loads, and a team larger than that count sleeps in the kernel after every parallel region, paying a
    futex wake-up per thread per region on the borrowed steps."""
    if borrowed:
        pin_process([*cpus, *borrowed])
        os.environ.setdefault("GOMP_SPINCOUNT", BORROWING_SPIN_COUNT)
        import torch  # noqa: F401  (and libgomp with it)
    mask = set(cpus)
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def split_cpus(cpus: Sequence[int], counts: Sequence[int]) -> list[tuple[int, ...]]:
    """Consecutive, disjoint slices of `cpus`, one of `counts[i]` CPUs per process, in order; ValueError when
    they do not fit."""
    if sum(counts) > len(cpus):
        raise ValueError(f"{sum(counts)} CPUs needed ({'+'.join(map(str, counts))}) but only {len(cpus)} "
                         f"given ({format_cpu_list(cpus)})")
    slices, start = [], 0
    for count in counts:
        slices.append(tuple(cpus[start:start + count]))
        start += count
    return slices
