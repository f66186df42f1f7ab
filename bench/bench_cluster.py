"""The cost of disaggregation on this machine: the cluster vs the offline engine, and what the gateway adds.

    python bench/bench_cluster.py [--prompts 12] [--prompt-len 256] [--out bench/results/cluster.md]
    python bench/bench_cluster.py --tpot-vs-engine [--threads 1] [--lend] [--rounds 7] [--new-tokens 64]
                                  [--json bench/figures/1p1d-tpot/DATE-threadsN[-lend].json]

In one run, one request at a time (so the figures are latencies, not queueing), the same token-id prompts,
greedy, EOS ignored, 32 new tokens:
- offline: the engine in this process, 1 thread (each cluster worker also gets 1 of this machine's 2 cores);
- cluster, direct: Reserve / Prefill / Decode called on the workers from this process (no gateway);
- cluster, via gateway: the same through the gateway's public API (client-side timing);
- for both KV transports (shm, grpc): a 1 prefill + 1 decode local cluster with local prefill disabled.
TTFT is the time to the first token, TPOT = (E2EL - TTFT) / (tokens - 1). The gateway's added latency is the
median E2EL via the gateway minus the median E2EL calling the workers directly. KV transfer GB/s is the prefill
worker's reported bytes / transfer time, beside a plain memory copy of the same bytes.

--tpot-vs-engine measures issue 16's goal "1P+1D batch-1 TPOT within 1.1x of the one-process engine with the
same decode threads", for float32 weights and for --keep-quantized-weights: per weights mode one 1P+1D cluster
(every worker `--threads` threads, prefill always on the prefill worker) and one engine (`LLMEngine` stepped by
its own thread in a spawned process of its own, as the serving suite runs it, no RPC, the same threads: in
this process, which has started the cluster and holds gRPC channels, its OpenMP threads spun at 2 threads and
a token took 5x its CPU), and one colocated cluster (one decode worker with the engine's threads, prefilling
locally, behind a gateway of its own: the same serving stack without disaggregation), and the bare token path
of pdserve/bench/bare_token_path.py (a sync grpc server -> a grpc.aio relay -> a sync client in this process, no
pdserve code), then `--rounds` rounds, each one request to the engine, one through the 1P+1D gateway, one
calling the workers directly, one through the colocated gateway, and two more to the engine while the bare
path carries one 48-byte message per token at the engine's token rate, through all three processes (the
gateway's shape) and straight from the source (the direct one's): what Python grpc's message passing alone
costs the step on the same CPUs, beside what the cluster's rows cost it. Every request is on a prompt of its own.
TPOT is taken from the stream: (arrival of the last token - arrival of the first) / (tokens - 1); the ratio
is the median cluster TPOT over the median engine TPOT of the same run (and the median of the per-round
ratios); 1P+1D via its gateway is also divided by colocated via its own, which separates what disaggregation
costs from what serving over gRPC on the same CPUs costs (the client, the gateway and the worker's stream share
them with the decode step). Where the time goes: each request also records the CPU milliseconds per token of
every process ("this process" is the client; engine, gateway, prefill-0, decode-0, redis, the colocated
cluster's "colocated gateway" and "colocated decode-0") and how many CPUs other jobs kept busy meanwhile
(pdserve.bench.cpumeter).

With --lend the cluster is `pdserve up --pin-workers --lend-idle-cpus` on 2 x --threads CPUs: each worker pinned
to --threads CPUs of its own and stepping on the other's while that one idles (engine.cpu_share), so a decode
step between requests' prefills runs on all 2 x --threads; the engine and the colocated worker (pinned to the
same CPUs) then get 2 x --threads threads, the CPUs the decode worker steps on.

The workers are dialled as the cluster's gateway dials them (`worker_channel`): mutual TLS with the gateway's
certificate of the run, or plaintext for a cluster started with insecure_internal.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import datetime
import json
import multiprocessing
import os
import statistics
import threading
import time
from pathlib import Path

import grpc
import torch

from engine.config import EngineConfig
from engine.engine_loop import build_engine
from engine.llm import LLM
from engine.loader import load_model
from engine.model_fetch import fetch_default_model
from engine.sampling_params import SamplingParams
from kvstore.malloc_tuning import keep_freed_memory_for_reuse
from pdserve.bench import cpumeter, roofline
from pdserve.bench.backends import Backend, PdserveBackend, new_record
from pdserve.bench.bare_token_path import BareTokenPath
from pdserve.bench.inprocess import EngineBackend
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import BenchRequest
from pdserve.client import Client
from pdserve.launcher import LocalCluster, LocalClusterConfig
from protos.convert import sampling_to_pb
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from protos.tls import TlsFiles, channel_credentials, channel_options

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def make_prompts(model_path: Path, n: int, length: int) -> list[list[int]]:
    tokenizer = load_model(model_path, with_weights=False).tokenizer
    words = ["river", "stone", "lantern", "orbit", "maple", "quartz", "violet", "ember", "harbor", "cedar", "falcon",
             "meadow"]
    prompts = []
    for i in range(n):
        text = " ".join(words[(i * 7 + j * 3) % len(words)] + str(i * 131 + j) for j in range(length))
        prompts.append(tokenizer.encode(text)[:length])
    return prompts


def summarize(samples: list[tuple[float, float]]) -> dict[str, float]:
    """samples: (ttft_s, e2el_s) per request -> p50/p99 of TTFT, TPOT and E2EL in ms."""
    ttft = sorted(s[0] * 1000 for s in samples)
    tpot = sorted((s[1] - s[0]) * 1000 / (NEW_TOKENS - 1) for s in samples)
    e2el = sorted(s[1] * 1000 for s in samples)

    def pct(values, q):
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]
    return {"ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "tpot_p50": pct(tpot, 0.5),
            "tpot_p99": pct(tpot, 0.99), "e2el_p50": statistics.median(e2el)}


def run_offline(model_path: Path, prompts) -> dict[str, float]:
    torch.set_num_threads(1)
    llm = LLM(model=str(model_path), dtype="float32", kv_cache_memory=256 * 2**20, progress=False)
    llm.generate(prompts[0][:16], SamplingParams(max_tokens=2, temperature=0.0))  # warm up
    samples = []
    for p in prompts:
        start = time.perf_counter()
        first = None
        for _ in llm.stream(p, GREEDY):
            first = first or time.perf_counter()
        samples.append((first - start, time.perf_counter() - start))
    return summarize(samples)


def run_gateway(target: str, prompts, salt: str) -> tuple[dict[str, float], list]:
    samples, timings = [], []
    with Client(target) as client:
        client.complete(prompts[0][:16], max_tokens=2, temperature=0.0, cache_salt="warmup")
        for p in prompts:
            start = time.perf_counter()
            first, last = None, None
            with client.generate(p, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                 cache_salt=salt) as stream:
                for chunk in stream:
                    if chunk.token_ids and first is None:
                        first = time.perf_counter()
                    if chunk.timings is not None:
                        last = chunk
            samples.append((first - start, time.perf_counter() - start))
            timings.append(last.timings)
    return summarize(samples), timings


def worker_channel(endpoint: str, role: str, tls: TlsFiles | None) -> grpc.Channel:
    """A channel to a worker of `role` ("prefill" or "decode") the way the cluster's gateway opens it
    (gateway.worker_client): mutual TLS with `tls`, the gateway's certificate (the one identity the workers let
    call Reserve / Prefill / Decode), the server required to hold a certificate of `role`; plaintext when `tls`
    is None (a cluster with insecure_internal). For a LocalCluster: `cluster.tls_files.get("gateway")`."""
    if tls is None:
        return grpc.insecure_channel(endpoint)
    return grpc.secure_channel(endpoint, channel_credentials(tls), options=channel_options(role))


class DirectWorkers:
    """Reserve / Prefill / Decode called on one prefill and one decode worker from this process (no gateway)."""

    def __init__(self, workers: dict[str, str], tls: TlsFiles | None) -> None:
        self._channels = [worker_channel(next(e for w, e in workers.items() if w.startswith(role)), role, tls)
                          for role in ("prefill", "decode")]
        self.prefill = worker_pb2_grpc.PrefillWorkerStub(self._channels[0])
        self.decode = worker_pb2_grpc.DecodeWorkerStub(self._channels[1])

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams, salt: str,
                 on_tokens=lambda token_ids: None) -> None:
        """One request to its end; `on_tokens(token_ids)` as each piece of output arrives (the first token with
        the prefill worker's answer). Raises grpc.RpcError."""
        req = worker_pb2.WorkerRequest(request_id=request_id, prompt_token_ids=prompt,
                                       sampling=sampling_to_pb(params), cache_salt=salt, seed=0)
        res = self.decode.Reserve(worker_pb2.ReserveRequest(request=req, lease_ms=30_000), timeout=60)
        pre = self.prefill.Prefill(worker_pb2.PrefillRequest(request=req, target=res.target), timeout=60)
        on_tokens([pre.first_token_id])
        for msg in self.decode.Decode(worker_pb2.DecodeRequest(request_id=request_id, handle=res.target.handle,
                                                               first_token_id=pre.first_token_id), timeout=600):
            if msg.token_ids:
                on_tokens(list(msg.token_ids))


def run_direct(workers: dict[str, str], tls: TlsFiles | None, prompts, salt: str) -> dict[str, float]:
    direct = DirectWorkers(workers, tls)
    samples = []
    try:
        for i, p in enumerate(prompts):
            start = time.perf_counter()
            arrivals: list[float] = []
            direct.generate(f"direct-{salt}-{i}", p, GREEDY, salt,
                            lambda token_ids, arrivals=arrivals: arrivals.append(time.perf_counter()))
            samples.append((arrivals[0] - start, time.perf_counter() - start))
    finally:
        direct.close()
    return summarize(samples)


class DirectBackend(Backend):
    """`DirectWorkers` as a benchmark backend (pdserve.bench.backends): the cluster without its gateway."""

    def __init__(self, workers: dict[str, str], tls: TlsFiles | None, name: str = "workers direct") -> None:
        self.workers, self.tls, self.name = workers, tls, name
        self._direct: DirectWorkers | None = None
        self._ids = 0

    async def start(self) -> None:
        self._direct = DirectWorkers(self.workers, self.tls)

    async def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
            self._direct = None

    async def send(self, request: BenchRequest) -> RequestRecord:
        assert self._direct is not None, "start() the backend first"
        record = new_record(request)
        self._ids += 1
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)

        def arrived(token_ids: list[int]) -> None:
            record.chunk_times_s.append(time.perf_counter())
            record.output_len += len(token_ids)
        try:
            await asyncio.to_thread(self._direct.generate, f"direct-{self._ids}", list(request.prompt_ids), params,
                                    "direct", arrived)
        except grpc.RpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"
            return record
        record.success = bool(record.chunk_times_s)
        return record


def copy_gbps(num_bytes: int) -> float:
    src = torch.ones(max(num_bytes // 4, 1))
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    return num_bytes * 10 / (time.perf_counter() - start) / 1e9


_ENGINE_PROCESS: dict = {}
"""In the spawned engine process: its EngineBackend and the event loop that runs its sends."""


def _engine_process_start(config: EngineConfig) -> int:
    backend = EngineBackend(build_engine(config, progress=False), name=ENGINE)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(backend.start())
    _ENGINE_PROCESS.update(backend=backend, loop=loop)
    return os.getpid()


def _engine_process_send(request: BenchRequest) -> RequestRecord:
    return _ENGINE_PROCESS["loop"].run_until_complete(_ENGINE_PROCESS["backend"].send(request))


class EngineProcess(Backend):
    """pdserve.bench.inprocess.EngineBackend in a spawned process of its own (pdserve.bench.suite does the same):
    the records' times are taken there, where each step returns."""

    def __init__(self, config: EngineConfig, name: str = "engine") -> None:
        self.name = name
        # malloc is set up before the engine (torch's import starts a thread), as a `pdserve` command's main() does
        self._pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=keep_freed_memory_for_reuse)
        self.pid = self._pool.submit(_engine_process_start, config).result()

    async def send(self, request: BenchRequest) -> RequestRecord:
        return await asyncio.wrap_future(self._pool.submit(_engine_process_send, request))

    def shutdown(self) -> None:
        self._pool.shutdown()


class EngineBesideBarePath(Backend):
    """The engine process's requests, each run while a bare Python-grpc token stream (pdserve.bench.bare_token_path,
    `hops` processes) carries one message per token at the engine's token rate: the gap between messages is the
    TPOT of this backend's previous request (`gap_s` before the first). The stream starts with the request and is
    cancelled when it ends."""

    def __init__(self, engine: EngineProcess, path: BareTokenPath, hops: int, name: str,
                 gap_s: float = 0.01) -> None:
        self.engine, self.path, self.hops, self.name, self.gap_s = engine, path, hops, name, gap_s

    async def send(self, request: BenchRequest) -> RequestRecord:
        stop = threading.Event()
        streaming = asyncio.get_running_loop().run_in_executor(None, self.path.stream, 1 << 30, self.gap_s,
                                                               self.hops, stop)
        try:
            record = await self.engine.send(request)
        finally:
            stop.set()
            await asyncio.wait([streaming])
        if streaming.exception() is not None:  # the engine ran without the path beside it: not this row's figure
            record.success, record.error = False, f"bare token path: {streaming.exception()!r}"
        elif record.success and record.output_len > 1:
            self.gap_s = record.tpot_s
        return record


WEIGHT_MODES = {"float32": False, "kept GGUF codes": True}
"""Weights mode -> EngineConfig.keep_quantized_weights (the same in the engine and in every worker)."""
ENGINE, GATEWAY, DIRECT = "one-process engine", "1P+1D via gateway", "1P+1D workers direct"
COLOCATED = "colocated via gateway"
BARE_GATEWAY = "engine beside a bare grpc token path, 3 processes"
BARE_DIRECT = "engine beside a bare grpc token path, 2 processes"


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system, all threads) each process has used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    return {name: cpumeter.parse_pid_stat(Path(f"/proc/{pid}/stat").read_text()) / ticks
            for name, pid in pids.items()}


async def interleave(backends: list[Backend], rounds: list[list[BenchRequest]],
                     pids: dict[str, int]) -> list[list[tuple[RequestRecord, dict[str, float]]]]:
    """rounds[i][j]: round i's request for backends[j], sent one at a time, the backends' order rotating by
    round. Round 0 warms every backend up and is left out of the records (per backend, in round order), each
    with the CPU seconds every process of `pids` used during it and "other jobs": the CPUs that processes
    outside `pids` kept busy on average (pdserve.bench.cpumeter)."""
    for backend in backends:
        await backend.start()
    records: list[list[tuple[RequestRecord, dict[str, float]]]] = [[] for _ in backends]
    try:
        for i, requests in enumerate(rounds):
            for k in range(len(backends)):
                j = (i + k) % len(backends)
                cpu_before, machine_before = cpu_seconds(pids), cpumeter.sample(pids.values())
                record = await backends[j].send(requests[j])
                cpu_after, machine_after = cpu_seconds(pids), cpumeter.sample(pids.values())
                if not record.success:
                    raise RuntimeError(f"{backends[j].name}: {record.error}")
                cpu = {name: cpu_after[name] - cpu_before[name] for name in pids}
                cpu["other jobs"] = cpumeter.others_cores(machine_before, machine_after)
                records[j].append((record, cpu))
    finally:
        for backend in backends:
            await backend.close()
    return [r[1:] for r in records]


def tpot_vs_engine(model_path: Path, threads: int, num_rounds: int, prompt_len: int, new_tokens: int,
                   lend: bool = False) -> dict:
    """Issue 16's 1P+1D batch-1 TPOT goal, per weights mode (module docstring). Returns the figures."""
    systems = (ENGINE, GATEWAY, DIRECT, COLOCATED, BARE_GATEWAY, BARE_DIRECT)
    prompts = iter(make_prompts(model_path, (num_rounds + 1) * len(systems) * len(WEIGHT_MODES), prompt_len))
    figures = {"meta": {"date": datetime.date.today().isoformat(), "machine": roofline.machine_info().to_dict(),
                        "model": str(model_path), "threads": threads, "lend": lend, "rounds": num_rounds,
                        "prompt_len": prompt_len, "new_tokens": new_tokens,
                        "openmp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))},
                        "command": f"python bench/bench_cluster.py --tpot-vs-engine --threads {threads} --rounds "
                                   f"{num_rounds} --prompt-len {prompt_len} --new-tokens {new_tokens}"
                                   + (" --lend" if lend else "")},
               "modes": {}}
    for mode, keep in WEIGHT_MODES.items():
        engine_config = EngineConfig(model=str(model_path), dtype="float32", num_threads=threads,
                                     kv_cache_memory=256 * 2**20, keep_quantized_weights=keep)
        cluster_config = LocalClusterConfig(num_prefill=1, num_decode=1, port=0, http_port=-1,
                                            engine=engine_config, gateway_args=("--local-prefill-threshold", "0"),
                                            num_cpus=2 * threads if lend else None, pin_workers=lend,
                                            lend_idle_cpus=lend)
        # The same serving stack without disaggregation: one decode worker with the engine's threads (pinned to
        # the same CPUs with --lend) prefills locally and decodes, behind its own gateway.
        decode_threads = 2 * threads if lend else threads
        colocated_config = dataclasses.replace(
            cluster_config, num_prefill=0, engine=dataclasses.replace(engine_config, num_threads=decode_threads),
            gateway_args=(), lend_idle_cpus=False)
        rounds = [[BenchRequest(f"{mode}-{i}-{j}", tuple(next(prompts)), new_tokens) for j in range(len(systems))]
                  for i in range(num_rounds + 1)]
        with (LocalCluster(cluster_config) as cluster, LocalCluster(colocated_config) as colocated,
              BareTokenPath() as bare):
            engine = EngineProcess(dataclasses.replace(engine_config, num_threads=decode_threads), name=ENGINE)
            try:
                backends = [engine, PdserveBackend(cluster.gateway_target, name=GATEWAY),
                            DirectBackend(cluster.workers, cluster.tls_files.get("gateway"), name=DIRECT),
                            PdserveBackend(colocated.gateway_target, name=COLOCATED),
                            EngineBesideBarePath(engine, bare, 3, BARE_GATEWAY),
                            EngineBesideBarePath(engine, bare, 2, BARE_DIRECT)]
                pids = {"this process": os.getpid(), "engine": engine.pid, **cluster.pids, "redis": cluster.redis_pid,
                        **{f"colocated {name}": pid for name, pid in colocated.pids.items()}, **bare.pids}
                records = asyncio.run(interleave(backends, rounds, pids))
            finally:
                engine.shutdown()
        rows = {}
        for name, measured in zip(systems, records):
            recs = [r for r, _ in measured]
            assert all(r.output_len == new_tokens for r in recs), (name, [r.output_len for r in recs])
            rows[name] = {"tpot_ms": [r.tpot_s * 1000 for r in recs], "ttft_ms": [r.ttft_s * 1000 for r in recs],
                          "tpot_p50_ms": statistics.median(r.tpot_s * 1000 for r in recs),
                          "ttft_p50_ms": statistics.median(r.ttft_s * 1000 for r in recs),
                          "max_itl_p50_ms": statistics.median(max(r.itls_s) * 1000 for r in recs),
                          "other_jobs_cpus_p50": statistics.median(cpu["other jobs"] for _, cpu in measured),
                          "cpu_ms_per_token_p50": {process: statistics.median(cpu[process] * 1000 / new_tokens
                                                                              for _, cpu in measured)
                                                   for process in pids}}
        base = rows[ENGINE]["tpot_p50_ms"]
        for name in (GATEWAY, DIRECT, COLOCATED, BARE_GATEWAY, BARE_DIRECT):
            rows[name]["tpot_ratio"] = rows[name]["tpot_p50_ms"] / base
            rows[name]["tpot_ratio_paired_p50"] = statistics.median(
                c / e for c, e in zip(rows[name]["tpot_ms"], rows[ENGINE]["tpot_ms"]))
        rows[GATEWAY]["tpot_ratio_vs_colocated"] = rows[GATEWAY]["tpot_p50_ms"] / rows[COLOCATED]["tpot_p50_ms"]
        rows[GATEWAY]["tpot_ratio_vs_colocated_paired_p50"] = statistics.median(
            c / e for c, e in zip(rows[GATEWAY]["tpot_ms"], rows[COLOCATED]["tpot_ms"]))
        figures["modes"][mode] = rows
    figures["meta"]["load_average_end"] = list(roofline.machine_info().load_average)
    return figures


def tpot_table(figures: dict) -> str:
    meta = figures["meta"]
    threads = (f"workers pinned to {meta['threads']} CPU(s) each and lending them both ways, the engine "
               f"{2 * meta['threads']} threads" if meta.get("lend") else f"{meta['threads']} decode thread(s)")
    title = (f"1P+1D batch-1 TPOT vs the one-process engine: {meta['machine']['cpu']}, {threads}, "
             f"{meta['rounds']} rounds interleaved, {meta['prompt_len']}-token prompts, "
             f"{meta['new_tokens']} new tokens, load average {meta['machine']['load_average'][0]:.2f} at the start, "
             f"{meta['load_average_end'][0]:.2f} at the end"
             + "".join(f", {k}={v}" for k, v in meta.get("openmp_env", {}).items()))
    header = ("| weights | system | TPOT p50 ms | vs engine (of medians) | vs engine (paired, p50) "
              "| vs colocated (of medians / paired) | TTFT p50 ms | longest gap p50 ms | CPU ms per token (p50) "
              "| other jobs (CPUs) |")
    lines = [title, "", header, "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for mode, rows in figures["modes"].items():
        for name, r in rows.items():
            ratio = f"{r['tpot_ratio']:.3f}x" if "tpot_ratio" in r else "1"
            paired = f"{r['tpot_ratio_paired_p50']:.3f}x" if "tpot_ratio_paired_p50" in r else "1"
            colocated = (f"{r['tpot_ratio_vs_colocated']:.3f}x / {r['tpot_ratio_vs_colocated_paired_p50']:.3f}x"
                         if "tpot_ratio_vs_colocated" in r else "")
            cpu = ", ".join(f"{process} {ms:.1f}" for process, ms in r["cpu_ms_per_token_p50"].items() if ms >= 0.05)
            lines.append(f"| {mode} | {name} | {r['tpot_p50_ms']:.2f} | {ratio} | {paired} | {colocated} | "
                         f"{r['ttft_p50_ms']:.1f} | {r['max_itl_p50_ms']:.1f} | {cpu} | "
                         f"{r['other_jobs_cpus_p50']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--out", default="bench/results/cluster.md")
    parser.add_argument("--tpot-vs-engine", action="store_true",
                        help="measure 1P+1D batch-1 TPOT against the one-process engine instead (module docstring)")
    parser.add_argument("--threads", type=int, default=1, help="--tpot-vs-engine: threads of the engine and of "
                        "each worker")
    parser.add_argument("--lend", action="store_true", help="--tpot-vs-engine: the workers pinned and lending each "
                        "other their idle CPUs, the engine on both workers' CPUs (module docstring)")
    parser.add_argument("--rounds", type=int, default=7, help="--tpot-vs-engine: measured rounds (after one warm-up)")
    parser.add_argument("--new-tokens", type=int, default=64, help="--tpot-vs-engine: tokens per request")
    parser.add_argument("--json", default=None, help="--tpot-vs-engine: where the figures go (default "
                        "bench/figures/1p1d-tpot/DATE-threadsN.json)")
    args = parser.parse_args()

    model_path = fetch_default_model()
    if args.tpot_vs_engine:
        figures = tpot_vs_engine(model_path, args.threads, args.rounds, args.prompt_len, args.new_tokens, args.lend)
        print(tpot_table(figures))
        lend = "-lend" if args.lend else ""
        out = Path(args.json or f"bench/figures/1p1d-tpot/{figures['meta']['date']}-threads{args.threads}{lend}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"figures in {out}")
        return
    prompts = make_prompts(model_path, args.prompts, args.prompt_len)
    rows = {"offline engine (1 thread)": run_offline(model_path, prompts)}
    transfer = {}
    for transport in ("shm", "grpc"):
        config = LocalClusterConfig(
            num_prefill=1, num_decode=1, port=0, http_port=-1, transport=transport, num_cpus=2,
            engine=EngineConfig(model=str(model_path), dtype="float32", kv_cache_memory=256 * 2**20),
            gateway_args=("--local-prefill-threshold", "0"))
        with LocalCluster(config) as cluster:
            rows[f"cluster 1P+1D {transport}, workers direct"] = run_direct(
                cluster.workers, cluster.tls_files.get("gateway"), prompts, f"d-{transport}")
            stats, timings = run_gateway(cluster.gateway_target, prompts, f"g-{transport}")
            rows[f"cluster 1P+1D {transport}, via gateway"] = stats
        moved = [t for t in timings if t.transport == transport and t.transfer_ms > 0]
        num_bytes = statistics.median(t.transfer_bytes for t in moved)
        transfer[transport] = (num_bytes, statistics.median(t.transfer_bytes / t.transfer_ms / 1e6 for t in moved))

    lines = [(f"### Cost of disaggregation ({datetime.date.today()}, {args.prompts} prompts of {args.prompt_len} "
              f"tokens, {NEW_TOKENS} new tokens, one request at a time)"), "",
             "Command: `python bench/bench_cluster.py`", "",
             "| shape | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | E2EL p50 ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | {r['tpot_p50']:.1f} | "
                     f"{r['tpot_p99']:.1f} | {r['e2el_p50']:.1f} |")
    lines.append("")
    for transport in ("shm", "grpc"):
        added = (rows[f"cluster 1P+1D {transport}, via gateway"]["e2el_p50"]
                 - rows[f"cluster 1P+1D {transport}, workers direct"]["e2el_p50"])
        lines.append(f"- Gateway added latency ({transport} cluster): {added:.1f} ms per request (median E2EL via "
                     "the gateway minus median E2EL calling the workers directly).")
    for transport, (num_bytes, gbps) in transfer.items():
        lines.append(f"- KV transfer over {transport}: {num_bytes / 2**20:.1f} MiB per request at {gbps:.2f} GB/s "
                     f"(prefill worker's bytes / transfer time); a plain memory copy of the same bytes: "
                     f"{copy_gbps(int(num_bytes)):.1f} GB/s.")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
