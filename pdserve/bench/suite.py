"""`pdserve bench --suite cpu`: every system, one run, one machine, the same token ids.

Systems (each gets the same `threads`; the disaggregated shapes divide them among their workers the way
`pdserve up` does):
    llama-server          llama.cpp's server on the same GGUF, --parallel <streams>, continuous batching
    transformers          AutoModelForCausalLM on the same GGUF (dequantized to float32), static batches
    pdserve-engine        pdserve's engine in a process of its own (no RPC), by default: the GGUF's codes kept
    pdserve-engine-int8   the same with int8 weight-only quantization (EngineConfig.quantization="int8")
    pdserve-engine-int4   the same with int4 weight-only quantization (the GGUF's Q4_1 codes, int8 LM head)
    pdserve-engine-native pdserve-engine on int8 activations (EngineConfig.cpu_matmul="native"), llama.cpp's
                          arithmetic: its greedy tokens may differ from transformers'
    pdserve-engine-kv-bf16  pdserve-engine with its KV cache in bfloat16 (EngineConfig.kv_cache_dtype="bfloat16"):
                          half the bytes attention reads; its greedy tokens may differ from transformers'
    pdserve-1p1d          LocalCluster: 1 prefill + 1 decode worker + gateway + Redis (gRPC client)
    pdserve-2p1d-prefix   2 prefill + 1 decode, prefix-aware routing
    pdserve-2p1d-rr       2 prefill + 1 decode, round-robin routing
    pdserve-colocated     LocalCluster with no prefill worker: one decode worker with every core (pinned to them)
                          prefills and decodes (chunked prefill)
    pdserve-colocated-capped  the same, its long prompts' prefill capped per step
                          (goodput_long_prefill_token_threshold) so that short prompts and decodes share every step
    pdserve-1p1d-pinned   1 prefill + 1 decode, the cores split between them, each pinned to its own; short
                          prompts prefilled on the decode worker (goodput_local_prefill_threshold)
    pdserve-1p1d-lend     the same, and each worker also steps on the other's cores while the other is idle
                          (LocalClusterConfig.lend_idle_cpus), the prefill worker's steps at most
                          goodput_lend_batched_tokens tokens; in the batch1 and streams scenarios too
pdserve-colocated runs batch1 as well: beside pdserve-engine (the same threads, no RPC) and pdserve-1p1d-lend (a
decode step on the same cores), it separates what serving through a gateway costs a stream from what
disaggregation adds.

Scenarios (prompts are random token ids wrapped in the model's chat template, rendered once here; greedy,
EOS ignored, exactly max_tokens generated):
    batch1         one stream: requests one after another                         -> TPOT at batch 1
    streams        `streams` concurrent streams, all requests due at once         -> aggregate throughput
    prefix_cache   pairs sharing a `prefix_len`-token system prompt, one at a time:
                   the first of a pair is cold, the second finds the prefix cached -> cached vs cold TTFT
    shared_prefix  `shared_groups` system prompts x `shared_per_group` users, Poisson arrivals
                                                                                  -> routing p90 TTFT
    sweep@R        the streams workload at Poisson rate R (concurrency capped)    -> throughput vs rate
    goodput-idle   long prompts (the longest length of their class) and short chat turns, one at a time
                                                                                  -> the SLOs (bench.goodput)
    goodput@R      long prompts among short chat turns, Poisson rate R, a fresh workload per rate (nothing
                   cached from another rate)                                      -> goodput vs rate
`SuiteConfig.only` picks scenario families (the name before "@" or "-": batch1, streams, prefix_cache,
shared_prefix, sweep, goodput); a system none of the picked scenarios uses is not started.
Writes results.json (every request's timings), PNG plots and report.md into the output directory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import multiprocessing
import os
import shutil
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine_loop import build_engine
from engine.loader import load_model
from engine.model_fetch import resolve_model_path
from gateway.config import GatewayConfig
from kvstore.malloc_tuning import keep_freed_memory_for_reuse
from pdserve.bench import cpumeter, plots, report, roofline
from pdserve.bench.backends import Backend, OpenAIBackend, PdserveBackend
from pdserve.bench.goodput import IdleFigures
from pdserve.bench.inprocess import EngineBackend, load_transformers_model, run_transformers
from pdserve.bench.metrics import summarize
from pdserve.bench.peers import LlamaServer, LlamaServerConfig
from pdserve.bench.report import REPEAT
from pdserve.bench.runner import RunConfig, RunResult, run_with, write_json
from pdserve.bench.workloads import (BenchRequest, PromptFormat, TemplateFormat, mixed_workload, random_workload,
                                     shared_prefix_workload)
from pdserve.launch_plan import divide_threads
from pdserve.launcher import LocalCluster, LocalClusterConfig

log = logging.getLogger(__name__)

LLAMA_SERVER = "llama-server"
TRANSFORMERS = "transformers"
ENGINE = "pdserve-engine"
ENGINE_INT8 = "pdserve-engine-int8"
ENGINE_INT4 = "pdserve-engine-int4"
ENGINE_NATIVE = "pdserve-engine-native"
ENGINE_KV_BF16 = "pdserve-engine-kv-bf16"
ENGINES = {ENGINE: {}, ENGINE_INT8: {"quantization": "int8"}, ENGINE_INT4: {"quantization": "int4"},
           ENGINE_NATIVE: {"cpu_matmul": "native"}, ENGINE_KV_BF16: {"kv_cache_dtype": "bfloat16"}}
"""In-process engine systems and their EngineConfig fields beyond the suite's own."""
ONE_P_ONE_D = "pdserve-1p1d"
TWO_P_PREFIX = "pdserve-2p1d-prefix"
TWO_P_RR = "pdserve-2p1d-rr"
COLOCATED = "pdserve-colocated"
COLOCATED_CAPPED = "pdserve-colocated-capped"
ONE_P_ONE_D_PINNED = "pdserve-1p1d-pinned"
ONE_P_ONE_D_LEND = "pdserve-1p1d-lend"
SYSTEMS = (LLAMA_SERVER, TRANSFORMERS, ENGINE, ENGINE_INT8, ENGINE_INT4, ENGINE_NATIVE, ENGINE_KV_BF16, ONE_P_ONE_D,
           TWO_P_PREFIX, TWO_P_RR, COLOCATED, COLOCATED_CAPPED, ONE_P_ONE_D_PINNED, ONE_P_ONE_D_LEND)
GOODPUT_SYSTEMS = (LLAMA_SERVER, COLOCATED, COLOCATED_CAPPED, ONE_P_ONE_D_PINNED, ONE_P_ONE_D_LEND)
FAMILIES = ("batch1", "streams", "prefix_cache", "shared_prefix", "sweep", "goodput")
NUM_PREFILL = {ONE_P_ONE_D: 1, TWO_P_PREFIX: 2, TWO_P_RR: 2, COLOCATED: 0, COLOCATED_CAPPED: 0, ONE_P_ONE_D_PINNED: 1,
               ONE_P_ONE_D_LEND: 1}
"""Prefill workers of each LocalCluster system (one decode worker each)."""
PINNED = (COLOCATED, COLOCATED_CAPPED, ONE_P_ONE_D_PINNED, ONE_P_ONE_D_LEND)
"""Cluster systems whose workers are pinned to their own cores (LocalClusterConfig.pin_workers)."""
PEERS = (LLAMA_SERVER, TRANSFORMERS)
"""Suffix of a peer's second batch1/streams runs, at the end of the suite."""
CONTENDED_CORES = 0.1
"""A run during which other jobs kept this many CPUs busy is contended: its peer gets a second try."""
ROUTING = {TWO_P_PREFIX: "prefix", TWO_P_RR: "round-robin"}


@dataclass(frozen=True)
class SuiteConfig:
    """What `pdserve bench --suite cpu` runs. Without the goodput scenarios the defaults fit in about 20 minutes
    on 2 quiet cores; the goodput scenarios add about 10 minutes per goodput system at their defaults (`only`
    runs some families alone)."""

    out_dir: Path
    """Results directory (bench/results/<date> by default)."""
    llama_server: Path | None = None
    """The llama-server binary; None leaves llama-server out (the report says so)."""
    model: str = "default"
    """GGUF every system serves ("default": SmolLM2-135M-Instruct Q4_1)."""
    threads: int = 2
    """CPU threads of every system."""
    systems: tuple[str, ...] = SYSTEMS
    seed: int = 0
    input_len: int = 128
    """Prompt tokens (chat template included) of the batch1 / streams / sweep workloads."""
    output_len: int = 64
    batch1_requests: int = 3
    streams: int = 32
    """Concurrent streams (llama-server --parallel, transformers batch size)."""
    streams_requests: int = 32
    prefix_len: int = 1024
    prefix_trials: int = 3
    shared_groups: int = 4
    shared_per_group: int = 12
    shared_prefix_len: int = 1024
    shared_suffix_len: int = 32
    shared_output_len: int = 8
    shared_rate: float = 0.5
    """Poisson arrivals per second of the shared_prefix scenario. Its defaults: a few long system prompts, each
    shared by many users, arriving slower than a prefill worker prefills a cached prompt but faster than it
    prefills a cold one (about 5 s for 1024 tokens on one thread)."""
    shared_prefill_kv_cache_memory: int = 128 * 2**20
    """KV-cache bytes of each prefill worker in the 2p1d systems (their decode worker keeps kv_cache_memory). With
    the defaults it holds about 2.7 of the prompts' KV in float32: the 4 system prompts fit across the 2 prefill
    workers only when each worker keeps to its own half (the regime where routing matters: a working set of
    prefixes larger than one worker's cache)."""
    sweep_rates: tuple[float, ...] = (1.0, 2.0)
    sweep_requests: int = 16
    sweep_systems: tuple[str, ...] = (LLAMA_SERVER, ONE_P_ONE_D)
    goodput_rates: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4)
    """Poisson arrivals per second of the goodput scenarios."""
    goodput_requests: int = 24
    """Requests per goodput rate."""
    goodput_long_fraction: float = 0.25
    """Share of long prompts in the goodput workload."""
    goodput_long_len: tuple[int, int] = (1024, 4096)
    """Range of the long prompts' lengths (tokens, template included). The default is the issue's 1-4k; on a
    slow or busy machine scale it down (`--goodput-long-len 256-1024`) and say so with the figures."""
    goodput_short_len: int = 64
    """Mean length of the short chat turns (uniform in [half, 1.5x])."""
    goodput_long_output_len: int = 32
    goodput_short_output_len: int = 64
    goodput_idle_requests: tuple[int, int] = (2, 3)
    """Long and short requests of the idle probe (one at a time)."""
    goodput_ttft_scale: float = 3.0
    """TTFT SLO of a class = this x the reference's idle TTFT of the class (bench.goodput)."""
    goodput_tpot_scale: float = 3.0
    """TPOT SLO = this x the reference's idle TPOT."""
    goodput_slo_reference: str = COLOCATED
    """System whose idle probe sets the SLOs every system is judged by."""
    goodput_batched_tokens: int | None = None
    """pdserve-colocated's chunked-prefill token budget per step (--max-num-batched-tokens); None: the
    engine's default."""
    goodput_long_prefill_token_threshold: int = 256
    """pdserve-colocated-capped's --long-prefill-token-threshold: most prompt tokens of one sequence per step."""
    goodput_local_prefill_threshold: int = 256
    """pdserve-1p1d-pinned's (and -lend's) gateway --local-prefill-threshold: prompts with fewer uncached tokens
    (the short chat turns) are prefilled on the decode worker, only long ones go to the prefill worker."""
    goodput_lend_batched_tokens: int = 256
    """pdserve-1p1d-lend's --max-num-batched-tokens: a step on borrowed cores runs on until it ends when the decode
    worker gets work meanwhile, sharing its core; smaller steps bound that (engine.cpu_share)."""
    goodput_idle_offload_min_tokens: int | None = None
    """pdserve-1p1d-pinned's (and -lend's) gateway --idle-offload-min-tokens (None: the gateway's default): a short
    turn lacking at least this many tokens goes to the prefill worker while it is idle and the decode worker is
    busy; 0 keeps every short turn on the decode worker."""
    goodput_reference_idle: IdleFigures | None = None
    """Judge by the SLOs of an earlier run instead of this run's reference probe: that run's reference idle
    figures (results.json meta.goodput.reference_idle; `--goodput-slos-from`), to add a system to a comparison
    without running the reference again. Same machine and workload flags, or the comparison means nothing."""
    goodput_reference_source: str = ""
    """Where goodput_reference_idle came from (named in the report)."""
    only: tuple[str, ...] = ()
    """Scenario families to run (FAMILIES); empty runs every one."""
    quiet_wait_s: float = 20.0
    """Before each system, wait up to this long for other jobs to leave the CPUs (recorded either way)."""
    repeat_peers: bool = True
    """Run the peers' batch1 and streams scenarios again at the end; ratios use each peer's better run."""
    kv_cache_memory: int = 2 * 2**30
    """KV-cache bytes of pdserve's engine and of each pdserve worker."""
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown:
            raise ValueError(f"unknown system(s) {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        unknown = set(self.only) - set(FAMILIES)
        if unknown:
            raise ValueError(f"unknown scenario famil(ies) {sorted(unknown)}; known: {', '.join(FAMILIES)}")
        if not all(0 < rate < math.inf for rate in self.goodput_rates) or not self.goodput_rates:
            raise ValueError(f"goodput_rates must be finite and > 0, got {self.goodput_rates}")
        low, high = self.goodput_long_len
        if not 1 <= low <= high:
            raise ValueError(f"goodput_long_len must be (low, high) with 1 <= low <= high, got {self.goodput_long_len}")
        if not 0 <= self.goodput_long_fraction <= 1:  # NaN fails too
            raise ValueError(f"goodput_long_fraction must be in [0, 1], got {self.goodput_long_fraction}")
        for name in ("goodput_requests", "goodput_lend_batched_tokens", "goodput_long_prefill_token_threshold",
                     "goodput_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("goodput_local_prefill_threshold", "goodput_idle_offload_min_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        for name in ("goodput_ttft_scale", "goodput_tpot_scale"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be finite and > 0, got {getattr(self, name)}")
        if self.goodput_slo_reference not in SYSTEMS:
            raise ValueError(f"goodput_slo_reference must be a system, got {self.goodput_slo_reference!r}")


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    requests: list[BenchRequest]
    run: RunConfig
    systems: tuple[str, ...]


@dataclass
class SuiteResults:
    """Everything the report needs."""

    config: SuiteConfig
    scenarios: dict[str, Scenario]
    runs: dict[tuple[str, str], RunResult] = field(default_factory=dict)
    """(scenario, system) -> run."""
    errors: dict[str, str] = field(default_factory=dict)
    """system -> why it has no (or only some) results."""
    notes: list[str] = field(default_factory=list)
    """What the report should say about how the run went (repeats skipped, ...)."""
    peers: dict[str, str] = field(default_factory=dict)
    """system -> how it was built and configured."""
    meta: dict[str, Any] = field(default_factory=dict)


def family(scenario: str) -> str:
    """A scenario's family: "sweep@1" -> "sweep", "goodput-idle" -> "goodput"."""
    return scenario.split("@")[0].split("-")[0]


def build_scenarios(cfg: SuiteConfig, fmt: PromptFormat, token_range: tuple[int, int]) -> dict[str, Scenario]:
    def pick(*names: str) -> tuple[str, ...]:
        return tuple(name for name in names if name in cfg.systems)

    kw = {"fmt": fmt, "token_range": token_range}
    progress = cfg.progress
    scenarios = [
        Scenario("batch1", "1 stream",
                 random_workload(cfg.batch1_requests, cfg.input_len, cfg.output_len, seed=cfg.seed, **kw),
                 RunConfig(max_concurrency=1, progress=progress),
                 pick(LLAMA_SERVER, TRANSFORMERS, *ENGINES, ONE_P_ONE_D, ONE_P_ONE_D_LEND, COLOCATED)),
        Scenario("streams", f"{cfg.streams} concurrent streams",
                 random_workload(cfg.streams_requests, cfg.input_len, cfg.output_len, seed=cfg.seed + 1, **kw),
                 RunConfig(max_concurrency=cfg.streams, progress=progress),
                 pick(LLAMA_SERVER, TRANSFORMERS, *ENGINES, ONE_P_ONE_D, ONE_P_ONE_D_LEND)),
    ]
    pairs = shared_prefix_workload(cfg.prefix_trials, 2, cfg.prefix_len, 16, 4, seed=cfg.seed + 2, **kw)
    ordered = sorted(pairs.requests, key=lambda r: (r.group_id, r.request_id))
    ordered = [dataclasses.replace(r, session_id=r.group_id) for r in ordered]
    scenarios.append(Scenario("prefix_cache", f"{cfg.prefix_len}-token prefix, cold then cached", ordered,
                              RunConfig(max_concurrency=1, progress=progress),
                              pick(LLAMA_SERVER, ENGINE, ONE_P_ONE_D)))
    shared = shared_prefix_workload(cfg.shared_groups, cfg.shared_per_group, cfg.shared_prefix_len,
                                    cfg.shared_suffix_len, cfg.shared_output_len, seed=cfg.seed + 3, **kw)
    scenarios.append(Scenario("shared_prefix", f"{cfg.shared_groups} system prompts x {cfg.shared_per_group} "
                              f"users, Poisson {cfg.shared_rate:g}/s", shared.requests,
                              RunConfig(request_rate=cfg.shared_rate, seed=cfg.seed, progress=progress),
                              pick(TWO_P_PREFIX, TWO_P_RR)))
    sweep = random_workload(cfg.sweep_requests, cfg.input_len, cfg.output_len, seed=cfg.seed + 4, **kw)
    for rate in cfg.sweep_rates:
        scenarios.append(Scenario(f"sweep@{rate:g}", f"Poisson {rate:g}/s", sweep,
                                  RunConfig(request_rate=rate, max_concurrency=cfg.streams, seed=cfg.seed,
                                            progress=progress),
                                  tuple(s for s in cfg.sweep_systems if s in cfg.systems)))
    scenarios += goodput_scenarios(cfg, fmt, token_range)
    return {s.name: s for s in scenarios if not cfg.only or family(s.name) in cfg.only}


def goodput_scenarios(cfg: SuiteConfig, fmt: PromptFormat, token_range: tuple[int, int]) -> list[Scenario]:
    """The idle probe, then one fresh mixed workload per rate (module docstring; bench.goodput)."""
    systems = tuple(s for s in GOODPUT_SYSTEMS if s in cfg.systems)
    kw = {"fmt": fmt, "token_range": token_range}
    lengths = (cfg.goodput_short_len, cfg.goodput_long_output_len, cfg.goodput_short_output_len)
    num_long, num_short = cfg.goodput_idle_requests
    high = cfg.goodput_long_len[1]
    idle = mixed_workload(num_long + num_short, num_long / (num_long + num_short), (high, high), *lengths,
                          seed=cfg.seed + 5, **kw)
    low_s, high_s = cfg.goodput_long_len
    scenarios = [Scenario("goodput-idle", f"idle probe: {num_long} long ({high} tokens) and {num_short} short "
                          "requests, one at a time", idle, RunConfig(max_concurrency=1, progress=cfg.progress),
                          systems)]
    for i, rate in enumerate(cfg.goodput_rates):
        requests = mixed_workload(cfg.goodput_requests, cfg.goodput_long_fraction, cfg.goodput_long_len, *lengths,
                                  seed=cfg.seed + 10 + i, **kw)
        scenarios.append(Scenario(f"goodput@{rate:g}", f"{low_s}-{high_s}-token prompts among chat turns, Poisson "
                                  f"{rate:g}/s", requests,
                                  RunConfig(request_rate=rate, seed=cfg.seed, progress=cfg.progress), systems))
    return scenarios


def default_out_dir() -> Path:
    return Path("bench/results") / datetime.date.today().isoformat()


# ------------------------------------------------------------------------------------------------ systems
@contextlib.contextmanager
def _llama_server(cfg: SuiteConfig, model_path: Path, ctx_per_slot: int,
                  results: SuiteResults) -> Iterator[tuple[Backend, list[int]]]:
    assert cfg.llama_server is not None
    server = LlamaServer(LlamaServerConfig(cfg.llama_server, model_path, cfg.threads, parallel=cfg.streams,
                                           ctx_per_slot=ctx_per_slot), cfg.out_dir / "logs" / "llama-server.log")
    with server:
        results.peers[LLAMA_SERVER] = (f"`{' '.join(server.argv)}` ({server.version()}); "
                                       f"requests set {json.dumps(server.extra_body)}")
        yield OpenAIBackend(server.base_url, extra_body=server.extra_body, name=LLAMA_SERVER), [server.pid]


def _engine_runs(cfg: SuiteConfig, model_path: Path, system: str, key: str,
                 todo: list[Scenario]) -> tuple[str, dict[str, RunResult]]:
    """Run an in-process engine system's scenarios; called in a fresh process (see _run_system).

    The engine is built with `build_engine` and stepped by EngineBackend's thread, as a worker's EngineLoop does:
    torch's OpenMP state is per thread, and a thread that already ran multi-threaded torch work (this suite's
    main thread has: transformers, the bandwidth probe) slows every matmul of another thread (engine.engine_loop).
    Returns the system's description and its runs by scenario name."""
    fields = ENGINES[system]
    config = EngineConfig(model=str(model_path), num_threads=cfg.threads, kv_cache_memory=cfg.kv_cache_memory,
                          **fields)
    backend = EngineBackend(build_engine(config, progress=False), name=system)
    extra = "".join(f", {name}={value!r}" for name, value in fields.items())
    kept = config.keep_quantized_weights and not config.quantization
    peer = (f"`LLMEngine(EngineConfig(model, num_threads={cfg.threads}, kv_cache_memory={cfg.kv_cache_memory}"
            f"{extra}))` in a process of its own (no RPC), dtype {config.dtype} (float32 on CPU), "
            f"{'the GGUF codes kept' if kept else 'weights requantized'}, "
            f"max_num_seqs {config.max_num_seqs}, prefix caching on")
    runs = {}
    for scenario in todo:
        before = cpumeter.sample()
        run = asyncio.run(run_with(backend, scenario.requests, scenario.run, label=f"{key} {scenario.name}"))
        run.meta["others_cores"] = cpumeter.others_cores(before, cpumeter.sample())
        runs[scenario.name] = run
    return peer, runs


@contextlib.contextmanager
def _cluster(cfg: SuiteConfig, model_path: Path, system: str,
             results: SuiteResults) -> Iterator[tuple[Backend, list[int]]]:
    num_prefill = NUM_PREFILL[system]
    gateway_args: tuple[str, ...] = ()
    engine = EngineConfig(model=str(model_path), kv_cache_memory=cfg.kv_cache_memory)
    if system in (ONE_P_ONE_D_PINNED, ONE_P_ONE_D_LEND):
        gateway_args = ("--local-prefill-threshold", str(cfg.goodput_local_prefill_threshold))
        if cfg.goodput_idle_offload_min_tokens is not None:
            gateway_args += ("--idle-offload-min-tokens", str(cfg.goodput_idle_offload_min_tokens))
    if system in (COLOCATED, COLOCATED_CAPPED) and cfg.goodput_batched_tokens is not None:
        engine = dataclasses.replace(engine, max_num_batched_tokens=cfg.goodput_batched_tokens)
    if system == COLOCATED_CAPPED:
        engine = dataclasses.replace(engine, long_prefill_token_threshold=cfg.goodput_long_prefill_token_threshold)
    if system == ONE_P_ONE_D_LEND:
        engine = dataclasses.replace(engine, max_num_batched_tokens=cfg.goodput_lend_batched_tokens)
    if system in ROUTING:
        if "routing" not in {f.name for f in dataclasses.fields(GatewayConfig)}:
            raise RuntimeError("GatewayConfig has no `routing` field: `pdserve gateway --routing "
                               f"{ROUTING[system]}` is not available, so {system} cannot run")
        gateway_args = ("--routing", ROUTING[system])
    prefill_kv = cfg.shared_prefill_kv_cache_memory if system in ROUTING else None
    config = LocalClusterConfig(num_prefill=num_prefill, num_decode=1, port=0, http_port=-1, num_cpus=cfg.threads,
                                engine=engine, prefill_kv_cache_memory=prefill_kv, gateway_args=gateway_args,
                                pin_workers=system in PINNED, lend_idle_cpus=system == ONE_P_ONE_D_LEND,
                                run_dir=str(cfg.out_dir / "logs" / system))
    threads = divide_threads(cfg.threads, num_prefill + 1)
    pinned = (", pin_workers=True" if config.pin_workers else "") + (", lend_idle_cpus=True"
                                                                      if config.lend_idle_cpus else "")
    budget = (f", max_num_batched_tokens {engine.max_num_batched_tokens}, long_prefill_token_threshold "
              f"{engine.long_prefill_token_threshold}" if system in PINNED else "")
    results.peers[system] = (f"`LocalCluster(num_prefill={num_prefill}, num_decode=1, num_cpus={cfg.threads}{pinned})`"
                             f" (worker threads {threads}, prefill workers first{budget}; gateway args "
                             f"{' '.join(gateway_args) or 'default'}), KV cache {cfg.kv_cache_memory} bytes "
                             + (f"on the decode worker and {prefill_kv} on each prefill worker" if prefill_kv
                                else "per worker")
                             + ", real Redis; client: pdserve.client.AsyncClient over gRPC")
    try:
        with LocalCluster(config) as cluster:
            yield PdserveBackend(cluster.gateway_target, name=system), list(cluster.pids.values())
    finally:  # the logs stay with the results; the stopped cluster's keys, certificates and lock files do not
        shutil.rmtree(Path(config.run_dir) / "pki", ignore_errors=True)
        for lock in Path(config.run_dir).glob("*.busy"):
            lock.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------ running
def run_suite(cfg: SuiteConfig) -> SuiteResults:
    """Run every system through its scenarios; write results.json, the plots and report.md."""
    started = time.perf_counter()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    model_path = resolve_model_path(cfg.model)
    tokenizer = load_model(model_path, with_weights=False).tokenizer
    fmt = TemplateFormat(lambda messages: tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                         lambda text: tokenizer.encode(text, add_special_tokens=False))
    token_range = (max(tokenizer.all_special_ids, default=-1) + 1, tokenizer.vocab_size)
    scenarios = build_scenarios(cfg, fmt, token_range)
    results = SuiteResults(cfg, scenarios)
    machine = roofline.machine_info()
    weights = roofline.weight_bytes_per_token(model_path)
    bandwidth_start = roofline.copy_bandwidth()
    results.meta = {"date": datetime.date.today().isoformat(), "machine": machine.to_dict(),
                    "model": str(model_path), "threads": cfg.threads, "weights": dataclasses.asdict(weights),
                    "token_range": token_range,
                    "suite_config": {k: (str(v) if isinstance(v, Path) else v)
                                     for k, v in dataclasses.asdict(cfg).items()}}
    results.meta.update({"copy_bandwidth_bytes_per_s": bandwidth_start,
                         "copy_bandwidth_start_end": (bandwidth_start, bandwidth_start), "complete": False,
                         "suite_wall_s": 0.0, "load_average_end": os.getloadavg()})
    ctx_per_slot = _round_up(max(r.prompt_len + r.max_tokens for s in scenarios.values() for r in s.requests), 512)

    plan = [(system, [s for s in scenarios.values() if system in s.systems], False) for system in cfg.systems]
    if cfg.repeat_peers:  # a second chance for the peers, in case other jobs slowed their first runs
        plan += [(peer, [s for s in scenarios.values() if s.name in ("batch1", "streams") and peer in s.systems],
                  True) for peer in PEERS if peer in cfg.systems]
    for system, todo, repeat in plan:
        if not todo:
            continue
        key = system + (REPEAT if repeat else "")
        if repeat:
            first = [run.meta.get("others_cores", 0.0) for (name, k), run in results.runs.items()
                     if k == system and name in ("batch1", "streams")]
            if first and max(first) < CONTENDED_CORES:
                results.notes.append(f"{system}: not repeated, other jobs took at most {max(first):.2f} CPUs "
                                     "during its runs")
                continue
        others = cpumeter.wait_quiet(cfg.quiet_wait_s, CONTENDED_CORES)
        results.meta.setdefault("others_cores_before", {})[key] = others
        if repeat and others >= CONTENDED_CORES:
            results.notes.append(f"{system}: not repeated, other jobs kept {others:.2f} CPUs busy after waiting "
                                 f"{cfg.quiet_wait_s:.0f} s (a contended repeat measures nothing new)")
            continue
        _run_system(cfg, model_path, system, key, todo, results, ctx_per_slot)
        results.meta["suite_wall_s"] = time.perf_counter() - started
        results.meta["load_average_end"] = os.getloadavg()
        write_outputs(results)  # after every system, so that a stopped suite still leaves its results

    # the machine is shared: the best of a copy before and one after is the closer to what it can do
    bandwidth_end = roofline.copy_bandwidth()
    results.meta["copy_bandwidth_bytes_per_s"] = max(bandwidth_start, bandwidth_end)
    results.meta["copy_bandwidth_start_end"] = (bandwidth_start, bandwidth_end)
    results.meta["suite_wall_s"] = time.perf_counter() - started
    results.meta["load_average_end"] = os.getloadavg()
    results.meta["complete"] = True
    write_outputs(results)
    return results


def _run_system(cfg: SuiteConfig, model_path: Path, system: str, key: str, todo: list[Scenario],
                results: SuiteResults, ctx_per_slot: int) -> None:
    """Start `system`, run its scenarios (stored under `key`), stop it; a failure is recorded, not raised."""
    log.info("suite: %s (%s)", key, ", ".join(s.name for s in todo))
    try:
        if system == TRANSFORMERS:
            _run_transformers(cfg, model_path, key, todo, results)
            return
        if system == LLAMA_SERVER:
            if cfg.llama_server is None:
                results.errors[key] = ("not run: no llama-server binary (build it with "
                                       "`bash bench/build_llama_server.sh`, pass --llama-server PATH)")
                return
            context = _llama_server(cfg, model_path, ctx_per_slot, results)
        elif system in ENGINES:
            # A spawned process: a clean interpreter whose main thread never ran torch (see _engine_runs), with
            # malloc set up before any other thread starts, as a `pdserve` command's main() does
            spawn = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn,
                                                        initializer=keep_freed_memory_for_reuse) as pool:
                peer, runs = pool.submit(_engine_runs, cfg, model_path, system, key, todo).result()
            results.peers[system] = peer
            results.runs.update({(name, key): run for name, run in runs.items()})
            return
        else:
            context = _cluster(cfg, model_path, system, results)
        with context as (backend, pids):
            for scenario in todo:
                before = cpumeter.sample(pids)
                run = asyncio.run(run_with(backend, scenario.requests, scenario.run, label=f"{key} {scenario.name}"))
                run.meta["others_cores"] = cpumeter.others_cores(before, cpumeter.sample(pids))
                results.runs[(scenario.name, key)] = run
    except Exception as exc:
        results.errors[key] = f"{type(exc).__name__}: {exc}"
        log.error("suite: %s failed:\n%s", key, traceback.format_exc())


def _run_transformers(cfg: SuiteConfig, model_path: Path, key: str, todo: list[Scenario],
                      results: SuiteResults) -> None:
    import transformers  # the peer; imported only when it runs

    model = load_transformers_model(str(model_path), cfg.threads)
    results.peers[TRANSFORMERS] = (f"transformers {transformers.__version__} `AutoModelForCausalLM.from_pretrained"
                                   f"(dir, gguf_file=..., dtype=float32)`, torch threads {cfg.threads}, "
                                   "`generate` greedy with min_new_tokens = max_new_tokens, static batches "
                                   "(left padding)")
    warm = todo[0].requests[:1]
    run_transformers(model, [dataclasses.replace(warm[0], max_tokens=2)], batch_size=1)
    for scenario in todo:
        batch_size = scenario.run.max_concurrency or len(scenario.requests)
        before = cpumeter.sample()
        records, duration = run_transformers(model, scenario.requests, batch_size)
        results.runs[(scenario.name, key)] = RunResult(
            f"{key} {scenario.name}", scenario.run, records, duration, summarize(records, duration),
            meta={"batch_size": batch_size, "arrivals": "all at t0, static batches",
                  "others_cores": cpumeter.others_cores(before, cpumeter.sample())})


def _round_up(n: int, multiple: int) -> int:
    return multiple * math.ceil(n / multiple)


def write_outputs(results: SuiteResults) -> None:
    out = results.config.out_dir
    runs = list(results.runs.values())
    summary = report.goodput_summary(results)
    if summary is not None:
        results.meta["goodput"] = summary
    write_json(out / "results.json", runs, {**results.meta, "errors": results.errors, "notes": results.notes,
                                             "peers": results.peers})
    pngs = {}
    for name in ("batch1", "streams", "shared_prefix"):
        runs_of = {system: r.records for (scenario, system), r in results.runs.items() if scenario == name}
        if runs_of:
            title = f"{results.scenarios[name].title} ({results.meta['model'].rsplit('/', 1)[-1]})"
            pngs[name] = plots.plot_latency_cdfs(runs_of, out / f"latency_{name}.png", title).name
    points: dict[str, list[tuple[float, float, float]]] = {}
    for (scenario, system), run in results.runs.items():
        rate = None
        if scenario.startswith("sweep@"):
            rate = run.config.request_rate
        elif scenario == "streams" and system in results.config.sweep_systems:
            rate = math.inf
        if rate is not None:
            points.setdefault(system, []).append((rate, run.summary.output_throughput,
                                                  run.summary.ttft_ms.percentiles.get("p90", 0.0)))
    if points:
        pngs["throughput_vs_rate"] = plots.plot_throughput_vs_rate(points, out / "throughput_vs_rate.png").name
    if summary is not None and summary["systems"]:
        lines = {system: [(p["rate"], p["goodput"], p["attainment"]) for p in data["points"]]
                 for system, data in summary["systems"].items()}
        low, high = results.config.goodput_long_len
        title = f"goodput, {low}-{high}-token prompts among chat turns ({results.meta['machine']['cpu']})"
        pngs["goodput"] = plots.plot_goodput_vs_rate(lines, out / "goodput_vs_rate.png", title=title).name
    (out / "report.md").write_text(report.render(results, pngs))
