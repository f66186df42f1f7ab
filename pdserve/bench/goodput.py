"""Goodput under SLOs set from the machine's idle figures: does disaggregation pay (issue 16)? Pure.

The suite's goodput scenarios send a mixed workload (workloads.mixed_workload: long prompts among short chat
turns) at several Poisson rates to each system, after an idle probe (the same kinds of request, one at a time,
long ones at the long class's greatest length). From the reference system's idle probe (pdserve colocated: one
engine with every core) come the SLOs every system is judged by:

    TTFT SLO of class c = ttft_scale x idle TTFT of class c     c = long, short (median over the probe)
    TPOT SLO            = tpot_scale x idle TPOT                 median over every probe request

A request meets its SLOs when it completed, its TTFT <= its class's TTFT SLO and its TPOT <= the TPOT SLO
(metrics.meets_slos). Then, per system and rate:

    goodput     = requests meeting their SLOs / run duration    (req/s; metrics' duration: first send to last token)
    attainment  = requests meeting their SLOs / requests sent    (failed requests miss)
    max rate at 90%: the highest rate r with attainment >= 90% at every measured rate <= r, interpolated
                linearly between the last measured rate that attains it and the first that does not (DistServe's
                goodput); None when even the lowest rate misses, the highest rate when none misses.
    peak goodput: the most goodput at any measured rate. The issue's goal (1P+1D >= 1.5x colocated) compares the
                two systems' max rates at 90% when both have one, else their peak goodputs over the rates both
                ran (report.goodput_goal): at the highest rate both may have collapsed.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.bench.metrics import RequestRecord, meets_slos, percentile
from pdserve.bench.workloads import PROMPT_CLASSES, prompt_class

ATTAINMENT_TARGET = 0.9


@dataclass(frozen=True)
class IdleFigures:
    """One system's single-request figures (ms)."""

    ttft_ms: dict[str, float]
    """Prompt class -> median TTFT."""
    tpot_ms: float
    """Median TPOT over every probe request."""


@dataclass(frozen=True)
class GoodputSlos:
    ttft_ms: dict[str, float]
    """Prompt class -> TTFT SLO."""
    tpot_ms: float
    ttft_scale: float
    tpot_scale: float

    def of(self, request_id: str) -> dict[str, float]:
        """The SLOs of one request (metrics.meets_slos form)."""
        return {"ttft": self.ttft_ms[prompt_class(request_id)], "tpot": self.tpot_ms}


def idle_figures(records: Sequence[RequestRecord]) -> IdleFigures:
    """Median TTFT per prompt class and median TPOT of an idle probe; ValueError when a class has no completed
    request."""
    done = [r for r in records if r.success and r.chunk_times_s]
    ttft = {}
    for kind in PROMPT_CLASSES:
        values = [r.ttft_s * 1e3 for r in done if prompt_class(r.request_id) == kind]
        if not values:
            raise ValueError(f"the idle probe has no completed {kind} request")
        ttft[kind] = percentile(values, 50)
    tpots = [t * 1e3 for r in done if (t := r.tpot_s) is not None]
    if not tpots:
        raise ValueError("the idle probe has no request with a TPOT (2 or more output tokens)")
    return IdleFigures(ttft, percentile(tpots, 50))


def slos_from_idle(idle: IdleFigures, ttft_scale: float, tpot_scale: float) -> GoodputSlos:
    """The module docstring's formula."""
    if not (ttft_scale > 0 and tpot_scale > 0):
        raise ValueError(f"SLO scales must be > 0, got ttft {ttft_scale}, tpot {tpot_scale}")
    return GoodputSlos({kind: ttft_scale * ms for kind, ms in idle.ttft_ms.items()}, tpot_scale * idle.tpot_ms,
                       ttft_scale, tpot_scale)


def meeting(records: Sequence[RequestRecord], slos: GoodputSlos) -> list[RequestRecord]:
    """The completed records that meet their class's SLOs."""
    return [r for r in records if r.success and r.chunk_times_s and meets_slos(r, slos.of(r.request_id))]


def attainment(records: Sequence[RequestRecord], slos: GoodputSlos) -> float:
    """Fraction of the requests sent that met their SLOs (0 for none sent)."""
    return len(meeting(records, slos)) / len(records) if records else 0.0


def goodput(records: Sequence[RequestRecord], duration_s: float, slos: GoodputSlos) -> float:
    """Requests per second that met their SLOs."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    return len(meeting(records, slos)) / duration_s


def max_rate_at(points: Mapping[float, float], target: float = ATTAINMENT_TARGET) -> float | None:
    """`points`: rate -> attainment. The highest rate at which attainment >= target holds at every measured rate
    up to it (interpolated, see the module docstring); None when the lowest rate misses."""
    if not points:
        return None
    rates = sorted(points)
    if points[rates[0]] < target:
        return None
    for low, high in itertools.pairwise(rates):
        if points[high] < target:
            a_low, a_high = points[low], points[high]
            return low + (high - low) * (a_low - target) / (a_low - a_high)
    return rates[-1]
