"""The `pdserve` argument parser and the mapping of its flags onto the config dataclasses.

A config flag's argparse `dest` is the dataclass field's name and its default is the field's default, so an
omitted flag leaves the dataclass default and `build_config` maps a namespace onto a config field by field.
Flag names are the field names with dashes, except the few in `_FLAG_NAMES`. `engine_flags` is the inverse
for the engine (the launcher uses it to start workers with the same engine settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from engine.config import CPU_MATMULS, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from gateway.config import GatewayConfig
from gateway.tool_parsers import PARSERS as TOOL_CALL_PARSERS
from decode_worker.config import VERIFY_KV_MODES, DecodeWorkerConfig
from pdserve.affinity import allowed_cpus, check_cpus, format_cpu_list, parse_cpu_list
from pdserve.cluster_config import LocalClusterConfig
from prefill_worker.config import CODECS, TRANSPORTS, PrefillWorkerConfig

C = TypeVar("C")

DEFAULT_TARGET = "127.0.0.1:50051"
API_KEY_ENV = "PDSERVE_API_KEY"
"""Environment variable `generate` and `chat` take the API key from when --api-key is not given."""
REDIS_URL_ENV = "PDSERVE_REDIS_URL"
"""Environment variable the gateway, the workers and `up` take the Redis URL from when --redis-url is not given
(a password in a URL on the command line is readable by every local user; the environment is not)."""
_FLAG_NAMES = {"num_threads": "--threads", "enable_prefix_caching": "--no-prefix-caching",
               "drain_timeout_s": "--drain-timeout", "worker_ttl_s": "--worker-ttl", "num_prefill": "--prefill",
               "num_decode": "--decode", "num_cpus": "--cpus", "start_timeout_s": "--start-timeout",
               "stop_timeout_s": "--stop-timeout", "queue_timeout_s": "--queue-timeout",
               "token_timeout_s": "--token-timeout",
               "tensor_parallel_timeout_s": "--tensor-parallel-timeout"}
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
GATEWAY_TUNING = ("max_inflight", "max_queued", "queue_timeout_s", "token_timeout_s", "max_request_bytes",
                  "local_prefill_threshold", "idle_offload_min_tokens", "lease_ms", "prefill_attempts",
                  "max_prefill_load", "routing", "drain_timeout_s", "served_model_name", "tool_call_parser")
"""GatewayConfig fields `pdserve up` passes through to its gateway."""


class UsageError(Exception):
    """A flag value the configs reject; the message names the flag and the field."""


def flag_for(field_name: str) -> str:
    """The command-line flag of a config field."""
    return _FLAG_NAMES.get(field_name, "--" + field_name.replace("_", "-"))


def parse_bytes(text: str) -> int:
    """A byte count: plain ("536870912") or with a binary unit ("512M", "512MiB", "2g", "1.5G")."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 536870912, 512M, 2G)")
    return int(float(match[1]) * _UNITS[match[2].lower()])


def _cpu_list(text: str) -> tuple[int, ...]:
    try:
        return parse_cpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers: "1,2,4,8" -> (1, 2, 4, 8)."""
    if not re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", text):
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r} (e.g. 1,2,4,8)")
    return tuple(int(part) for part in text.split(","))


def _default(cls: type, name: str) -> Any:
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _arg(group: Any, cls: type | None, name: str, help: str, **kwargs: Any) -> argparse.Action:
    """A flag for field `name` of `cls`, defaulting to the field's default (unless `default` is given)."""
    if "default" not in kwargs:
        kwargs["default"] = _default(cls, name) if cls is not None else None
    default = kwargs["default"]
    flag = flag_for(name)
    if kwargs.get("action") is None:
        if default is not None and default != ():
            help = f"{help} (default: {default})"
        if "choices" not in kwargs:
            bytes_flag = kwargs.get("type") is parse_bytes
            kwargs.setdefault("metavar", "BYTES" if bytes_flag else flag.lstrip("-").replace("-", "_").upper())
    return group.add_argument(flag, dest=name, help=help, **kwargs)


def build_config(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """`cls` from the namespace's attributes named like its fields (plus `overrides`); a value the config
    rejects becomes a UsageError naming the flag."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    try:
        return cls(**{**values, **overrides})
    except ValueError as exc:
        match = re.search(r"\b[A-Z]\w*Config\.(\w+)", str(exc))
        raise UsageError(f"argument {flag_for(match[1])}: {exc}" if match else str(exc)) from None


# -------------------------------------------------------------------------------------------- argument groups
def add_engine_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Flags of every EngineConfig field; returns their actions."""
    g = parser.add_argument_group("engine")
    E = EngineConfig
    return [
        _arg(g, E, "model", "a .gguf file, a Hugging Face directory, or 'default' (SmolLM2-135M-Instruct)",
             default="default"),
        _arg(g, E, "dtype", "compute and KV dtype (auto: bfloat16 on CUDA, float32 on CPU)", choices=DTYPES),
        _arg(g, E, "kv_cache_dtype", "what the KV cache stores (auto: --dtype); bfloat16 with float32 compute "
             "(CPU) holds twice the tokens in the same memory and halves what attention reads; prefill and "
             "decode workers must agree", choices=KV_CACHE_DTYPES),
        _arg(g, E, "quantization", "weight-only quantization: int8 (linear layers and LM head) or int4 (linear "
             "layers, 32-input groups; LM head int8) (default: none, weights in --dtype)", choices=QUANTIZATIONS),
        _arg(g, E, "keep_quantized_weights", "keep a GGUF's quantized matrices in the file's encoding in memory, "
             "multiplied straight from its codes (about 1/5 the memory of float32 for a Q4 file, faster batch-1 "
             "decode on CPU, bfloat16 activations; the default); --no-keep-quantized-weights dequantizes them to "
             "--dtype at load", action=argparse.BooleanOptionalAction),
        _arg(g, E, "cpu_matmul", "CPU kernels of int4/int8 linears: torch (int4pack/int8pack_mm), native "
             "(built on first use with the system C compiler; int8 activations per 32, AVX512-VNNI/AVX2) or "
             "native-bf16 (the same build; torch's arithmetic: bfloat16 activations, float32 sums)",
             choices=CPU_MATMULS),
        _arg(g, E, "device", "torch device: cpu, cuda, cuda:1"),
        _arg(g, E, "max_model_len", "longest prompt + completion in tokens (default: the model's)", type=int),
        _arg(g, E, "kv_cache_memory", "KV-cache budget in bytes, e.g. 512M or 2G "
             "(default: --kv-cache-memory-fraction of free memory)", type=parse_bytes),
        _arg(g, E, "kv_cache_memory_fraction", "fraction of free device memory for the KV cache when "
             "--kv-cache-memory is not given", type=float),
        _arg(g, E, "num_kv_blocks", "exact number of KV blocks, overriding both memory settings", type=int),
        _arg(g, E, "block_size", "tokens per KV block (a power of two)", type=int),
        _arg(g, E, "max_num_seqs", "most sequences running in one step", type=int),
        _arg(g, E, "max_num_batched_tokens", "token budget of one step", type=int),
        _arg(g, E, "long_prefill_token_threshold", "most prompt tokens one sequence computes in one step, so that "
             "a long prompt's chunks leave room to short prompts and decodes (0: off)", type=int),
        _arg(g, E, "max_waiting", "bound of the waiting queue; beyond it requests are rejected", type=int),
        _arg(g, E, "enable_prefix_caching", "disable reuse of cached prefix blocks", action="store_false"),
        _arg(g, E, "num_threads", "CPU threads of this process (default: torch's)", type=int),
        _arg(g, E, "tensor_parallel_size", "ranks (processes) the model is split over; rank r of a CUDA worker "
             "uses device index + r, each rank takes --threads CPU threads", type=int),
        _arg(g, E, "tensor_parallel_timeout_s", "seconds a collective between the ranks may wait before the "
             "worker fails instead of hanging", type=float),
        _arg(g, E, "seed", "seed of requests that set none", type=int),
        _arg(g, E, "compile_decode", "run decode steps through a torch.compile'd graph (Inductor fuses the "
             "per-layer small ops); compiled at start-up, minutes per batch size on a small CPU",
             action="store_true"),
        _arg(g, E, "compile_batch_sizes", "with --compile-decode: the decode batch sizes compiled, e.g. 1,2,4,8 "
             "(a batch runs padded to the next; larger ones run eager)", type=parse_int_list,
             metavar="N[,N...]"),
    ]


def engine_flags(config: EngineConfig) -> list[str]:
    """Flags that parse back to `config` (only fields that differ from the defaults)."""
    flags: list[str] = []
    for action in add_engine_args(argparse.ArgumentParser(add_help=False)):
        value = getattr(config, action.dest)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):  # --flag / --no-flag
            flags.append(action.option_strings[0 if value else 1])
        else:
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            flags += [action.option_strings[0]] if action.nargs == 0 else [action.option_strings[0], text]
    return flags


def _add_server_args(p: argparse.ArgumentParser, cls: type, port_help: str) -> None:
    p.add_argument("--parent-pipe-fd", type=int, default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("server")
    _arg(g, cls, "host", "address to bind")
    _arg(g, cls, "port", port_help, type=int)
    _arg(g, cls, "health_port", "plaintext port serving only grpc.health.v1 with the main port's status, on --host "
         "(for the kubelet's gRPC probes; default: none)", type=int)
    _arg(g, cls, "metrics_port", "HTTP port of Prometheus /metrics on --host (default: none)", type=int)


def _add_worker_args(p: argparse.ArgumentParser, cls: type) -> None:
    _add_server_args(p, cls, "port to bind (0 picks a free one, which is registered)")
    g = p.add_argument_group("worker")
    _arg(g, cls, "worker_id", "id in the prefix index, unique in the deployment (default: ROLE-HOSTNAME-PID)")
    _arg(g, cls, "redis_url", f"prefix index and registry, redis://[:PASSWORD@]host:port/db (default: "
         f"${REDIS_URL_ENV}, else run unregistered)")
    _arg(g, cls, "advertise_host", "host other processes reach this worker at (default: --host)")
    _arg(g, cls, "worker_ttl_s", "registration TTL in seconds", type=float)
    t = p.add_argument_group("cluster security (one of: the three certificate flags, or --insecure-internal)")
    _arg(t, cls, "cluster_ca", "CA bundle of the cluster (PEM): mutual TLS on this worker's port and its "
         "connections to other workers, with --cluster-cert and --cluster-key")
    _arg(t, cls, "cluster_cert", "this worker's certificate (PEM), issued by the cluster CA for its role")
    _arg(t, cls, "cluster_key", "this worker's private key (PEM)")
    _arg(t, cls, "insecure_internal", "serve plaintext without authentication: anyone who reaches the port may "
         "call every internal RPC (and, on a decode worker, put KV into its prefix cache)", action="store_true")
    _arg(g, cls, "drain_timeout_s", "on SIGTERM, seconds requests already taken get to finish after the worker "
         "left the index and refuses new ones; the rest then end with UNAVAILABLE", type=float)
    g.add_argument("--cpu-affinity", type=_cpu_list, default=None, metavar="CPUS",
                   help="run this process (every thread) only on these CPUs, e.g. 0-3 or 0,2; --threads then "
                        "defaults to their number and must equal it (default: not pinned)")
    c = p.add_argument_group("cpu lending (what `pdserve up --lend-idle-cpus` sets; engine.cpu_share)")
    _arg(c, cls, "busy_lock", "hold an exclusive lock on this file while the engine has work, so that a worker "
         "started with --borrow-lock FILE steps on this worker's CPUs only while it is idle", metavar="FILE")
    _arg(c, cls, "borrow_cpus", "another worker's CPUs this worker also steps on, a step at a time, while that "
         "worker is idle, with --borrow-lock", type=_cpu_list, metavar="CPUS")
    _arg(c, cls, "borrow_lock", "the --busy-lock file of the worker whose CPUs --borrow-cpus names", metavar="FILE")
    add_engine_args(p)


def _add_gateway_tuning(g: Any, defaults: bool) -> None:
    G = GatewayConfig
    kw = {} if defaults else {"default": None}
    _arg(g, G, "max_inflight", "requests admitted at once; one more gets RESOURCE_EXHAUSTED", type=int, **kw)
    _arg(g, G, "max_queued", "admitted requests that may wait for room on a full decode pool (0: no queue); one "
         "more gets RESOURCE_EXHAUSTED", type=int, **kw)
    _arg(g, G, "queue_timeout_s", "seconds a queued request waits before RESOURCE_EXHAUSTED with a retry hint",
         type=float, **kw)
    _arg(g, G, "token_timeout_s", "seconds a decode stream may stay silent before the request fails with "
         "UNAVAILABLE (a hung worker)", type=float, **kw)
    _arg(g, G, "max_request_bytes", "largest request: HTTP body (413 beyond) and gRPC message, e.g. 4M",
         type=parse_bytes, **kw)
    _arg(g, G, "local_prefill_threshold", "prefill on the decode worker when fewer prompt tokens than this "
         "are uncached (0: always use a prefill worker)", type=int, **kw)
    _arg(g, G, "idle_offload_min_tokens", "a prompt under --local-prefill-threshold that lacks at least this many "
         "tokens still goes to an idle prefill worker while the decode worker decodes others, sparing their steps "
         "the stall (0: never)", type=int, **kw)
    _arg(g, G, "lease_ms", "how long a decode worker holds a reservation whose KV has not arrived (renewed "
         "every third of it while the prefill runs)", type=int, **kw)
    _arg(g, G, "prefill_attempts", "prefill workers tried before prefilling on the decode worker", type=int, **kw)
    _arg(g, G, "max_prefill_load", "running + waiting requests at which a prefill worker counts as saturated",
         type=int, **kw)
    _arg(g, G, "routing", "worker choice: by cached prefix and load, or round-robin (a benchmark baseline)",
         choices=("prefix", "round-robin"), **kw)
    _arg(g, G, "drain_timeout_s", "seconds in-flight requests get to finish on SIGTERM", type=float, **kw)
    _arg(g, G, "served_model_name", "model name ListModels reports (default: the model file's name)", **kw)
    _arg(g, G, "tool_call_parser", "how tool calls are read from the model's output: hermes (<tool_call> JSON), "
         "llama3_json, or auto (from the chat template)", choices=("auto", *TOOL_CALL_PARSERS), **kw)


def _add_gateway_security(p: argparse.ArgumentParser) -> None:
    G = GatewayConfig
    g = p.add_argument_group("client security")
    _arg(g, G, "api_key_file", "API keys, one per line: KEY [TENANT] [max_concurrent=N] [tokens_per_minute=N]; "
         "every RPC and endpoint but health then needs 'authorization: Bearer KEY' (reloaded on SIGHUP)")
    _arg(g, G, "allow_unauthenticated", "serve a non-loopback --host without --api-key-file", action="store_true")
    _arg(g, G, "tls_cert", "certificate chain (PEM) of the public gRPC port and HTTPS, with --tls-key")
    _arg(g, G, "tls_key", "private key (PEM) of --tls-cert")
    t = p.add_argument_group("cluster security (one of: the three certificate flags, or --insecure-internal)")
    _arg(t, G, "cluster_ca", "CA bundle of the cluster (PEM): mutual TLS toward the workers, with "
         "--cluster-cert and --cluster-key")
    _arg(t, G, "cluster_cert", "this gateway's certificate (PEM), issued by the cluster CA for role gateway")
    _arg(t, G, "cluster_key", "this gateway's private key (PEM)")
    _arg(t, G, "insecure_internal", "talk plaintext to the workers: anyone who can write a worker record into "
         "Redis may receive prompts", action="store_true")


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"gateway host:port (default {DEFAULT_TARGET})")
    p.add_argument("--api-key", default=None, help=f"the gateway's API key (default: ${API_KEY_ENV})")
    p.add_argument("--tls", action="store_true", help="talk TLS to the gateway (system CA roots unless --ca-cert)")
    p.add_argument("--ca-cert", default=None, metavar="PATH", help="CA bundle (PEM) that signed the gateway's "
                   "certificate; implies --tls")
    p.add_argument("--timeout", type=float, default=None, help="deadline of each request in seconds")
    p.add_argument("--model", default="", help="served model name (default: the gateway's default)")
    p.add_argument("--cache-salt", default="", help="share cached prefixes only with requests of this salt")
    p.add_argument("--stats", action="store_true", help="print usage and timings to stderr after each answer")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--min-p", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--repetition-penalty", type=float)
    g.add_argument("--presence-penalty", type=float)
    g.add_argument("--frequency-penalty", type=float)
    g.add_argument("--stop", action="append", default=[], help="a string that ends generation (repeatable)")
    g.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append", default=[],
                   help="a token id that ends generation (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    g.add_argument("--logprobs", type=int, help="ask for log-probabilities with this many alternatives")


_OPTION_DESTS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "logprobs",
                 "cache_salt", "model")


def generate_options(args: argparse.Namespace) -> dict[str, Any]:
    """The client's GenerateOptions from the sampling flags that were given (or have a CLI default)."""
    options = {name: getattr(args, name) for name in _OPTION_DESTS if hasattr(args, name)}
    return {name: value for name, value in options.items()
            if not (value is None or value is False or value == "" or value == [])}


# -------------------------------------------------------------------------------------------- configs
def redis_url(args: argparse.Namespace) -> str | None:
    """--redis-url, else $PDSERVE_REDIS_URL, else None."""
    return args.redis_url if args.redis_url is not None else os.environ.get(REDIS_URL_ENV) or None


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """The gateway's config; it needs its cluster certificate flags or an explicit --insecure-internal, and a
    Redis URL (--redis-url or $PDSERVE_REDIS_URL)."""
    url = redis_url(args)
    if url is None:
        raise UsageError(f"gateway needs --redis-url or ${REDIS_URL_ENV}")
    config = build_config(GatewayConfig, args, redis_url=url)
    if config.cluster_tls is None and not config.insecure_internal:
        raise UsageError("gateway needs --cluster-ca, --cluster-cert and --cluster-key (mutual TLS toward the "
                         "workers), or --insecure-internal to talk plaintext to them")
    return config


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """pdserve.client.Client keyword arguments of `generate`/`chat`: --api-key (else $PDSERVE_API_KEY), --tls,
    --ca-cert."""
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    return {"api_key": api_key, "tls": args.tls or args.ca_cert is not None, "ca_cert": args.ca_cert}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's config; a worker pinned with --cpu-affinity and no --threads runs one thread per CPU."""
    cpus = getattr(args, "cpu_affinity", None)
    if cpus is not None and args.num_threads is None:
        return build_config(EngineConfig, args, num_threads=len(cpus))
    return build_config(EngineConfig, args)


def cpu_affinity(args: argparse.Namespace) -> tuple[int, ...] | None:
    """A worker's --cpu-affinity, checked against the CPUs this process may use and against --threads (one torch
    thread per pinned CPU); None when not given."""
    cpus = getattr(args, "cpu_affinity", None)
    if cpus is None:
        return None
    try:
        check_cpus(cpus, allowed_cpus())
    except ValueError as exc:
        raise UsageError(f"argument --cpu-affinity: {exc}") from None
    if args.num_threads is not None and args.num_threads != len(cpus):
        raise UsageError(f"argument --threads: {args.num_threads} threads on the {len(cpus)} CPU(s) of "
                         f"--cpu-affinity {format_cpu_list(cpus)}; give one thread per pinned CPU (or leave "
                         "--threads out)")
    if args.tensor_parallel_size != 1:
        raise UsageError("argument --cpu-affinity: not supported with --tensor-parallel-size > 1 (every rank "
                         "would run --threads threads on the same CPUs)")
    return cpus


def _check_borrow_cpus(args: argparse.Namespace) -> None:
    """A worker's --borrow-cpus: CPUs this process may use, none of them its own --cpu-affinity ones."""
    borrow = getattr(args, "borrow_cpus", ())
    if not borrow:
        return
    own = getattr(args, "cpu_affinity", None)
    if own is None:
        raise UsageError("argument --borrow-cpus: needs --cpu-affinity (the worker's own CPUs, which it always "
                         "steps on)")
    try:
        check_cpus(borrow, allowed_cpus())
    except ValueError as exc:
        raise UsageError(f"argument --borrow-cpus: {exc}") from None
    shared = set(own) & set(borrow)
    if shared:
        raise UsageError(f"argument --borrow-cpus: CPU(s) {format_cpu_list(shared)} are this worker's own "
                         f"(--cpu-affinity {format_cpu_list(own)})")


def worker_config(cls: type[C], role: str, args: argparse.Namespace) -> C:
    """A PrefillWorkerConfig or DecodeWorkerConfig; without --worker-id the id is ROLE-HOSTNAME-PID. A worker
    needs its cluster certificate flags or an explicit --insecure-internal (UsageError otherwise)."""
    worker_id = args.worker_id if args.worker_id is not None else f"{role}-{socket.gethostname()}-{os.getpid()}"
    config = build_config(cls, args, worker_id=worker_id, redis_url=redis_url(args))
    _check_borrow_cpus(args)
    if config.tls_files is None and not config.insecure_internal:
        raise UsageError(f"{role}-worker needs --cluster-ca, --cluster-cert and --cluster-key (mutual TLS inside "
                         "the cluster), or --insecure-internal to run plaintext without authentication")
    return config


def cluster_config(args: argparse.Namespace) -> LocalClusterConfig:
    """`pdserve up`'s LocalClusterConfig; gateway tuning flags are checked here, then passed through."""
    engine = engine_config(args)
    tuning = {name: getattr(args, name) for name in GATEWAY_TUNING if getattr(args, name) is not None}
    build_config(GatewayConfig, argparse.Namespace(), model=engine.model, redis_url="redis://", **tuning)
    gateway_args = tuple(item for name, value in tuning.items() for item in (flag_for(name), str(value)))
    # A one-shot question binds no fixed port (a busy 50051 or 8000 must not stop it) and needs no HTTP API.
    once = getattr(args, "once", None) is not None
    ports = {name: value if value is not None else once_value if once else _default(LocalClusterConfig, name)
             for name, value, once_value in (("port", args.port, 0), ("http_port", args.http_port, -1))}
    return build_config(LocalClusterConfig, args, engine=engine, gateway_args=gateway_args, redis_url=redis_url(args),
                        **ports)


# -------------------------------------------------------------------------------------------- parser
AddCommand = Callable[[Any], Any]
"""Adds one subcommand to the parser's subparsers (e.g. pdserve.bench.cli.add_parser)."""


def build_parser(description: str = "", extra_commands: Sequence[AddCommand] = ()) -> argparse.ArgumentParser:
    """The `pdserve` parser; `extra_commands` add subcommands defined outside this module (`pdserve.cli` passes
    `bench`'s, so that this module, which the launcher uses, imports nothing that imports the launcher)."""
    parser = argparse.ArgumentParser(prog="pdserve", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (servers always do)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("fetch-model", help="download and verify the default model")

    for add_command in extra_commands:
        add_command(sub)

    up = sub.add_parser("up", help="run the whole cluster locally (Redis, workers, gateway)")
    g = up.add_argument_group("cluster")
    L = LocalClusterConfig
    _arg(g, L, "num_prefill", "prefill worker processes", type=int)
    _arg(g, L, "num_decode", "decode worker processes", type=int)
    _arg(g, L, "host", "address the gateway binds")
    _arg(g, L, "port", f"gateway port, 0 picks a free one (default: {_default(L, 'port')}; with --once a free one)",
         type=int, default=None)
    _arg(g, L, "http_port", "gateway's OpenAI-compatible HTTP port, 0 picks a free one, -1 turns it off (default: "
         f"{_default(L, 'http_port')}; with --once off)", type=int, default=None)
    _arg(g, L, "prefill_kv_cache_memory", "KV-cache budget of each prefill worker, e.g. 256M (default: "
         "--kv-cache-memory)", type=parse_bytes)
    _arg(g, L, "prefill_tensor_parallel_size", "ranks of each prefill worker (default: --tensor-parallel-size)",
         type=int)
    _arg(g, L, "decode_tensor_parallel_size", "ranks of each decode worker (default: --tensor-parallel-size)",
         type=int)
    _arg(g, L, "transport", "KV transport between workers", choices=TRANSPORTS)
    _arg(g, L, "codec", "KV wire codec", choices=CODECS)
    _arg(g, L, "redis_url", f"use this Redis instead of starting one (default: ${REDIS_URL_ENV}, else an "
         "embedded redis-server with a generated password)")
    _arg(g, L, "run_dir", "keep the processes' logs here (default: a temporary directory)")
    _arg(g, L, "num_cpus", "CPUs divided among the workers when --threads is not given (default: all)", type=int)
    _arg(g, L, "pin_workers", "pin each worker to CPUs of its own (--cpu-affinity), in slices of its thread "
         "share, prefill workers first; the gateway and Redis are not pinned", action="store_true")
    _arg(g, L, "lend_idle_cpus", "with --pin-workers: prefill worker i and decode worker i each also step on the "
         "other's CPUs while the other is idle, a step at a time (--borrow-cpus / --busy-lock); neither waits for "
         "the other", action="store_true")
    _arg(g, L, "start_timeout_s", "seconds the whole start may take", type=float)
    _arg(g, L, "stop_timeout_s", "seconds each stop stage waits before SIGKILL", type=float)
    _arg(g, L, "restart_workers", "restart a worker process that exits (same id, port and flags, with a backoff); "
         "without it a dead worker is reported and the cluster serves on the others", action="store_true")
    s = up.add_argument_group("security (internal mutual TLS is on: a cluster CA per run, one certificate per "
                              "process)")
    _arg(s, L, "insecure_internal", "run the workers and the gateway plaintext inside the cluster, without "
         "certificates (any local process may then call every internal RPC)", action="store_true")
    _arg(s, L, "api_key_file", "the gateway's API keys (see `pdserve gateway --help`); --once sends the first one")
    _arg(s, L, "allow_unauthenticated", "let the gateway serve a non-loopback --host without --api-key-file",
         action="store_true")
    _arg(s, L, "tls", "serve the gateway's public ports over TLS with a certificate made for the run "
         "(<run dir>/pki/public.pem; clients verify it with pki/public-ca.pem)", action="store_true")
    _arg(s, L, "tls_cert", "certificate chain (PEM) of the gateway's public gRPC port and HTTPS, with --tls-key")
    _arg(s, L, "tls_key", "private key (PEM) of --tls-cert")
    _arg(s, L, "ca_cert", "CA bundle (PEM) that signed --tls-cert, for the launcher's health checks and --once "
         "(default: the system's roots)")
    _add_gateway_tuning(up.add_argument_group("gateway"), defaults=False)
    add_engine_args(up)
    once = up.add_argument_group("once")
    once.add_argument("--once", metavar="MESSAGE", help="send this chat message, print the answer, and stop")
    once.add_argument("--system", default=None, help="system prompt for --once")
    once.add_argument("--max-tokens", type=int, default=256, help="most tokens of the --once answer (default 256)")

    gateway = sub.add_parser("gateway", help="run the gateway (public gRPC and OpenAI-compatible HTTP APIs)")
    _add_server_args(gateway, GatewayConfig, "port of the public gRPC API (0 picks a free one)")
    g = gateway.add_argument_group("gateway")
    _arg(g, GatewayConfig, "http_port", "port of the OpenAI-compatible HTTP API on --host (0 picks a free one, "
         "-1 turns it off)", type=int)
    _arg(g, GatewayConfig, "redis_url", "prefix index and worker registry, redis://[:PASSWORD@]host:port/db "
         f"(required unless ${REDIS_URL_ENV} is set, which keeps a password off the command line)")
    _arg(g, GatewayConfig, "model", "model path or 'default' (tokenizer and limits only; no weights)",
         default="default")
    _arg(g, GatewayConfig, "block_size", "KV block size in tokens; must equal the workers'", type=int)
    _arg(g, GatewayConfig, "max_model_len", "longest prompt + completion admitted; set it to the workers' value "
         "when they run with a smaller context (default: the model's)", type=int)
    _arg(g, GatewayConfig, "quantization", "the workers' --quantization (part of the model fingerprint they "
         "register; default: none)", choices=QUANTIZATIONS)
    _add_gateway_tuning(g, defaults=True)
    _add_gateway_security(gateway)

    prefill = sub.add_parser("prefill-worker", help="run a prefill worker")
    _add_worker_args(prefill, PrefillWorkerConfig)
    g = prefill.add_argument_group("kv transfer")
    _arg(g, PrefillWorkerConfig, "transport", "KV data path to decode workers", choices=TRANSPORTS)
    _arg(g, PrefillWorkerConfig, "codec", "KV wire format (int8 is lossy)", choices=CODECS)
    _arg(g, PrefillWorkerConfig, "chunk_bytes", "payload bytes per gRPC message, 1M..4M", type=parse_bytes)
    _arg(g, PrefillWorkerConfig, "shm_pool_bytes", "bound of the reused, pre-faulted shared-memory segments of "
         "the shm transport; 0: a fresh segment per transfer", type=parse_bytes)
    g.add_argument("--decode-endpoint", dest="decode_endpoints", action="append", default=[], metavar="HOST:PORT",
                   help="a decode worker this worker may push KV to when it runs without --redis-url "
                        "(repeatable; with --redis-url only the index's live decode workers)")
    prefill.add_argument("--fault-corrupt-transfers", dest="fault_corrupt_transfers", type=int,  # tests only
                         default=_default(PrefillWorkerConfig, "fault_corrupt_transfers"), help=argparse.SUPPRESS)

    decode = sub.add_parser("decode-worker", help="run a decode worker")
    _add_worker_args(decode, DecodeWorkerConfig)
    g = decode.add_argument_group("decode")
    _arg(g, DecodeWorkerConfig, "max_lease_ms", "upper bound of a reservation's lease", type=int)
    _arg(g, DecodeWorkerConfig, "max_reserved_fraction_per_caller", "share of the KV pool one caller may hold in "
         "reservations whose KV has not arrived; beyond it Reserve is RESOURCE_EXHAUSTED", type=float)
    _arg(g, DecodeWorkerConfig, "verify_kv", "compare received KV with a recomputation before decoding on it: "
         "off, sample (layer 0 of a few random blocks) or full (every layer; prefills the prompt again here)",
         choices=VERIFY_KV_MODES)

    gen = sub.add_parser("generate", help="complete a raw prompt through a gateway, streaming the text")
    gen.add_argument("prompt")
    _add_client_args(gen)

    chat = sub.add_parser("chat", help="chat through a gateway (interactive without MESSAGE)")
    chat.add_argument("message", nargs="?", help="one message; omit for an interactive session")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_client_args(chat)

    health = sub.add_parser("health", help="exit 0 when TARGET answers grpc.health.v1 SERVING, else 1")
    health.add_argument("target", help="host:port")
    health.add_argument("--service", default="", help="service name (default: the whole server)")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    h = health.add_argument_group("tls (default: plaintext, e.g. a --health-port)")
    h.add_argument("--cluster-ca", default=None, metavar="PATH", help="mutual TLS: the cluster CA bundle (PEM), "
                   "with --cluster-cert and --cluster-key (a probe certificate suffices)")
    h.add_argument("--cluster-cert", default=None, metavar="PATH", help="certificate (PEM) issued by the cluster CA")
    h.add_argument("--cluster-key", default=None, metavar="PATH", help="private key (PEM) of --cluster-cert")
    h.add_argument("--server-role", default=None, choices=("gateway", "prefill", "decode"),
                   help="with the cluster files: require a server certificate of this role, whatever address is "
                        "dialed (default: check the address against the certificate's names)")
    h.add_argument("--ca-cert", default=None, metavar="PATH", help="server TLS (the gateway's public port): the "
                   "CA bundle (PEM) that signed its certificate")
    h.add_argument("--tls", action="store_true", help="server TLS against the system's roots")

    certs = sub.add_parser("certs", help="write a cluster PKI (CA and per-process certificates) and secrets")
    where = certs.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", metavar="DIR", help="for hand-run clusters: ca.pem, ca-key.pem, NAME.pem and "
                       "NAME-key.pem per --name, and the gateway's public-ca.pem, public.pem, public-key.pem")
    where.add_argument("--k8s", metavar="DIR", help="the files deploy/k8s/overlays/*/kustomization.yaml reads "
                       "(certificates, API key, Redis password and URL), e.g. deploy/k8s/overlays/cpu/secrets")
    where.add_argument("--compose", metavar="DIR", help="docker-compose's pki service: one folder per service "
                       "volume (gateway/, prefill/, decode/, redis/); keeps what is already there")
    certs.add_argument("--name", dest="names", action="append", default=[], metavar="ROLE[/NAME]",
                       help="with --out: a certificate for ROLE (gateway, prefill, decode, probe) named NAME "
                            "(default NAME: ROLE); repeatable (default: one per role)")
    certs.add_argument("--host", dest="hosts", action="append", default=[], metavar="HOST_OR_IP",
                       help="an extra DNS name or IP address in every certificate of --out, and in the public "
                            "certificate of --k8s and --compose (repeatable)")
    certs.add_argument("--ca-cert", default=None, metavar="PATH", help="with --out: issue under this CA "
                       "(PEM, with --ca-key) instead of a new one, e.g. to add a worker or rotate certificates")
    certs.add_argument("--ca-key", default=None, metavar="PATH", help="private key (PEM) of --ca-cert")
    certs.add_argument("--force", action="store_true", help="with --compose: replace what is already there")
    return parser


def parse_args(argv: Sequence[str] | None, description: str = "",
               extra_commands: Sequence[AddCommand] = ()) -> argparse.Namespace:
    return build_parser(description, extra_commands).parse_args(argv)
