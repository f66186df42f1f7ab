"""PNG plots of benchmark runs (matplotlib, Agg backend: no display needed).

- `plot_latency_cdfs`: empirical CDFs of TTFT, TPOT, ITL and E2EL, one line per run;
- `plot_throughput_vs_rate`: output tokens/s and p90 TTFT against the request rate, one line per system;
- `plot_goodput_vs_rate`: goodput and SLO attainment against the request rate, one line per system.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from pdserve.bench.metrics import RequestRecord


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cdf_points(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """(sorted values, fraction of values <= each): the empirical CDF as a step function's corners."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def latency_values_ms(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Per-metric values (ms) of the completed records: ttft, tpot, itl, e2el."""
    done = [r for r in records if r.success and r.chunk_times_s]
    return {
        "TTFT": [r.ttft_s * 1e3 for r in done],
        "TPOT": [t * 1e3 for r in done if (t := r.tpot_s) is not None],
        "ITL": [itl * 1e3 for r in done for itl in r.itls_s],
        "E2EL": [r.e2el_s * 1e3 for r in done],
    }


def plot_latency_cdfs(runs: Mapping[str, Sequence[RequestRecord]], path: Path, title: str = "") -> Path:
    """One panel per metric, one CDF line per run label."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for label, records in runs.items():
        for ax, (metric, values) in zip(axes, latency_values_ms(records).items()):
            if values:
                xs, ys = cdf_points(values)
                ax.step(xs, ys, where="post", label=label)
    for ax, metric in zip(axes, ("TTFT", "TPOT", "ITL", "E2EL")):
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("fraction of requests" if metric != "ITL" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(5))
        if metric in ("ITL", "TTFT"):
            ax.set_xscale("log")
    axes[0].legend(fontsize=8)
    return _save(fig, path, title)


def plot_throughput_vs_rate(points: Mapping[str, Sequence[tuple[float, float, float]]], path: Path,
                            title: str = "") -> Path:
    """`points[label]` = [(request rate, output tokens/s, p90 TTFT ms), ...]; an infinite rate is drawn at the
    right end, labelled "inf"."""
    plt = _pyplot()
    finite = [rate for pts in points.values() for rate, _, _ in pts if not math.isinf(rate)]
    inf_at = (max(finite) * 1.5) if finite else 1.0
    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, pts in points.items():
        ordered = sorted(pts, key=lambda p: p[0])
        xs = [inf_at if math.isinf(rate) else rate for rate, _, _ in ordered]
        ax_tput.plot(xs, [tput for _, tput, _ in ordered], marker="o", label=label)
        ax_ttft.plot(xs, [ttft for _, _, ttft in ordered], marker="o", label=label)
    has_inf = any(math.isinf(rate) for pts in points.values() for rate, _, _ in pts)
    ticks = sorted(set(finite)) + ([inf_at] if has_inf else [])
    tick_labels = [f"{t:g}" for t in sorted(set(finite))] + (["inf"] if has_inf else [])
    for ax, ylabel in ((ax_tput, "output tokens/s"), (ax_ttft, "p90 TTFT (ms)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_xticks(ticks, tick_labels)
        ax.grid(alpha=0.3)
    ax_ttft.set_yscale("log")
    ax_tput.legend(fontsize=8)
    return _save(fig, path, title)


def plot_goodput_vs_rate(points: Mapping[str, Sequence[tuple[float, float, float]]], path: Path,
                         target: float = 0.9, title: str = "") -> Path:
    """`points[label]` = [(request rate, goodput req/s, SLO attainment 0..1), ...]; the attainment panel draws
    the `target` line."""
    plt = _pyplot()
    fig, (ax_good, ax_att) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, pts in points.items():
        ordered = sorted(pts)
        rates = [rate for rate, _, _ in ordered]
        ax_good.plot(rates, [good for _, good, _ in ordered], marker="o", label=label)
        ax_att.plot(rates, [100 * att for _, _, att in ordered], marker="o", label=label)
    rates = sorted({rate for pts in points.values() for rate, _, _ in pts})
    if rates:
        ax_good.plot(rates, rates, linestyle=":", color="grey", label="every request on time")
    ax_att.axhline(100 * target, linestyle="--", color="grey", label=f"{100 * target:.0f}% target")
    ax_good.set_ylabel("goodput (req/s meeting both SLOs)")
    ax_att.set_ylabel("SLO attainment (%)")
    ax_att.set_ylim(0, 102)
    for ax in (ax_good, ax_att):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path, title)


def _save(fig, path: Path, title: str | None) -> Path:
    plt = _pyplot()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
