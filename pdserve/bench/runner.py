"""Send a workload to a backend under an arrival process and collect the records.

Arrivals (of sessions: a lone request, or all turns of one multi-turn conversation):
- all at once: `request_rate=inf` (every unit is due at t0);
- Poisson at `request_rate` per second: exponential gaps (gamma gaps with shape `burstiness` and the same
  mean when burstiness != 1, as in vLLM's benchmark), drawn from `seed`;
- fixed concurrency: `max_concurrency` caps requests in flight (combines with either of the above).
A unit's requests go one after another. The run's duration is from the first send to the last finish.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.backends import Backend
from pdserve.bench.metrics import RequestRecord, Summary, summarize
from pdserve.bench.workloads import BenchRequest, sessions, warmup_request


@dataclass(frozen=True)
class RunConfig:
    """How requests are sent."""

    request_rate: float = math.inf
    """Arrivals per second (Poisson); inf sends everything at once."""
    max_concurrency: int | None = None
    """Most requests in flight; None for no limit."""
    burstiness: float = 1.0
    """Shape of the gamma-distributed gaps: 1 is Poisson, < 1 burstier, > 1 more regular."""
    seed: int = 0
    """Seed of the arrival times."""
    warmup: bool = True
    """Send one short request (sharing no prefix with the workload) before measuring."""
    progress: bool = True
    """Show a progress bar (tqdm) of finished requests."""

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"RunConfig.request_rate must be > 0 (inf for all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"RunConfig.max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.burstiness > 0:
            raise ValueError(f"RunConfig.burstiness must be > 0, got {self.burstiness}")


@dataclass
class RunResult:
    """One run: what was sent, how, and what came back."""

    label: str
    config: RunConfig
    records: list[RequestRecord]
    duration_s: float
    summary: Summary
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, with_records: bool = True) -> dict[str, Any]:
        data = {"label": self.label, "config": _jsonable(asdict(self.config)), "meta": self.meta,
                "summary": self.summary.to_dict()}
        if with_records:
            data["requests"] = [record_dict(r) for r in self.records]
        return data


def record_dict(record: RequestRecord) -> dict[str, Any]:
    """A record as JSON: its derived metrics in ms plus the raw chunk times relative to its start."""
    done = record.success and bool(record.chunk_times_s)
    return {"request_id": record.request_id, "success": record.success, "error": record.error,
            "prompt_len": record.prompt_len, "output_len": record.output_len,
            "cached_tokens": record.cached_tokens,
            "ttft_ms": record.ttft_s * 1e3 if done else None,
            "tpot_ms": (t * 1e3 if (t := record.tpot_s) is not None else None) if done else None,
            "e2el_ms": record.e2el_s * 1e3 if done else None,
            "server_timings": record.server_timings,
            "chunk_times_ms": [(t - record.start_s) * 1e3 for t in record.chunk_times_s]}


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in data.items()}


def arrival_offsets(num_units: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each unit is due, in seconds from the start: all 0 for an infinite rate, else cumulative gamma
    gaps of mean 1/request_rate (exponential when burstiness is 1), the first unit at t=0."""
    if math.isinf(request_rate):
        return [0.0] * num_units
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    offsets, t = [], 0.0
    for i in range(num_units):
        offsets.append(t)
        t += rng.gammavariate(burstiness, theta)
    return offsets


class WarmupFailed(RuntimeError):
    """The warm-up request failed (the server is unreachable, or refused it): no run was started."""


async def run_async(backend: Backend, requests: Sequence[BenchRequest], config: RunConfig,
                    label: str = "", slos_ms: Mapping[str, float] | None = None) -> RunResult:
    """Send `requests` to a started backend; returns the records and their summary."""
    if not requests:
        raise ValueError("no requests to send")
    if len({r.request_id for r in requests}) != len(requests):
        raise ValueError("request ids must be unique within a run")
    if config.warmup:
        warm = await backend.send(warmup_request(requests))
        if not warm.success:
            raise WarmupFailed(f"{label or backend.name}: the warm-up request failed: {warm.error}")
    units = sessions(requests)
    offsets = arrival_offsets(len(units), config.request_rate, config.burstiness, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = _progress(len(requests), label or backend.name, config.progress)
    records: dict[str, RequestRecord] = {}

    async def send(request: BenchRequest) -> None:
        if limit is not None:
            async with limit:
                record = await _send_safely(backend, request)
        else:
            record = await _send_safely(backend, request)
        records[request.request_id] = record
        if bar is not None:
            bar.update(1)

    async def run_unit(unit: list[BenchRequest], due: float) -> None:
        delay = t0 + due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        for request in unit:
            await send(request)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(run_unit(unit, due) for unit, due in zip(units, offsets)))
    finally:
        if bar is not None:
            bar.close()
    ordered = [records[r.request_id] for r in requests]
    done = [r for r in ordered if r.chunk_times_s]
    end = max((r.chunk_times_s[-1] for r in done), default=time.perf_counter())
    start = min((r.start_s for r in ordered), default=t0)
    duration = max(end - start, 1e-9)
    return RunResult(label or backend.name, config, ordered, duration, summarize(ordered, duration, slos_ms))


async def _send_safely(backend: Backend, request: BenchRequest) -> RequestRecord:
    try:
        return await backend.send(request)
    except Exception as exc:  # a backend bug must not end the whole run silently: it is recorded per request
        record = RequestRecord(prompt_len=request.prompt_len, start_s=time.perf_counter(),
                               request_id=request.request_id)
        record.error = f"{type(exc).__name__}: {exc}"
        return record


async def run_with(backend: Backend, requests: Sequence[BenchRequest], config: RunConfig, label: str = "",
                   slos_ms: Mapping[str, float] | None = None) -> RunResult:
    """`run_async` between `backend.start()` and `backend.close()`."""
    await backend.start()
    try:
        return await run_async(backend, requests, config, label, slos_ms)
    finally:
        await backend.close()


def run(backend: Backend, requests: Sequence[BenchRequest], config: RunConfig, label: str = "",
        slos_ms: Mapping[str, float] | None = None) -> RunResult:
    """Blocking `run_with` in a fresh event loop."""
    return asyncio.run(run_with(backend, requests, config, label, slos_ms))


def write_json(path: Path, results: Iterable[RunResult], meta: Mapping[str, Any] | None = None,
               with_records: bool = True) -> Path:
    """Write runs (and shared metadata: machine, commands, model) as one JSON document."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": dict(meta or {}), "runs": [r.to_dict(with_records) for r in results]}
    path.write_text(json.dumps(doc, indent=1))
    return path


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True)
