"""The suite's markdown report (pasted into BENCHMARKS.md): machine, command, how each system was configured,
one table per scenario with the ratios against each peer, the batch-1 roofline, and the issue's goals. Pure:
formats what the suite measured."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from pdserve.bench import goodput
from pdserve.bench.metrics import RequestRecord, Summary, percentile
from pdserve.bench.workloads import LONG, SHORT, prompt_class

REPEAT = " (repeat)"
"""Suffix of a system's key in its repeated run."""

if TYPE_CHECKING:
    from pdserve.bench.runner import RunResult
    from pdserve.bench.suite import SuiteResults

PEERS = ("llama-server", "transformers")
PDSERVE = ("pdserve-engine", "pdserve-engine-int8", "pdserve-engine-int4", "pdserve-engine-native",
           "pdserve-engine-kv-bf16", "pdserve-1p1d", "pdserve-1p1d-lend")


def _f(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:,.{digits}f}"


def _x(ratio: float | None) -> str:
    return "—" if ratio is None or not math.isfinite(ratio) else f"{ratio:.2f}x"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def cold_and_cached(requests: Sequence, records: Sequence[RequestRecord]) -> tuple[list[float], list[float]]:
    """TTFTs (ms) of the first request of each session (cold) and of the later ones (cached prefix), by
    position in the session; failed requests are left out."""
    seen: set = set()
    cold, cached = [], []
    for request, record in zip(requests, records):
        is_cold = request.session_id not in seen
        seen.add(request.session_id)
        if record.success and record.chunk_times_s:
            (cold if is_cold else cached).append(record.ttft_s * 1e3)
    return cold, cached


def render(results: SuiteResults, pngs: Mapping[str, str]) -> str:
    cfg, meta = results.config, results.meta
    machine = meta["machine"]
    weights = meta["weights"]
    bandwidth = meta["copy_bandwidth_bytes_per_s"]
    roof_stored = bandwidth / weights["stored"]
    roof_f32 = bandwidth / weights["float32"]
    roof_int8 = bandwidth / weights["int8"]
    roof_int4 = bandwidth / weights["int4"]
    roof_kept = bandwidth / weights["kept"]
    command = f"pdserve bench --suite cpu --threads {cfg.threads}"
    if cfg.llama_server is not None:
        command += " --llama-server PATH/TO/llama-server"
    command += _non_default_flags(cfg)
    lines = [
        f"### Serving suite ({meta['date']}, CPU, {cfg.threads} threads per system)",
        "",
        f"- Machine: {machine['cpu']}, {machine['logical_cpus']} logical CPUs, "
        f"{_f(machine['memory_gib'])} GiB, {machine['os']}, Python {machine['python']}, torch {machine['torch']}; "
        f"load average {machine['load_average'][0]:.2f} at the start, {meta['load_average_end'][0]:.2f} at the end "
        "(a shared machine: compare ratios within this run, not absolute figures across runs)",
        f"- Command: `{command}` (whole suite {meta['suite_wall_s'] / 60:.1f} min"
        + ("" if meta.get("complete") else ", INCOMPLETE: these are the systems done so far") + ")",
        f"- Model: `{meta['model'].rsplit('/', 1)[-1]}`; every system gets the same token ids (chat template "
        "rendered once, sent as raw completions), greedy, EOS ignored, exactly max_tokens generated",
        f"- Batch-1 decode roofline: weights read per token {weights['stored'] / 2**20:.0f} MiB as stored in the "
        f"GGUF (llama.cpp reads these) / {weights['kept'] / 2**20:.0f} MiB as pdserve keeps the file's codes "
        "(int4 4-bit groups, int8 8-bit ones: pdserve-engine, pdserve-engine-native, pdserve-engine-kv-bf16, the "
        "clusters) "
        f"/ {weights['float32'] / 2**20:.0f} MiB as float32 (transformers) "
        f"/ {weights['int8'] / 2**20:.0f} MiB as int8 + bf16 row scales (pdserve-engine-int8) "
        f"/ {weights['int4'] / 2**20:.0f} MiB as int4 + bf16 group scales, int8 LM head (pdserve-engine-int4); "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (best of one 1 GiB copy at the start, "
        f"{meta['copy_bandwidth_start_end'][0] / 1e9:.1f}, and one at the end, "
        f"{meta['copy_bandwidth_start_end'][1] / 1e9:.1f}) -> at most {roof_stored:.0f} tok/s as stored, "
        f"{roof_kept:.0f} tok/s kept codes, {roof_f32:.1f} tok/s float32, {roof_int8:.0f} tok/s int8, "
        f"{roof_int4:.0f} tok/s int4",
        f"- other jobs (CPUs): how many of the {machine['logical_cpus']} CPUs processes outside the benchmark kept "
        "busy during a run, on average (all CPUs' busy time minus that of the benchmark and the servers it "
        "started); a run with much of it measured a slowed system, llama-server the most (its threads wait "
        "for each other at every step). Each system starts after waiting (up to "
        f"{cfg.quiet_wait_s:.0f} s) for the CPUs to be free; a peer whose runs were contended runs its one-stream "
        "and many-stream scenarios again at the end",
        "",
        "How each system was built and configured:",
        "",
    ]
    for system in cfg.systems:
        if system in results.peers:
            lines.append(f"- {system}: {results.peers[system]}")
    for system, error in results.errors.items():
        lines.append(f"- **{system} has no (or partial) results**: {error}")
    for note in results.notes:
        lines.append(f"- {note}")
    lines.append("")
    lines += _batch1(results, {"stored": roof_stored, "kept": roof_kept, "float32": roof_f32, "int8": roof_int8,
                               "int4": roof_int4})
    lines += _streams(results)
    lines += _prefix_cache(results)
    lines += _shared_prefix(results)
    lines += _sweep(results)
    lines += _goodput(results)
    lines += _goals(results)
    if pngs:
        lines += ["Plots: " + ", ".join(f"[{name}]({file})" for name, file in pngs.items()), ""]
    return "\n".join(lines)


_FLAGS = {"only": "--only", "goodput_rates": "--goodput-rates", "goodput_requests": "--goodput-requests",
          "goodput_long_len": "--goodput-long-len", "goodput_long_fraction": "--goodput-long-fraction",
          "goodput_ttft_scale": "--goodput-ttft-scale", "goodput_tpot_scale": "--goodput-tpot-scale",
          "goodput_batched_tokens": "--goodput-batched-tokens",
          "goodput_local_prefill_threshold": "--goodput-local-prefill-threshold",
          "goodput_idle_offload_min_tokens": "--goodput-idle-offload-min-tokens",
          "goodput_lend_batched_tokens": "--goodput-lend-batched-tokens",
          "goodput_long_prefill_token_threshold": "--goodput-long-prefill-token-threshold"}


def _non_default_flags(cfg) -> str:
    """The `pdserve bench` flags of the SuiteConfig fields that differ from their defaults (those with a flag)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    parts = []
    for name, flag in _FLAGS.items():
        value = getattr(cfg, name)
        if value == defaults[name]:
            continue
        if name == "goodput_long_len":
            parts.append(f"{flag} {value[0]}-{value[1]}")
        elif isinstance(value, tuple):
            parts.append(f"{flag} {' '.join(f'{v:g}' if isinstance(v, float) else str(v) for v in value)}")
        else:
            parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    systems = next(f.default for f in dataclasses.fields(cfg) if f.name == "systems")
    if tuple(cfg.systems) != tuple(systems):
        parts.append("--systems " + " ".join(cfg.systems))
    return "".join(" " + part for part in parts)


def _run(results: SuiteResults, scenario: str, system: str) -> Summary | None:
    run = results.runs.get((scenario, system))
    return run.summary if run is not None else None


def _others(results: SuiteResults, scenario: str, key: str) -> str:
    """CPUs other jobs kept busy on average during a run (see cpumeter)."""
    run = results.runs.get((scenario, key))
    value = run.meta.get("others_cores") if run is not None else None
    return "—" if value is None else f"{value:.2f}"


def _keys(results: SuiteResults, scenario: str) -> list[str]:
    """Run keys of a scenario in the order the systems ran: each system, then its repeat if any."""
    spec = results.scenarios.get(scenario)
    if spec is None:
        return []
    return [key for system in spec.systems for key in (system, system + REPEAT) if (scenario, key) in results.runs]


def _best(results: SuiteResults, scenario: str, peer: str, metric: Callable[[Summary], float | None],
          lower_is_better: bool) -> float | None:
    """The peer's better value over its runs (first and repeat)."""
    values = [v for key in (peer, peer + REPEAT) if (s := _run(results, scenario, key)) is not None
              and (v := metric(s)) is not None and v > 0]
    if not values:
        return None
    return min(values) if lower_is_better else max(values)


def _failed_note(summary: Summary) -> str:
    return f" ({summary.failed} failed)" if summary.failed else ""


def _tpot(s: Summary) -> float | None:
    return s.tpot_ms.median or None


def _tput(s: Summary) -> float | None:
    return s.output_throughput or None


def _encoding(key: str) -> str:
    """How the system `key` stores its weights (a key of `roofs` in _batch1)."""
    if key.startswith("llama-server"):
        return "stored"
    if key.startswith("transformers"):
        return "float32"
    return next((q for q in ("int8", "int4") if q in key), "kept")


def _batch1(results: SuiteResults, roofs: Mapping[str, float]) -> list[str]:
    """`roofs`: batch-1 tok/s ceilings by weight encoding (stored in the GGUF, kept codes, float32, int8, int4)."""
    keys = _keys(results, "batch1")
    if not keys:
        return []
    cfg = results.config
    scenario = results.scenarios["batch1"]
    peers = [_best(results, "batch1", p, _tpot, lower_is_better=True) for p in PEERS]
    lines = [f"#### One stream: {len(scenario.requests)} requests one after another, {cfg.input_len}-token "
             f"prompts, {cfg.output_len} new tokens", "",
             "| system | TPOT p50 (ms) | tok/s (1000/TPOT) | % of its roofline | TTFT p50 (ms) | E2EL p50 (ms) "
             "| TPOT vs llama-server | TPOT vs transformers | other jobs (CPUs) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in keys:
        s = _run(results, "batch1", key)
        tok_s = 1000.0 / s.tpot_ms.median if s.tpot_ms.median else None
        roof = roofs[_encoding(key)]
        ratios = [_x(_ratio(s.tpot_ms.median, p)) for p in peers]
        lines.append(f"| {key}{_failed_note(s)} | {_f(s.tpot_ms.median)} | {_f(tok_s)} | "
                     f"{_f(100 * tok_s / roof if tok_s else None, 0)}% | {_f(s.ttft_ms.median)} | "
                     f"{_f(s.e2el_ms.median)} | {' | '.join(ratios)} | {_others(results, 'batch1', key)} |")
    lines += ["", "TPOT ratios: the row's TPOT / the peer's better TPOT (of its two runs); lower is better", ""]
    return lines


def _streams(results: SuiteResults) -> list[str]:
    keys = _keys(results, "streams")
    if not keys:
        return []
    cfg = results.config
    scenario = results.scenarios["streams"]
    peers = [_best(results, "streams", p, _tput, lower_is_better=False) for p in PEERS]
    lines = [f"#### {cfg.streams} concurrent streams: {len(scenario.requests)} requests due at once, "
             f"{cfg.input_len}-token prompts, {cfg.output_len} new tokens", "",
             "| system | output tok/s | req/s | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | ITL p90 (ms) "
             "| output tok/s vs llama-server | vs transformers | other jobs (CPUs) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in keys:
        s = _run(results, "streams", key)
        ratios = [_x(_ratio(s.output_throughput, p)) for p in peers]
        lines.append(f"| {key}{_failed_note(s)} | {_f(s.output_throughput)} | {_f(s.request_throughput, 2)} | "
                     f"{_f(s.ttft_ms.median, 0)} / {_f(s.ttft_ms.percentiles.get('p90'), 0)} | "
                     f"{_f(s.tpot_ms.median)} / {_f(s.tpot_ms.percentiles.get('p90'))} | "
                     f"{_f(s.itl_ms.percentiles.get('p90'))} | {' | '.join(ratios)} | "
                     f"{_others(results, 'streams', key)} |")
    lines += ["", "Throughput ratios: the row's output tok/s / the peer's better one (of its two runs); higher is "
              "better. transformers runs static batches, so its requests wait for a whole batch", ""]
    return lines


def prefix_cache_rows(results: SuiteResults) -> dict[str, tuple[float, float]]:
    """system -> (median cold TTFT, median cached TTFT) in ms."""
    scenario = results.scenarios.get("prefix_cache")
    rows = {}
    if scenario is None:
        return rows
    for system in scenario.systems:
        run = results.runs.get(("prefix_cache", system))
        if run is None:
            continue
        cold, cached = cold_and_cached(scenario.requests, run.records)
        if cold and cached:
            rows[system] = (percentile(cold, 50), percentile(cached, 50))
    return rows


def _prefix_cache(results: SuiteResults) -> list[str]:
    rows = prefix_cache_rows(results)
    if not rows:
        return []
    cfg = results.config
    lines = [f"#### Prefix cache: {cfg.prefix_trials} pairs of prompts sharing a {cfg.prefix_len}-token system "
             "prompt (+16 unique tokens), sent one at a time; the first of a pair is cold", "",
             "| system | cold TTFT p50 (ms) | cached TTFT p50 (ms) | cached / cold | cached prompt tokens reported |",
             "|---|---:|---:|---:|---:|"]
    for system, (cold, cached) in rows.items():
        s = _run(results, "prefix_cache", system)
        lines.append(f"| {system}{_failed_note(s) if s else ''} | {_f(cold)} | {_f(cached)} | {_x(cached / cold)} | "
                     f"{s.cached_tokens if s and s.cached_tokens is not None else '—'} |")
    return lines + [""]


def _shared_prefix(results: SuiteResults) -> list[str]:
    scenario = results.scenarios.get("shared_prefix")
    if scenario is None or not any(("shared_prefix", s) in results.runs for s in scenario.systems):
        return []
    cfg = results.config
    lines = [f"#### Routing, shared-prefix workload: {cfg.shared_groups} system prompts of "
             f"{cfg.shared_prefix_len} tokens x {cfg.shared_per_group} users ({cfg.shared_suffix_len} tokens), "
             f"{cfg.shared_output_len} new tokens, Poisson {cfg.shared_rate:g} req/s, 2 prefill + 1 decode, "
             f"{cfg.shared_prefill_kv_cache_memory / 2**20:.0f} MiB of KV cache per prefill worker", "",
             "| system | TTFT p50 / p90 / p99 (ms) | TPOT p50 (ms) | output tok/s | cached prompt tokens "
             "| prompt tokens computed | other jobs (CPUs) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for system in scenario.systems:
        s = _run(results, "shared_prefix", system)
        if s is None:
            continue
        p = s.ttft_ms.percentiles
        lines.append(f"| {system}{_failed_note(s)} | {_f(p.get('p50'), 0)} / {_f(p.get('p90'), 0)} / "
                     f"{_f(p.get('p99'), 0)} | {_f(s.tpot_ms.median)} | {_f(s.output_throughput)} | "
                     f"{s.cached_tokens if s.cached_tokens is not None else '—'} | "
                     f"{s.total_input_tokens - s.cached_tokens if s.cached_tokens is not None else '—'} "
                     f"of {s.total_input_tokens} | {_others(results, 'shared_prefix', system)} |")
    return lines + [""]


def _sweep(results: SuiteResults) -> list[str]:
    rows = [(system, run) for (scenario, system), run in results.runs.items() if scenario.startswith("sweep@")]
    if not rows:
        return []
    lines = [f"#### Throughput vs request rate ({results.config.sweep_requests} requests, Poisson, at most "
             f"{results.config.streams} in flight; the 'inf' point of the plot is the streams table)", "",
             "| system | rate (req/s) | output tok/s | TTFT p90 (ms) | TPOT p50 (ms) | other jobs (CPUs) |",
             "|---|---:|---:|---:|---:|---:|"]
    for system, run in sorted(rows, key=lambda r: (r[0], r[1].config.request_rate)):
        s = run.summary
        lines.append(f"| {system}{_failed_note(s)} | {run.config.request_rate:g} | {_f(s.output_throughput)} | "
                     f"{_f(s.ttft_ms.percentiles.get('p90'), 0)} | {_f(s.tpot_ms.median)} | "
                     f"{_others(results, run.label.split()[-1], system)} |")
    return lines + [""]


GOODPUT_GOAL = 1.5
"""Issue 16: 1P+1D goodput >= 1.5x colocated goodput at the same cores."""
STREAMS_GOAL = 4.0
"""Issue 16: 32-stream output tokens/s >= 4x llama-server's."""
BATCH1_GOAL = 1.0
"""Issue 16: int4 batch-1 TPOT <= 1.0x llama-server's (the systems decoding the GGUF's int4 codes)."""
ONE_P_ONE_D_TPOT_GOAL = 1.1
"""Issue 16: 1P+1D batch-1 TPOT within 1.1x of the one-process engine with the same decode threads (in the
suite: pdserve-1p1d-lend, whose decode steps run on both workers' cores, against pdserve-engine on them)."""
INT4_SYSTEMS = ("pdserve-engine", "pdserve-engine-int4", "pdserve-engine-native", "pdserve-engine-kv-bf16")
GOODPUT_DISAGGREGATED = ("pdserve-1p1d-pinned", "pdserve-1p1d-lend")
"""The 1P+1D systems the goodput goal compares with pdserve-colocated, each on its own row."""
SLO_SCALES = (2.0, 3.0, 5.0)
"""SLO scales of the sensitivity table (the same records judged by tighter and looser SLOs)."""


def goodput_rates(results: SuiteResults) -> dict[str, dict[float, RunResult]]:
    """system -> rate -> its goodput run, in the order the systems ran."""
    rows: dict[str, dict[float, RunResult]] = {}
    for (scenario, system), run in results.runs.items():
        if scenario.startswith("goodput@"):
            rows.setdefault(system, {})[run.config.request_rate] = run
    return rows


def reference_idle(results: SuiteResults) -> goodput.IdleFigures | None:
    """The idle figures the SLOs come from: those an earlier run's SLOs were set from (goodput_reference_idle),
    else the reference system's idle probe in this run; None without either."""
    cfg = results.config
    if cfg.goodput_reference_idle is not None:
        return cfg.goodput_reference_idle
    run = results.runs.get(("goodput-idle", cfg.goodput_slo_reference))
    if run is None:
        return None
    try:
        return goodput.idle_figures(run.records)
    except ValueError:
        return None


def goodput_slos(results: SuiteResults, ttft_scale: float | None = None,
                 tpot_scale: float | None = None) -> goodput.GoodputSlos | None:
    """The SLOs from the reference idle figures (at the configured scales unless given); None without them."""
    cfg = results.config
    idle = reference_idle(results)
    if idle is None:
        return None
    return goodput.slos_from_idle(idle, cfg.goodput_ttft_scale if ttft_scale is None else ttft_scale,
                                  cfg.goodput_tpot_scale if tpot_scale is None else tpot_scale)


def goodput_summary(results: SuiteResults) -> dict | None:
    """The goodput figures as plain data (results.json, the plot, the report); None before the SLOs exist."""
    slos = goodput_slos(results)
    if slos is None:
        return None
    idle = {}
    for (scenario, system), run in results.runs.items():
        if scenario == "goodput-idle":
            try:
                idle[system] = dataclasses.asdict(goodput.idle_figures(run.records))
            except ValueError:
                continue
    systems: dict[str, dict] = {}
    for system, by_rate in goodput_rates(results).items():
        points = []
        for rate, run in sorted(by_rate.items()):
            points.append({"rate": rate, "goodput": goodput.goodput(run.records, run.duration_s, slos),
                           "attainment": goodput.attainment(run.records, slos), "sent": len(run.records),
                           "failed": run.summary.failed, "others_cores": run.meta.get("others_cores")})
        systems[system] = {"points": points, "max_rate_at_90": goodput.max_rate_at(
            {p["rate"]: p["attainment"] for p in points})}
    cfg = results.config
    reference = cfg.goodput_slo_reference + (f" (in {cfg.goodput_reference_source})"
                                             if cfg.goodput_reference_idle is not None else "")
    return {"reference": reference, "reference_idle": dataclasses.asdict(reference_idle(results)),
            "slos": dataclasses.asdict(slos), "idle": idle, "systems": systems}


def _class_p90(records: Sequence[RequestRecord], kind: str) -> float | None:
    values = [r.ttft_s * 1e3 for r in records if r.success and r.chunk_times_s and prompt_class(r.request_id) == kind]
    return percentile(values, 90) if values else None


def _goodput(results: SuiteResults) -> list[str]:
    summary = goodput_summary(results)
    by_rate = goodput_rates(results)
    if summary is None or not by_rate:
        return []
    cfg = results.config
    slos = summary["slos"]
    low, high = cfg.goodput_long_len
    ref = summary["reference_idle"]
    k_ttft, k_tpot = cfg.goodput_ttft_scale, cfg.goodput_tpot_scale
    lines = [f"#### Goodput: disaggregated vs colocated ({cfg.goodput_requests} requests per rate, "
             f"{100 * cfg.goodput_long_fraction:.0f}% long prompts of {low}-{high} tokens "
             f"({cfg.goodput_long_output_len} new tokens) among chat turns of about {cfg.goodput_short_len} tokens "
             f"({cfg.goodput_short_output_len} new tokens), Poisson arrivals)", "",
             f"SLOs from {summary['reference']}'s idle probe (one request at a time): TTFT SLO = {k_ttft:g} x idle "
             f"TTFT of the class (long, at {high} tokens: {k_ttft:g} x {_f(ref['ttft_ms'][LONG], 0)} = "
             f"{_f(slos['ttft_ms'][LONG], 0)} ms; short: {k_ttft:g} x {_f(ref['ttft_ms'][SHORT], 0)} = "
             f"{_f(slos['ttft_ms'][SHORT], 0)} ms), TPOT SLO = {k_tpot:g} x idle TPOT {_f(ref['tpot_ms'])} = "
             f"{_f(slos['tpot_ms'])} ms. A request counts when it meets both; goodput = those per second, "
             "attainment = their share of the requests sent", "",
             "| system | idle TTFT long / short (ms) | idle TPOT (ms) |", "|---|---:|---:|"]
    for system, idle in summary["idle"].items():
        lines.append(f"| {system} | {_f(idle['ttft_ms'][LONG], 0)} / {_f(idle['ttft_ms'][SHORT], 0)} | "
                     f"{_f(idle['tpot_ms'])} |")
    lines += ["", "| system | rate (req/s) | goodput (req/s) | SLO attainment | TTFT p90 long / short (ms) "
              "| TPOT p50 / p90 (ms) | other jobs (CPUs) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for system, data in summary["systems"].items():
        for point in data["points"]:
            run = by_rate[system][point["rate"]]
            s = run.summary
            others = point["others_cores"]
            lines.append(f"| {system}{_failed_note(s)} | {point['rate']:g} | {_f(point['goodput'], 3)} | "
                         f"{100 * point['attainment']:.0f}% | {_f(_class_p90(run.records, LONG), 0)} / "
                         f"{_f(_class_p90(run.records, SHORT), 0)} | {_f(s.tpot_ms.median)} / "
                         f"{_f(s.tpot_ms.percentiles.get('p90'))} | {'—' if others is None else f'{others:.2f}'} |")
    lines += ["", "Highest rate (req/s) at 90% SLO attainment, interpolated between measured rates ('<' below the "
              "lowest, '>=' when even the highest attains it), at the configured SLOs and with both scales set "
              "tighter or looser (the same records):", "",
              "| system | at the configured SLOs | " + " | ".join(f"both scales {k:g}x" for k in SLO_SCALES) + " |",
              "|---|" + "---:|" * (len(SLO_SCALES) + 1)]
    for system in summary["systems"]:
        cells = [_max_rate_cell(by_rate[system], goodput_slos(results))]
        cells += [_max_rate_cell(by_rate[system], goodput_slos(results, k, k)) for k in SLO_SCALES]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return lines + [""] + _ttft_breakdown(results, by_rate)


def _ttft_breakdown(results: SuiteResults, by_rate: Mapping[str, Mapping[float, RunResult]]) -> list[str]:
    """Where the long prompts' TTFT went on pdserve (the gateway's Timings), median per system and rate."""
    rows = []
    for system, runs in by_rate.items():
        for rate, run in sorted(runs.items()):
            timed = [r.server_timings for r in run.records if r.server_timings and r.success
                     and prompt_class(r.request_id) == LONG]
            if not timed:
                continue
            med = {key: percentile([float(t[key]) for t in timed], 50)
                   for key in ("queue_ms", "prefill_ms", "transfer_ms", "ttft_ms")}
            transports = "/".join(sorted({str(t["transport"]) for t in timed}))
            rows.append(f"| {system} | {rate:g} | {len(timed)} | {_f(med['queue_ms'], 0)} | {_f(med['prefill_ms'], 0)} "
                        f"| {_f(med['transfer_ms'], 0)} ({transports}) | {_f(med['ttft_ms'], 0)} |")
    if not rows:
        return []
    return ["Where the long prompts' TTFT went on pdserve (the gateway's timings, medians over the long requests; "
            "queue: arrival until a worker started on it, prefill: computing it, transfer: moving its KV to the "
            "decode worker):", "",
            "| system | rate (req/s) | long requests | queue (ms) | prefill (ms) | transfer (ms) | TTFT (ms) |",
            "|---|---:|---:|---:|---:|---:|---:|", *rows, ""]


def _max_rate_cell(runs: Mapping[float, RunResult], slos: goodput.GoodputSlos | None) -> str:
    if slos is None or not runs:
        return "—"
    points = {rate: goodput.attainment(run.records, slos) for rate, run in runs.items()}
    value = goodput.max_rate_at(points)
    if value is None:
        return f"< {min(points):g}"
    return f">= {value:g}" if value == max(points) else f"{value:.3g}"


_BOUND_NOTES = {"lower": " (1P+1D attains 90% at its highest measured rate: at least this; raise --goodput-rates)",
                "upper": " (colocated attains 90% at its highest measured rate: at most this; raise --goodput-rates)",
                "unknown": " (both attain 90% at their highest measured rates: raise --goodput-rates)"}


def goodput_goal(results: SuiteResults, disaggregated: str = GOODPUT_DISAGGREGATED[0]
                 ) -> tuple[float, str, str | None] | None:
    """1P+1D (`disaggregated`) / colocated, what was compared (with why the ratio is a bound, when it is one), and
    which bound it is: "lower" (the ratio is at least this), "upper" (at most this), "unknown" (either), None (a
    measured ratio). None without both systems. Compared, in this order:
    - both attain 90% at some measured rate: their highest rates at 90% attainment (DistServe's goodput). Lower
      when 1P+1D still attains 90% at its highest measured rate (its capacity lies above), upper when colocated
      does and 1P+1D does not, unknown when both do;
    - one attains 90% somewhere and the other not even at its lowest measured rate, whose highest rate at 90% is
      then below that rate: the one's highest rate against the other's lowest rate, a lower bound (1P+1D
      attains) or an upper one (colocated attains);
    - neither: each one's peak goodput, the most requests per second it served within its SLOs at any rate both
      ran (at the highest rate both may have collapsed: a figure of overload, not of capacity)."""
    summary = goodput_summary(results)
    if summary is None:
        return None
    disagg, coloc = (summary["systems"].get(name) for name in (disaggregated, "pdserve-colocated"))
    if disagg is None or coloc is None:
        return None
    d_max, c_max = disagg["max_rate_at_90"], coloc["max_rate_at_90"]
    basis = "highest rate at 90% SLO attainment"
    if d_max and c_max:
        d_open, c_open = (s["max_rate_at_90"] >= max(p["rate"] for p in s["points"]) for s in (disagg, coloc))
        bound = {(True, False): "lower", (False, True): "upper", (True, True): "unknown"}.get((d_open, c_open))
        return d_max / c_max, basis + _BOUND_NOTES.get(bound, ""), bound
    if d_max:
        low = min(p["rate"] for p in coloc["points"])
        return d_max / low, (f"{basis} (colocated misses 90% already at its lowest measured rate, {low:g} req/s: "
                             "at least this; add lower --goodput-rates)"), "lower"
    if c_max:
        low = min(p["rate"] for p in disagg["points"])
        return low / c_max, (f"{basis} (1P+1D misses 90% already at its lowest measured rate, {low:g} req/s: "
                             "at most this; add lower --goodput-rates)"), "upper"
    common = {p["rate"] for p in disagg["points"]} & {p["rate"] for p in coloc["points"]}
    if not common:
        return None
    peaks = [max((p for p in d["points"] if p["rate"] in common), key=lambda p: p["goodput"])
             for d in (disagg, coloc)]
    ratio = _ratio(peaks[0]["goodput"], peaks[1]["goodput"])
    return None if ratio is None else (ratio, f"peak goodput over the measured rates (1P+1D at {peaks[0]['rate']:g} "
                                       f"req/s, colocated at {peaks[1]['rate']:g}; neither attains 90% at a "
                                       "measured rate)", None)


def goal_met(ratio: float, target: float, bound: str | None) -> bool | None:
    """Whether ratio >= target holds, given which bound the ratio is (goodput_goal); None when the bound leaves it
    open."""
    if bound is None:
        return ratio >= target
    if bound == "lower" and ratio >= target:
        return True
    if bound == "upper" and ratio < target:
        return False
    return None


def _goals(results: SuiteResults) -> list[str]:
    lines = ["#### Goals of the issue", "", "| goal | system | measured | target | met |", "|---|---|---:|---:|:-:|"]

    def row(goal: str, system: str, value: float | None, target: str, met: bool | None) -> None:
        verdict = "—" if met is None else ("yes" if met else "**no**")
        lines.append(f"| {goal} | {system} | {_x(value)} | {target} | {verdict} |")

    llama_streams = _best(results, "streams", "llama-server", _tput, lower_is_better=False)
    llama_b1 = _best(results, "batch1", "llama-server", _tpot, lower_is_better=True)
    for system in PDSERVE:
        s = _run(results, "streams", system)
        if s is not None and llama_streams is not None:
            r = _ratio(s.output_throughput, llama_streams)
            row(f"{results.config.streams}-stream output tok/s vs llama-server", system, r, f">= {STREAMS_GOAL:g}x",
                r is not None and r >= STREAMS_GOAL)
    for system in PDSERVE:
        s = _run(results, "batch1", system)
        if s is not None and llama_b1 is not None:
            r = _ratio(s.tpot_ms.median, llama_b1)
            if system in INT4_SYSTEMS:
                row("batch-1 TPOT vs llama-server (int4)", system, r, f"<= {BATCH1_GOAL:g}x",
                    r is not None and r <= BATCH1_GOAL)
            else:
                row("batch-1 TPOT vs llama-server", system, r, "—", None)
    engine_b1, lend_b1, colocated_b1 = (_run(results, "batch1", system) for system in
                                        ("pdserve-engine", "pdserve-1p1d-lend", "pdserve-colocated"))
    if lend_b1 is not None and engine_b1 is not None:
        r = _ratio(lend_b1.tpot_ms.median, engine_b1.tpot_ms.median)
        row("batch-1 TPOT, 1P+1D / the one-process engine on the same cores", "pdserve-1p1d-lend", r,
            f"<= {ONE_P_ONE_D_TPOT_GOAL:g}x", r is not None and r <= ONE_P_ONE_D_TPOT_GOAL)
    if colocated_b1 is not None and engine_b1 is not None:
        row("batch-1 TPOT, colocated through its gateway / the one-process engine (serving's share)",
            "pdserve-colocated", _ratio(colocated_b1.tpot_ms.median, engine_b1.tpot_ms.median), "—", None)
    if lend_b1 is not None and colocated_b1 is not None:
        row("batch-1 TPOT, 1P+1D / colocated, both through a gateway (disaggregation's share)", "pdserve-1p1d-lend",
            _ratio(lend_b1.tpot_ms.median, colocated_b1.tpot_ms.median), "—", None)
    for system, (cold, cached) in prefix_cache_rows(results).items():
        if system.startswith("pdserve"):
            row(f"cached {results.config.prefix_len}-token prefix TTFT / cold TTFT", system, cached / cold,
                "<= 0.2x", cached / cold <= 0.2)
    prefix = _run(results, "shared_prefix", "pdserve-2p1d-prefix")
    rr = _run(results, "shared_prefix", "pdserve-2p1d-rr")
    if prefix is not None and rr is not None:
        r = _ratio(prefix.ttft_ms.percentiles.get("p90"), rr.ttft_ms.percentiles.get("p90"))
        row("shared-prefix p90 TTFT, prefix-aware / round-robin", "pdserve-2p1d", r, "well below 1x (< 0.8x)",
            r is not None and r < 0.8)
    for system in GOODPUT_DISAGGREGATED:
        goal = goodput_goal(results, system)
        if goal is not None:
            ratio, basis, bound = goal
            row(f"1P+1D / colocated goodput, same cores: {basis}", system, ratio, f">= {GOODPUT_GOAL:g}x",
                goal_met(ratio, GOODPUT_GOAL, bound))
    return lines + [""]
