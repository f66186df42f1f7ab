"""`pdserve bench`: load-test one server, or run the side-by-side CPU suite.

    pdserve bench --target HOST:PORT | --openai-url URL  [--workload random|shared-prefix|multi-turn]
                  [--num-prompts N] [--input-len L] [--output-len L] [--request-rate R|inf]
                  [--max-concurrency C] [--seed S] [--goodput ttft:MS tpot:MS] [--out DIR]
    pdserve bench --suite cpu [--llama-server PATH] [--threads 2] [--out DIR] [--systems S ...] [--only FAMILY ...]
                  [--goodput-rates R ...] [--goodput-long-len LOW-HIGH] [--goodput-requests N] ...

Flags (and the one environment variable, PDSERVE_LLAMA_SERVER, the default of --llama-server) are read here
only. Importing this module imports nothing but argparse; the benchmark modules load when a command runs.
`pdserve.cli` wires it in with `add_parser(subparsers)` and calls `run(args)`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import sys
import time
import urllib.parse
from pathlib import Path

WORKLOADS = ("random", "shared-prefix", "multi-turn")


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _positive_float(text: str) -> float:
    """A number > 0 (a request rate may be inf)."""
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _finite_positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _positive_float(text)
    if value == math.inf:
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def _fraction(text: str) -> float:
    """A number in [0, 1]."""
    value = _float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _int_at_least(minimum: int):
    """An argparse type: an integer >= `minimum`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


_positive, _non_negative = _int_at_least(1), _int_at_least(0)


def _http_url(text: str) -> str:
    """An http(s)://HOST[:PORT][/PATH] URL."""
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port  # ValueError on a port that is not a number in range
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a URL: {text!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise argparse.ArgumentTypeError(f"expected http(s)://HOST[:PORT], got {text!r}")
    return text


def _length_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    try:
        pair = (int(low), int(high if sep else low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token range: {text!r} (LOW-HIGH, e.g. 1024-4096)") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"need 1 <= LOW <= HIGH, got {text!r}")
    return pair


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to `subparsers` and return its parser."""
    p = subparsers.add_parser(
        "bench", help="benchmark a pdserve gateway or an OpenAI-compatible server; --suite cpu compares peers",
        description=__doc__.split("\n\n")[0] + " Metrics follow vLLM's benchmark_serving definitions.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    target = p.add_argument_group("what to benchmark (one of)")
    what = target.add_mutually_exclusive_group(required=True)
    what.add_argument("--target", metavar="HOST:PORT", help="a pdserve gateway (gRPC)")
    what.add_argument("--openai-url", type=_http_url, metavar="URL", help="an OpenAI-compatible server, e.g. "
                      "http://127.0.0.1:8080 (streams /v1/completions with token-id prompts)")
    what.add_argument("--suite", choices=("cpu",), help="the side-by-side suite: llama-server, transformers and "
                      "pdserve in three shapes on this machine")
    target.add_argument("--served-model", default="default", help="`model` field of OpenAI requests")
    target.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                        help="extra fields of every OpenAI request body, e.g. '{\"cache_prompt\": true}'")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random")
    w.add_argument("--num-prompts", type=_positive, default=64,
                   help="requests (shared-prefix: in all; multi-turn: conversations)")
    w.add_argument("--input-len", type=_positive, default=128, help="prompt tokens, chat template included "
                   "(shared-prefix: the unique user part; multi-turn: each user message)")
    w.add_argument("--output-len", type=_positive, default=64, help="tokens generated per request (EOS ignored)")
    w.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [L x (1 - r), L x (1 + r)]")
    w.add_argument("--prefix-len", type=_positive, default=512, help="shared-prefix: system prompt tokens")
    w.add_argument("--num-groups", type=_positive, default=4, help="shared-prefix: distinct system prompts")
    w.add_argument("--num-turns", type=_positive, default=4, help="multi-turn: turns per conversation")
    w.add_argument("--model", default="default",
                   help="model whose tokenizer and chat template frame the prompts ('default': SmolLM2-135M)")
    w.add_argument("--no-chat-template", action="store_true", help="send bare random token ids")
    w.add_argument("--seed", type=int, default=0)

    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=_positive_float, default=math.inf,
                   help="Poisson arrivals per second; inf sends all at once")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    a.add_argument("--max-concurrency", type=_positive, default=None, help="most requests in flight")
    a.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")

    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    o.add_argument("--out", type=Path, default=None, help="results directory (default bench/results/<date>)")
    o.add_argument("--label", default=None, help="name of the run in results and plots")
    o.add_argument("--no-progress", action="store_true")

    s = p.add_argument_group("suite")
    s.add_argument("--llama-server", default=os.environ.get("PDSERVE_LLAMA_SERVER"), metavar="PATH",
                   help="llama-server binary (env PDSERVE_LLAMA_SERVER; default: what "
                   "bench/build_llama_server.sh built in bench/peers)")
    s.add_argument("--threads", type=_positive, default=2, help="CPU threads given to every system")
    s.add_argument("--systems", nargs="+", default=None, metavar="SYSTEM",
                   help="run only these systems (default: all)")
    s.add_argument("--only", nargs="+", default=[], metavar="FAMILY",
                   help="run only these scenario families: batch1 streams prefix_cache shared_prefix sweep goodput "
                   "(default: all); systems none of them uses are not started")
    g = p.add_argument_group("suite: goodput, disaggregated vs colocated (defaults: pdserve.bench.suite.SuiteConfig)")
    g.add_argument("--goodput-rates", nargs="+", type=_finite_positive_float, default=None, metavar="R",
                   help="Poisson rates (req/s); default 0.1 0.2 0.3 0.4")
    g.add_argument("--goodput-requests", type=_positive, default=None, metavar="N", help="requests per rate (24)")
    g.add_argument("--goodput-long-len", type=_length_range, default=None, metavar="LOW-HIGH",
                   help="long prompts' length range in tokens (1024-4096, the issue's); a slow or busy machine may "
                   "scale it down, e.g. 256-1024, and the report says which range ran")
    g.add_argument("--goodput-long-fraction", type=_fraction, default=None, metavar="F", help="share of long prompts "
                   "(0.25)")
    g.add_argument("--goodput-ttft-scale", type=_finite_positive_float, default=None, metavar="K",
                   help="TTFT SLO = K x the idle TTFT of the prompt's class (3)")
    g.add_argument("--goodput-tpot-scale", type=_finite_positive_float, default=None, metavar="K",
                   help="TPOT SLO = K x idle TPOT (3)")
    g.add_argument("--goodput-batched-tokens", type=_positive, default=None, metavar="N",
                   help="pdserve-colocated's chunked-prefill budget per step (default: the engine's)")
    g.add_argument("--goodput-long-prefill-token-threshold", type=_positive, default=None, metavar="N",
                   help="pdserve-colocated-capped's per-step cap on one prompt's prefill tokens (256)")
    g.add_argument("--goodput-slos-from", type=Path, default=None, metavar="RESULTS_JSON",
                   help="judge by the SLOs of an earlier run's results.json (same machine and flags) instead of "
                   "running pdserve-colocated's idle probe again, e.g. to add llama-server to a comparison")
    g.add_argument("--goodput-local-prefill-threshold", type=_non_negative, default=None, metavar="N",
                   help="pdserve-1p1d-pinned's and -lend's gateway --local-prefill-threshold (256: short turns "
                   "prefill on the decode worker)")
    g.add_argument("--goodput-lend-batched-tokens", type=_positive, default=None, metavar="N",
                   help="pdserve-1p1d-lend's --max-num-batched-tokens: bounds a prefill step on the decode worker's "
                   "borrowed cores (256)")
    g.add_argument("--goodput-idle-offload-min-tokens", type=_non_negative, default=None, metavar="N",
                   help="pdserve-1p1d-pinned's and -lend's gateway --idle-offload-min-tokens (default: the "
                   "gateway's; 0: short turns always prefill on the decode worker)")
    return p


def run(args: argparse.Namespace) -> int:
    """Run `pdserve bench`; returns the exit code (0 ok, 1 a run failed, 2 bad flags)."""
    if args.suite:
        return _run_suite(args)
    return _run_one(args)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _run_suite(args: argparse.Namespace) -> int:
    import logging

    from pdserve.bench import suite
    from pdserve.bench.peers import PeerError, find_llama_server

    systems = tuple(args.systems or suite.SYSTEMS)
    llama_server = None
    if suite.LLAMA_SERVER in systems:
        try:
            llama_server = find_llama_server(args.llama_server)
        except PeerError as exc:
            _err(f"pdserve bench: error: {exc} (or leave it out with --systems)")
            return 2
    try:
        goodput = {name: value for name, value in (
            ("goodput_rates", tuple(args.goodput_rates) if args.goodput_rates else None),
            ("goodput_requests", args.goodput_requests), ("goodput_long_len", args.goodput_long_len),
            ("goodput_long_fraction", args.goodput_long_fraction), ("goodput_ttft_scale", args.goodput_ttft_scale),
            ("goodput_tpot_scale", args.goodput_tpot_scale), ("goodput_batched_tokens", args.goodput_batched_tokens),
            ("goodput_local_prefill_threshold", args.goodput_local_prefill_threshold),
            ("goodput_idle_offload_min_tokens", args.goodput_idle_offload_min_tokens),
            ("goodput_lend_batched_tokens", args.goodput_lend_batched_tokens),
            ("goodput_long_prefill_token_threshold", args.goodput_long_prefill_token_threshold)) if value is not None}
        if args.goodput_slos_from is not None:
            goodput.update(goodput_reference_idle=_reference_idle(args.goodput_slos_from),
                           goodput_reference_source=str(args.goodput_slos_from))
        config = suite.SuiteConfig(out_dir=args.out or suite.default_out_dir(), llama_server=llama_server,
                                   model=args.model, threads=args.threads, systems=systems, seed=args.seed,
                                   progress=not args.no_progress, only=tuple(args.only), **goodput)
    except ValueError as exc:
        _err(f"pdserve bench: error: {exc}")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _raise_exit)  # unwind, so that every server the suite started is stopped
    results = suite.run_suite(config)
    report = config.out_dir / "report.md"
    print(report.read_text())
    _err(f"pdserve bench: wrote {config.out_dir}/results.json, report.md and plots "
         f"({results.meta['suite_wall_s'] / 60:.1f} min)")
    return 1 if results.errors else 0


def _reference_idle(path: Path):
    """The reference idle figures of an earlier suite run (ValueError saying what is missing)."""
    from pdserve.bench.goodput import IdleFigures

    try:
        idle = json.loads(path.read_text())["meta"]["goodput"]["reference_idle"]
        return IdleFigures(dict(idle["ttft_ms"]), float(idle["tpot_ms"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--goodput-slos-from {path}: no goodput reference figures there ({exc!r})") from None


def _workload(args: argparse.Namespace):
    from pdserve.bench import workloads

    kw = {"seed": args.seed}
    if not args.no_chat_template:
        from engine.loader import load_model
        from engine.model_fetch import resolve_model_path

        tokenizer = load_model(resolve_model_path(args.model), with_weights=False).tokenizer
        kw["fmt"] = workloads.TemplateFormat(
            lambda messages: tokenizer.apply_chat_template(messages, add_generation_prompt=True),
            lambda text: tokenizer.encode(text, add_special_tokens=False))
        kw["token_range"] = (max(tokenizer.all_special_ids, default=-1) + 1, tokenizer.vocab_size)
    if args.workload == "random":
        return workloads.random_workload(args.num_prompts, args.input_len, args.output_len,
                                         range_ratio=args.range_ratio, **kw)
    if args.workload == "shared-prefix":
        per_group = max(1, args.num_prompts // args.num_groups)
        return workloads.shared_prefix_workload(args.num_groups, per_group, args.prefix_len, args.input_len,
                                                args.output_len, **kw).requests
    return workloads.multi_turn_workload(args.num_prompts, args.num_turns, args.input_len, args.output_len, **kw)


def _run_one(args: argparse.Namespace) -> int:
    from pdserve.bench import plots
    from pdserve.bench.backends import OpenAIBackend, PdserveBackend
    from pdserve.bench.metrics import parse_slos
    from pdserve.bench.runner import RunConfig, WarmupFailed, run, write_json

    try:
        slos = parse_slos(args.goodput)
        config = RunConfig(request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                           burstiness=args.burstiness, seed=args.seed, warmup=not args.no_warmup,
                           progress=not args.no_progress)
        requests = _workload(args)
    except ValueError as exc:
        _err(f"pdserve bench: error: {exc}")
        return 2
    if args.target:
        backend = PdserveBackend(args.target)
    else:
        backend = OpenAIBackend(args.openai_url, model=args.served_model, extra_body=args.extra_body)
    label = args.label or f"{args.workload}-{'inf' if math.isinf(args.request_rate) else args.request_rate}"
    try:
        result = run(backend, requests, config, label=label, slos_ms=slos)
    except WarmupFailed as exc:
        _err(f"pdserve bench: error: {exc}")
        return 1
    result.meta = {"target": args.target or args.openai_url, "workload": args.workload,
                   "argv": sys.argv[1:], "date": datetime.datetime.now().isoformat(timespec="seconds")}
    print(format_summary(result))
    out = args.out or Path("bench/results") / datetime.date.today().isoformat()
    stem = f"bench-{label}-{time.strftime('%H%M%S')}"
    write_json(out / f"{stem}.json", [result])
    plots.plot_latency_cdfs({label: result.records}, out / f"{stem}.png", label)
    _err(f"pdserve bench: wrote {out / stem}.json and .png")
    if result.summary.failed:
        errors = sorted({r.error for r in result.records if r.error})
        _err(f"pdserve bench: {result.summary.failed} request(s) failed: " + "; ".join(errors[:3]))
        return 1
    return 0


def format_summary(result) -> str:
    """The run's metrics as a text block like vLLM's benchmark_serving prints."""
    s = result.summary
    lines = [f"{' Serving Benchmark Result ':=^60}",
             f"{'Successful requests:':<40}{s.completed:<10}",
             f"{'Failed requests:':<40}{s.failed:<10}",
             f"{'Benchmark duration (s):':<40}{s.duration_s:<10.2f}",
             f"{'Total input tokens:':<40}{s.total_input_tokens:<10}",
             f"{'Total generated tokens:':<40}{s.total_output_tokens:<10}",
             f"{'Request throughput (req/s):':<40}{s.request_throughput:<10.2f}"]
    if s.goodput is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{s.goodput:<10.2f}")
    lines += [f"{'Output token throughput (tok/s):':<40}{s.output_throughput:<10.2f}",
              f"{'Total token throughput (tok/s):':<40}{s.total_token_throughput:<10.2f}"]
    if s.cached_tokens is not None:
        lines.append(f"{'Cached prompt tokens:':<40}{s.cached_tokens:<10}")
    for name, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                        ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        stats = getattr(s, name)
        key = name.split("_")[0].upper()
        lines += [f"{title:-^60}", f"{f'Mean {key} (ms):':<40}{stats.mean:<10.2f}",
                  f"{f'Median {key} (ms):':<40}{stats.median:<10.2f}"]
        lines += [f"{f'P{q[1:]} {key} (ms):':<40}{v:<10.2f}" for q, v in stats.percentiles.items()]
    lines.append("=" * 60)
    return "\n".join(lines)
