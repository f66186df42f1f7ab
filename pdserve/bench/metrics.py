"""Serving metrics with the definitions of vLLM's `benchmarks/benchmark_serving.py`, so figures compare with
published ones. Pure: plain floats in, plain dataclasses out.

Per request (times in seconds, all from one monotonic clock):
    start       when the request was sent (for arrivals on a schedule: when it was sent, not when it was due)
    chunk_times arrival of every streamed chunk that carried output (one chunk may carry several tokens)
    TTFT        chunk_times[0] - start                          time to first token
    E2EL        chunk_times[-1] - start                         end-to-end latency (to the last token)
    TPOT        (E2EL - TTFT) / (output_len - 1)                time per output token after the first;
                only for output_len > 1 (a 1-token request has no TPOT; for goodput it counts as 0)
    ITL         chunk_times[i] - chunk_times[i-1]               inter-token latencies, one per chunk after the
                first, pooled over all requests (a chunk of k tokens gives one ITL, as in vLLM)
    output_len  the server's own count of generated tokens when it reports one (usage), else the tokens seen

Per run (duration = wall time from the first request sent to the last one finished):
    request throughput     completed requests / duration
    output throughput      generated tokens of completed requests / duration
    total token throughput (prompt + generated tokens of completed requests) / duration
    goodput                completed requests meeting EVERY given SLO / duration, with SLOs in ms on
                           "ttft", "tpot", "e2el" (a request meets an SLO when its value <= the SLO)
    statistics             mean, std (population), median and percentiles of TTFT, TPOT, ITL and E2EL over
                           completed requests, percentiles with linear interpolation (numpy's default);
                           0 when there is nothing to summarize. Reported in milliseconds.
Failed requests count in `failed` and nowhere else.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    """What one request measured; filled in by a backend, read by `summarize`."""

    prompt_len: int
    """Prompt tokens sent."""
    start_s: float
    """When the request was sent."""
    chunk_times_s: list[float] = field(default_factory=list)
    """Arrival time of every chunk that carried output tokens, in order."""
    output_len: int = 0
    """Generated tokens (the server's count when it reports one)."""
    success: bool = False
    """The stream ended normally."""
    error: str = ""
    """Why it failed, when it did."""
    cached_tokens: int | None = None
    """Prompt tokens the server took from its prefix cache, when it reports them."""
    request_id: str = ""
    server_timings: dict[str, float | str] | None = None
    """The server's own account of the first token, when it gives one (pdserve: queue_ms, prefill_ms,
    transfer_ms, ttft_ms from its arrival at the gateway, transport, transfer_bytes)."""

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.start_s

    @property
    def e2el_s(self) -> float:
        return self.chunk_times_s[-1] - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """None for requests with fewer than 2 output tokens."""
        if self.output_len < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1)

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:])]


@dataclass(frozen=True)
class Stats:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    std: float
    median: float
    percentiles: dict[str, float]
    """"p90" -> value."""
    count: int


@dataclass(frozen=True)
class Summary:
    """One run's metrics."""

    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    """Requests per second."""
    output_throughput: float
    """Generated tokens per second."""
    total_token_throughput: float
    """Prompt + generated tokens per second."""
    goodput: float | None
    """Requests per second meeting every SLO; None when no SLO was given."""
    slos_ms: dict[str, float]
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2el_ms: Stats
    cached_tokens: int | None
    """Prompt tokens served from prefix caches, when the server reported them."""

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default);
    0.0 for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentile_key(q: float) -> str:
    """"p90", "p99.9"."""
    return f"p{q:g}"


def stats_ms(values_s: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> Stats:
    """Mean, population std, median and percentiles of values in seconds, reported in milliseconds."""
    values = [v * 1000.0 for v in values_s]
    n = len(values)
    mean = sum(values) / n if n else 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / n) if n else 0.0
    return Stats(mean=mean, std=std, median=percentile(values, 50.0),
                 percentiles={percentile_key(q): percentile(values, q) for q in percentiles}, count=n)


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); ValueError names a bad item."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"SLO {item!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"SLO {item!r}: must be > 0 ms")
        slos[name] = ms
    return slos


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """Whether a completed request meets every SLO (a request with no TPOT counts TPOT as 0, as vLLM does)."""
    values_s = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2el_s}
    return all(values_s[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def summarize(records: Sequence[RequestRecord], duration_s: float, slos_ms: Mapping[str, float] | None = None,
              percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> Summary:
    """Metrics of one run; `duration_s` is the run's wall time (first send to last finish)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    unknown = set(slos_ms or {}) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; known: {SLO_METRICS}")
    percentiles = tuple(percentiles)
    done = [r for r in records if r.success and r.chunk_times_s]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in done)
    tpots = [t for r in done if (t := r.tpot_s) is not None]
    itls = [itl for r in done for itl in r.itls_s]
    goodput = None
    if slos_ms:
        goodput = sum(meets_slos(r, slos_ms) for r in done) / duration_s
    reported = [r.cached_tokens for r in done if r.cached_tokens is not None]
    return Summary(
        duration_s=duration_s,
        completed=len(done),
        failed=len(records) - len(done),
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(done) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        goodput=goodput,
        slos_ms=dict(slos_ms or {}),
        ttft_ms=stats_ms([r.ttft_s for r in done], percentiles),
        tpot_ms=stats_ms(tpots, percentiles),
        itl_ms=stats_ms(itls, percentiles),
        e2el_ms=stats_ms([r.e2el_s for r in done], percentiles),
        cached_tokens=sum(reported) if reported else None,
    )
