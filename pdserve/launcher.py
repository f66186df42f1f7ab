"""`LocalCluster`: the whole disaggregated deployment on one machine, as real processes (`pdserve up`).

    with LocalCluster(LocalClusterConfig(num_prefill=1, num_decode=1)) as cluster:
        print(Client(cluster.gateway_target).complete_chat([{"role": "user", "content": "Hi"}]).text)

Start order: a real redis-server (EmbeddedRedis, unless `redis_url` names one), then every worker at once
(`python -m pdserve.cli prefill-worker|decode-worker ...`, each with its own log file under the run directory,
a port picked up front and its share of the CPU threads), then, once every worker answers grpc.health.v1
SERVING, the gateway (gRPC on `port`: `gateway_target`; OpenAI-compatible HTTP on `http_port`: `http_url`). A process
that exits while starting, or a start that outlasts `start_timeout_s`, raises
ClusterError with the tail of the culprit's log, after stopping everything already started.

Stop order is the reverse: the gateway first (it stops admitting and drains), then the workers, each SIGTERM
then SIGKILL after `stop_timeout_s`, then Redis. A second Ctrl-C while stopping skips to SIGKILL. No process
outlives the cluster: stop() runs on leaving the `with` block (exceptions and Ctrl-C included), at interpreter
exit, and when start() fails halfway; and every server child holds the read end of a pipe whose only writer is
this process, so if this process dies without cleaning up (SIGKILL) they see EOF and stop themselves.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from pdserve import health
from pdserve.cli_args import engine_flags
from prefill_worker.config import CODECS, TRANSPORTS

log = logging.getLogger(__name__)

_POLL_S = 0.25
_LOG_TAIL_LINES = 40
# Kills the embedded redis-server's process group once the launcher's end of the pipe closes without a clean
# stop (a clean stop kills this reaper first). redis-server cannot watch the pipe itself.
_REDIS_REAPER = """
import os, signal, sys
fd, pgid = int(sys.argv[1]), int(sys.argv[2])
while os.read(fd, 1):
    pass
try:
    os.killpg(pgid, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


class ClusterError(RuntimeError):
    """The local cluster could not start (the message names the process and ends with its log's tail)."""


@dataclass(frozen=True)
class LocalClusterConfig:
    """What `pdserve up` starts."""

    num_prefill: int = 1
    """Prefill worker processes (0: every prompt is prefilled on its decode worker)."""
    num_decode: int = 1
    """Decode worker processes."""
    host: str = "127.0.0.1"
    """Address the gateway binds (workers and Redis always bind 127.0.0.1)."""
    port: int = 50051
    """Port of the gateway's public gRPC API (0 picks a free one)."""
    http_port: int = 8000
    """Port of the gateway's OpenAI-compatible HTTP API (0 picks a free one, -1 turns it off)."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model="default"))
    """Engine of every worker. When its num_threads is None, the CPUs are divided among the workers."""
    prefill_kv_cache_memory: int | None = None
    """KV-cache bytes of each prefill worker; None takes engine.kv_cache_memory. A prefill worker holds only the
    prompts it is computing plus the prefixes it keeps for reuse; a decode worker holds every running sequence."""
    transport: str = "auto"
    """KV transport of the prefill workers (see PrefillWorkerConfig.transport)."""
    codec: str = "raw"
    """KV wire codec of the prefill workers (see PrefillWorkerConfig.codec)."""
    gateway_args: tuple[str, ...] = ()
    """Extra `pdserve gateway` flags, e.g. ("--local-prefill-threshold", "0")."""
    redis_url: str | None = None
    """Use this Redis instead of starting an embedded redis-server."""
    run_dir: str | None = None
    """Directory for the processes' logs (kept); None uses a temporary one, removed after a clean stop."""
    num_cpus: int | None = None
    """CPUs to divide among the workers; None counts those this process may run on."""
    start_timeout_s: float = 600.0
    """Bound on the whole start (loading the model included)."""
    stop_timeout_s: float = 20.0
    """How long each stage of the stop waits after SIGTERM before SIGKILL."""

    def __post_init__(self) -> None:
        if self.num_prefill < 0:
            raise ValueError(f"LocalClusterConfig.num_prefill must be >= 0, got {self.num_prefill}")
        if self.num_decode < 1:
            raise ValueError(f"LocalClusterConfig.num_decode must be >= 1, got {self.num_decode}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"LocalClusterConfig.port must be in [0, 65535], got {self.port}")
        if not -1 <= self.http_port < 65536:
            raise ValueError(f"LocalClusterConfig.http_port must be in [0, 65535], or -1 for no HTTP API, "
                             f"got {self.http_port}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"LocalClusterConfig.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.codec not in CODECS:
            raise ValueError(f"LocalClusterConfig.codec must be one of {CODECS}, got {self.codec!r}")
        if self.prefill_kv_cache_memory is not None and self.prefill_kv_cache_memory < 1:
            raise ValueError(f"LocalClusterConfig.prefill_kv_cache_memory must be >= 1 byte, "
                             f"got {self.prefill_kv_cache_memory}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"LocalClusterConfig.num_cpus must be >= 1, got {self.num_cpus}")
        if self.start_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("LocalClusterConfig.start_timeout_s and stop_timeout_s must be positive")


def divide_threads(num_cpus: int, num_workers: int) -> list[int]:
    """Threads for each of `num_workers` processes sharing `num_cpus` CPUs: an even split, the remainder to
    the first ones (prefill workers come first: prefill is the compute-bound phase), never fewer than 1."""
    base, extra = divmod(num_cpus, num_workers)
    return [max(1, base + (i < extra)) for i in range(num_workers)]


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers narrow), else os.cpu_count()."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def connect_host(bind_host: str) -> str:
    """The address to dial for a server bound to `bind_host` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if bind_host in ("", "0.0.0.0", "::", "[::]") else bind_host


@dataclass
class _Child:
    name: str
    process: subprocess.Popen
    endpoint: str
    log_path: Path


class LocalCluster:
    """Redis + prefill workers + decode workers + gateway as child processes; a context manager."""

    def __init__(self, config: LocalClusterConfig | None = None) -> None:
        self.config = config or LocalClusterConfig()
        self._redis = None
        self._redis_reaper: subprocess.Popen | None = None
        self._redis_url: str | None = None
        self._workers: list[_Child] = []
        self._gateway: _Child | None = None
        self._http_port: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._run_dir: Path | None = None
        self.keep_run_dir = self.config.run_dir is not None
        """Keep the run directory (the logs) after stop(); set when start() fails."""

    # -------------------------------------------------------------------------------------------- state
    @property
    def gateway_target(self) -> str:
        """host:port of the gateway's public API."""
        assert self._gateway is not None, "the cluster is not started"
        return self._gateway.endpoint

    @property
    def http_url(self) -> str | None:
        """Base URL of the gateway's OpenAI-compatible HTTP API (http://host:port); None when it is off."""
        assert self._gateway is not None, "the cluster is not started"
        if self._http_port is None:
            return None
        host = connect_host(self.config.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self._http_port}"

    @property
    def workers(self) -> dict[str, str]:
        """Worker id -> host:port, prefill workers first."""
        return {child.name: child.endpoint for child in self._workers}

    @property
    def redis_url(self) -> str:
        assert self._redis_url is not None, "the cluster is not started"
        return self._redis_url

    @property
    def run_dir(self) -> Path:
        assert self._run_dir is not None, "the cluster is not started"
        return self._run_dir

    @property
    def log_paths(self) -> dict[str, Path]:
        """Process name -> its log file."""
        return {child.name: child.log_path for child in self._children()}

    @property
    def pids(self) -> dict[str, int]:
        """Process name -> pid of the gateway and the workers."""
        return {child.name: child.process.pid for child in self._children()}

    # -------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> LocalCluster:
        """Start everything and wait until all of it is SERVING; on any failure stop what started and raise.
        A LocalCluster starts once; after stop() it still reports what ran (endpoints, pids, logs)."""
        if self._run_dir is not None:
            raise RuntimeError("this LocalCluster was already started; create a new one")
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.keep_run_dir = True  # the logs explain the failure
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every process (gateway, workers, Redis), each SIGTERM then SIGKILL; idempotent."""
        atexit.unregister(self.stop)
        interrupted = False
        if self._gateway is not None:
            interrupted = _terminate([self._gateway], self.config.stop_timeout_s, force=interrupted)
        interrupted = _terminate(self._workers, self.config.stop_timeout_s, force=interrupted) or interrupted
        if self._redis_reaper is not None:
            self._redis_reaper.kill()
            self._redis_reaper.wait()
            self._redis_reaper = None
        if self._redis is not None:
            self._redis.close()
            self._redis = None
        if self._pipe is not None:
            for fd in self._pipe:
                _close_fd(fd)
            self._pipe = None
        if self._run_dir is not None and not self.keep_run_dir:
            shutil.rmtree(self._run_dir, ignore_errors=True)
        if interrupted:
            raise KeyboardInterrupt

    def wait(self, timeout: float | None = None) -> tuple[str, int] | None:
        """Block until a child process exits; (its name, its exit code), or None after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            for child in self._children():
                code = child.process.poll()
                if code is not None:
                    return child.name, code
            if self._redis is not None and not self._redis.running:
                return "redis", -1
            time.sleep(_POLL_S)
        return None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -------------------------------------------------------------------------------------------- internals
    def _start(self) -> None:
        config = self.config
        deadline = time.monotonic() + config.start_timeout_s
        self._run_dir = Path(config.run_dir) if config.run_dir else Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self._run_dir.mkdir(parents=True, exist_ok=True)
        if config.engine.model == "default":  # once here, rather than every worker racing to download it
            from engine.model_fetch import fetch_default_model

            fetch_default_model()
        self._pipe = os.pipe()
        num_workers = config.num_prefill + config.num_decode
        *ports, free_grpc, free_http = _free_ports(num_workers + 2)      # the workers', then the gateway's
        gateway_port = _check_port_free(config.host, config.port, "--port") if config.port else free_grpc
        if config.http_port > 0:
            self._http_port = _check_port_free(config.host, config.http_port, "--http-port")
        elif config.http_port == 0:
            self._http_port = free_http
        if config.redis_url is None:
            from kvstore.embedded_redis import EmbeddedRedis

            self._redis = EmbeddedRedis().start()
            self._redis_url = self._redis.url
            redis_pid = self._redis.pid  # EmbeddedRedis starts it as the leader of its own group
            self._redis_reaper = subprocess.Popen(
                [sys.executable, "-c", _REDIS_REAPER, str(self._pipe[0]), str(redis_pid)],
                stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(self._pipe[0],))
        else:
            self._redis_url = config.redis_url

        if config.engine.num_threads is not None:
            threads = [config.engine.num_threads] * num_workers
        else:
            threads = divide_threads(config.num_cpus or available_cpus(), num_workers)
        roles = ["prefill"] * config.num_prefill + ["decode"] * config.num_decode
        indexes = list(range(config.num_prefill)) + list(range(config.num_decode))
        for role, index, port, num_threads in zip(roles, indexes, ports, threads):
            worker_id = f"{role}-{index}"
            argv = worker_argv(role, worker_id, port, self._redis_url, config, num_threads)
            self._workers.append(self._spawn(worker_id, argv, f"127.0.0.1:{port}"))
        _wait_serving(self._workers, deadline)

        argv = gateway_argv(config, gateway_port, self._redis_url,
                            -1 if self._http_port is None else self._http_port)
        self._gateway = self._spawn("gateway", argv, f"{connect_host(config.host)}:{gateway_port}")
        _close_fd(self._pipe[0])  # every server child holds its copy of the read end now
        self._pipe = (-1, self._pipe[1])
        _wait_serving([self._gateway], deadline)
        log.info("local cluster up: gateway %s, workers %s, redis %s", self.gateway_target, self.workers,
                 self._redis_url)

    def _spawn(self, name: str, argv: list[str], endpoint: str) -> _Child:
        assert self._pipe is not None and self._run_dir is not None
        read_fd = self._pipe[0]
        log_path = self._run_dir / f"{name}.log"
        command = [sys.executable, "-m", "pdserve.cli", *argv, "--parent-pipe-fd", str(read_fd)]
        with open(log_path, "ab") as log_file:
            # A session of its own: the terminal's Ctrl-C reaches only us, and we stop the children in order.
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                       start_new_session=True, pass_fds=(read_fd,))
        log.info("started %s (pid %d) at %s, log %s", name, process.pid, endpoint, log_path)
        return _Child(name, process, endpoint, log_path)

    def _children(self) -> list[_Child]:
        return self._workers + ([self._gateway] if self._gateway is not None else [])


def worker_argv(role: str, worker_id: str, port: int, redis_url: str, config: LocalClusterConfig,
                num_threads: int) -> list[str]:
    """`pdserve <role>-worker` arguments for one worker of the local cluster."""
    engine = dataclasses.replace(config.engine, num_threads=num_threads)
    if role == "prefill" and config.prefill_kv_cache_memory is not None:
        engine = dataclasses.replace(engine, kv_cache_memory=config.prefill_kv_cache_memory)
    argv = [f"{role}-worker", "--worker-id", worker_id, "--host", "127.0.0.1", "--port", str(port),
            "--redis-url", redis_url, *engine_flags(engine)]
    if role == "prefill":
        argv += ["--transport", config.transport, "--codec", config.codec]
    return argv


def gateway_argv(config: LocalClusterConfig, port: int, redis_url: str, http_port: int | None = None) -> list[str]:
    """`pdserve gateway` arguments for the local cluster's gateway (the workers' model, block size and context);
    `http_port` None takes config.http_port."""
    http_port = config.http_port if http_port is None else http_port
    argv = ["gateway", "--host", config.host, "--port", str(port), "--http-port", str(http_port),
            "--redis-url", redis_url, "--model", config.engine.model, "--block-size", str(config.engine.block_size)]
    if config.engine.max_model_len is not None:
        argv += ["--max-model-len", str(config.engine.max_model_len)]
    if config.engine.quantization is not None:
        argv += ["--quantization", config.engine.quantization]
    return argv + list(config.gateway_args)


def _wait_serving(children: list[_Child], deadline: float) -> None:
    pending = list(children)
    while pending:
        for child in list(pending):
            code = child.process.poll()
            if code is not None:
                raise ClusterError(f"{child.name} exited with code {code} while starting; "
                                   f"last lines of {child.log_path}:\n{_log_tail(child.log_path)}")
            if health.check(child.endpoint, timeout=1.0):
                log.info("%s is SERVING at %s", child.name, child.endpoint)
                pending.remove(child)
        if pending and time.monotonic() > deadline:
            child = pending[0]
            raise ClusterError(f"{', '.join(c.name for c in pending)} not SERVING before the start timeout; "
                               f"last lines of {child.log_path}:\n{_log_tail(child.log_path)}")
        if pending:
            time.sleep(_POLL_S)


def _terminate(children: list[_Child], timeout_s: float, force: bool) -> bool:
    """SIGTERM (SIGKILL when `force`) each live child's process group and wait up to `timeout_s` for every
    group to empty: a server's helpers (multiprocessing's resource tracker, which unlinks shared memory a dying
    worker leaked) outlive it briefly. Then SIGKILL what is left and reap it. Returns True when a
    KeyboardInterrupt cut the graceful wait short."""
    interrupted = False
    _signal_all(children, signal.SIGKILL if force else signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    try:
        for child in children:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while any(_group_exists(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.05)
    except KeyboardInterrupt:
        interrupted = True
    stragglers = [child for child in children if child.process.poll() is None]
    for child in stragglers:
        log.warning("%s did not stop after SIGTERM; killing it", child.name)
    _signal_all(stragglers, signal.SIGKILL)
    for child in stragglers:
        child.process.wait()
    for child in children:
        if _group_exists(child):
            log.warning("killing what is left of %s's process group", child.name)
            _killpg(child.process.pid, signal.SIGKILL)
    return interrupted


def _group_exists(child: _Child) -> bool:
    try:
        os.killpg(child.process.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the id now belongs to a group that is not ours
        return False
    return True


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _signal_all(children: list[_Child], sig: int) -> None:
    for child in children:
        if child.process.poll() is None:  # not reaped, so its pid (= its process group id) is still its own
            _killpg(child.process.pid, sig)


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 right now (all sockets held open together, then released)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _check_port_free(host: str, port: int, flag: str) -> int:
    # gRPC servers bind with SO_REUSEPORT, so a busy port would not fail the gateway: it would share it.
    bind_host = host.strip("[]")
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            reason = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise ClusterError(f"cannot use {host}:{port} for the gateway ({reason}); pick another with {flag} "
                               "(0 picks a free one)") from None
    return port


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(lines[-_LOG_TAIL_LINES:]) or "(empty log)"


def _close_fd(fd: int) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
