"""What the local cluster (pdserve.launcher) starts, as pure functions of its LocalClusterConfig: each child's
command line and `pdserve` arguments, how the CPU threads are divided among the workers and which CPUs each is
pinned to, and the address to dial for a bind host. No process is started here."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from pdserve.affinity import allowed_cpus, format_cpu_list, split_cpus
from pdserve.cli_args import engine_flags
from pdserve.cluster_config import LocalClusterConfig
from protos.tls import TlsFiles


class ClusterError(RuntimeError):
    """The local cluster could not start (the message names the process and ends with its log's tail)."""


def child_command(argv: list[str]) -> list[str]:
    """The command line that runs `pdserve ARGV` with this interpreter and its installed packages, whatever the
    working directory holds (`-P`: plain `python -m` would put it first on sys.path)."""
    return [sys.executable, "-P", "-m", "pdserve.cli", *argv]


def divide_threads(num_cpus: int, num_workers: int) -> list[int]:
    """Threads for each of `num_workers` processes sharing `num_cpus` CPUs: an even split, the remainder to
    the first ones (prefill workers come first: prefill is the compute-bound phase), never fewer than 1."""
    base, extra = divmod(num_cpus, num_workers)
    return [max(1, base + (i < extra)) for i in range(num_workers)]


def worker_threads(config: LocalClusterConfig, roles: list[str], num_cpus: int) -> list[int]:
    """Threads of each worker's processes (`roles` in start order): the engine's num_threads when set, else
    `num_cpus` divided among all processes, a tensor-parallel worker counting one per rank."""
    if config.engine.num_threads is not None:
        return [config.engine.num_threads] * len(roles)
    ranks = [config.tensor_parallel_size(role) for role in roles]
    per_rank = divide_threads(num_cpus, sum(ranks))
    return [per_rank[sum(ranks[:i])] for i in range(len(roles))]


def available_cpus() -> int:
    """How many CPUs this process may run on (its affinity mask, which containers narrow)."""
    return len(allowed_cpus())


def worker_cpus(config: LocalClusterConfig, threads: list[int],
                allowed: tuple[int, ...]) -> list[tuple[int, ...] | None]:
    """Each worker's CPUs (`threads` in start order): with pin_workers, consecutive slices of the first
    `num_cpus` CPUs of `allowed`, one CPU per thread; else None for every worker. ClusterError when the threads
    do not fit."""
    if not config.pin_workers:
        return [None] * len(threads)
    cpus = allowed[:config.num_cpus] if config.num_cpus is not None else allowed
    if config.num_cpus is not None and config.num_cpus > len(allowed):
        raise ClusterError(f"--pin-workers with --cpus {config.num_cpus}: only {len(allowed)} CPU(s) available "
                           f"({format_cpu_list(allowed)})")
    try:
        return list(split_cpus(cpus, threads))
    except ValueError as exc:
        raise ClusterError(f"--pin-workers: {exc}; lower --threads or the number of workers") from None


def connect_host(bind_host: str) -> str:
    """The address to dial for a server bound to `bind_host` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if bind_host in ("", "0.0.0.0", "::", "[::]") else bind_host


def _cluster_flags(tls: TlsFiles | None) -> list[str]:
    if tls is None:
        return ["--insecure-internal"]
    return ["--cluster-ca", str(tls.ca_path), "--cluster-cert", str(tls.cert_path), "--cluster-key", str(tls.key_path)]


def worker_argv(role: str, worker_id: str, port: int, config: LocalClusterConfig, num_threads: int,
                tls: TlsFiles | None, cpus: tuple[int, ...] | None = None) -> list[str]:
    """`pdserve <role>-worker` arguments for one worker of the local cluster: mutual TLS with `tls`, plaintext
    (--insecure-internal) when None; pinned to `cpus` when given. No Redis URL: the worker reads it from
    PDSERVE_REDIS_URL."""
    engine = dataclasses.replace(config.engine, num_threads=num_threads,
                                 tensor_parallel_size=config.tensor_parallel_size(role))
    if role == "prefill" and config.prefill_kv_cache_memory is not None:
        engine = dataclasses.replace(engine, kv_cache_memory=config.prefill_kv_cache_memory)
    if role == "prefill":  # it runs no decode steps: a compiled one would only delay its start
        engine = dataclasses.replace(engine, compile_decode=False)
    argv = [f"{role}-worker", "--worker-id", worker_id, "--host", "127.0.0.1", "--port", str(port),
            *_cluster_flags(tls), *engine_flags(engine)]
    if role == "prefill":
        argv += ["--transport", config.transport, "--codec", config.codec]
    if cpus is not None:
        argv += ["--cpu-affinity", format_cpu_list(cpus)]
    return argv


def lending_flags(config: LocalClusterConfig, roles: list[str], worker_ids: list[str],
                  cpus: list[tuple[int, ...] | None], run_dir: Path) -> list[list[str]]:
    """Each worker's CPU-lending flags (`roles`, `worker_ids`, `cpus` in start order; engine.cpu_share): with
    config.lend_idle_cpus, prefill worker i and decode worker i each hold a busy lock in `run_dir` and borrow the
    other's CPUs (workers without a partner get none); else none."""
    flags: list[list[str]] = [[] for _ in roles]
    if not config.lend_idle_cpus:
        return flags
    prefill = [i for i, role in enumerate(roles) if role == "prefill"]
    decode = [i for i, role in enumerate(roles) if role == "decode"]
    for p, d in zip(prefill, decode):
        if cpus[d] is None or cpus[p] is None:
            raise ClusterError("--lend-idle-cpus lends pinned CPUs: it needs --pin-workers")
        locks = {i: str(run_dir / f"{worker_ids[i]}.busy") for i in (p, d)}
        for me, partner in ((p, d), (d, p)):
            flags[me] = ["--busy-lock", locks[me], "--borrow-cpus", format_cpu_list(cpus[partner]),
                         "--borrow-lock", locks[partner]]
    return flags


def gateway_argv(config: LocalClusterConfig, port: int, http_port: int | None, tls: TlsFiles | None) -> list[str]:
    """`pdserve gateway` arguments for the local cluster's gateway (the workers' model, block size and context,
    the API key file and public TLS when configured, mutual TLS toward the workers with `tls`, plaintext when
    None); `http_port` None takes config.http_port. No Redis URL: the gateway reads it from PDSERVE_REDIS_URL."""
    http_port = config.http_port if http_port is None else http_port
    argv = ["gateway", "--host", config.host, "--port", str(port), "--http-port", str(http_port),
            "--model", config.engine.model, "--block-size", str(config.engine.block_size), *_cluster_flags(tls)]
    if config.api_key_file is not None:
        argv += ["--api-key-file", config.api_key_file]
    if config.allow_unauthenticated:
        argv += ["--allow-unauthenticated"]
    if config.tls_cert is not None:
        argv += ["--tls-cert", config.tls_cert, "--tls-key", str(config.tls_key)]
    if config.engine.max_model_len is not None:
        argv += ["--max-model-len", str(config.engine.max_model_len)]
    if config.engine.quantization is not None:
        argv += ["--quantization", config.engine.quantization]
    return argv + list(config.gateway_args)
