"""`LocalCluster`: the whole disaggregated deployment on one machine, as real processes (`pdserve up`).

    with LocalCluster(LocalClusterConfig(num_prefill=1, num_decode=1)) as cluster:
        print(Client(cluster.gateway_target).complete_chat([{"role": "user", "content": "Hi"}]).text)

Start order: a real redis-server (EmbeddedRedis, unless `redis_url` names one), a cluster CA and one certificate
per process in `<run dir>/pki` (protos.tls: the gateway, each worker under its id, and `probe`, the identity of
the launcher's own health checks), then every worker at once
(`pdserve prefill-worker|decode-worker ...`, each with its own log file under the run directory, a port picked up
front, its share of the CPU threads and its --cluster-ca/--cluster-cert/--cluster-key), then, once every worker
answers grpc.health.v1 SERVING over mutual TLS to the probe certificate, the gateway (gRPC on `port`:
`gateway_target`; OpenAI-compatible HTTP on `http_port`: `http_url`; API keys and public TLS when configured).
`insecure_internal` starts everything plaintext instead, with a warning. The Redis URL (and its password)
reaches every process in its environment as PDSERVE_REDIS_URL, never on a command line. A process that exits while
starting, or a start that outlasts `start_timeout_s`, raises ClusterError with the tail of the culprit's log, after
stopping everything already started. Children run `python -P -m pdserve.cli`, so a `pdserve/`
folder in the working directory never shadows the installed package.

While it runs, a supervisor thread keeps the cluster up: a dead embedded redis-server is restarted on the same
port (workers re-register and re-publish their cached blocks on reconnect; routing is load-only meanwhile); a dead
worker is reported (logged with its log's tail, and in `exits`) and, with `restart_workers`, started again with
the same id, port and flags. `wait()` returns when the cluster can no longer serve: the gateway exited, or no
decode worker is left and none will be restarted.

Stop order is the reverse: the supervisor, the gateway (it stops admitting and drains), the workers, each SIGTERM
then SIGKILL after `stop_timeout_s`, then Redis. A second Ctrl-C while stopping skips to SIGKILL. No process
outlives the cluster, and nothing it made stays on disk: stop() runs on leaving the `with` block (exceptions and
Ctrl-C included), at interpreter exit, and when start() fails halfway; and every child holds the read end of a
pipe whose only writer is this process, so if this process dies without cleaning up (SIGKILL) the servers see EOF
and stop themselves, and a reaper process kills redis-server and removes its data directory (and the run
directory, when it is a temporary one).
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from engine.model_fetch import fetch_default_model
from kvstore.embedded_redis import EmbeddedRedis, free_ports
from kvstore.index import redacted_url
from pdserve import health
from pdserve.affinity import allowed_cpus
from pdserve.cli_args import REDIS_URL_ENV
from pdserve.cluster_config import LocalClusterConfig
from pdserve.launch_plan import (ClusterError, available_cpus, child_command, connect_host, gateway_argv,
                                 lending_flags, worker_argv, worker_cpus, worker_threads)
from pdserve.pki import write_public_tls
from protos.tls import TlsFiles, write_cluster_pki

log = logging.getLogger(__name__)

_POLL_S = 0.25
_LOG_TAIL_LINES = 40
_RESTART_BACKOFF_S = 0.5
"""First delay before restarting a dead worker; it doubles (up to _RESTART_BACKOFF_MAX_S) while the worker keeps
dying within _RESTART_STABLE_S of its start."""
_RESTART_BACKOFF_MAX_S = 30.0
_RESTART_STABLE_S = 60.0
# Runs in a session of its own, holding the read end of the launcher's pipe. On EOF without a clean stop (a clean
# stop kills this reaper first) it kills the embedded redis-server's process group (redis-server cannot watch the
# pipe itself) and removes the directories the launcher would have removed. `-I`: nothing from the working
# directory or the environment can shadow the few stdlib modules it imports.
_REAPER = """
import os, shutil, signal, sys
fd, pgid, dirs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
while os.read(fd, 1):
    pass
if pgid > 0:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
for path in dirs:
    shutil.rmtree(path, ignore_errors=True)
"""
@dataclass
class _Child:
    name: str
    argv: list[str]
    """`pdserve` arguments (without --parent-pipe-fd): a restart runs the same."""
    endpoint: str
    log_path: Path
    process: subprocess.Popen
    started_at: float
    failures: int = 0
    """Consecutive deaths within _RESTART_STABLE_S of a start."""
    restart_at: float | None = None
    """Monotonic time of a pending restart; None when running or not to be restarted."""
    exit_seen: bool = False
    health_credentials: health.Credentials | None = None
    """How the launcher reaches the child's health service (None: plaintext)."""


class LocalCluster:
    """Redis + prefill workers + decode workers + gateway as child processes; a context manager."""

    def __init__(self, config: LocalClusterConfig | None = None) -> None:
        self.config = config or LocalClusterConfig()
        """What runs; with `tls`, start() fills in tls_cert, tls_key and ca_cert with the certificate it made."""
        self._redis: EmbeddedRedis | None = None
        self._reaper: subprocess.Popen | None = None
        self._redis_url: str | None = None
        self._child_env: dict[str, str] = {}
        self._pki: dict[str, TlsFiles] = {}
        self._workers: list[_Child] = []
        self._gateway: _Child | None = None
        self._http_port: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._run_dir: Path | None = None
        self._temporary_run_dir = False
        self._supervisor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._down: tuple[str, int] | None = None
        self._exits: list[tuple[str, int]] = []
        self._restarts: dict[str, int] = {}
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
        """Base URL of the gateway's OpenAI-compatible HTTP API (http://host:port, https:// with public TLS); None
        when it is off."""
        assert self._gateway is not None, "the cluster is not started"
        if self._http_port is None:
            return None
        host = connect_host(self.config.host)
        scheme = "https" if self.config.tls_cert else "http"
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{self._http_port}"

    @property
    def workers(self) -> dict[str, str]:
        """Worker id -> host:port, prefill workers first."""
        return {child.name: child.endpoint for child in self._workers}

    @property
    def redis_url(self) -> str:
        assert self._redis_url is not None, "the cluster is not started"
        return self._redis_url

    @property
    def redis_pid(self) -> int | None:
        """Pid of the embedded redis-server now (it changes when the supervisor restarts it); None when the
        cluster uses an external Redis or the server is down."""
        return self._redis.pid if self._redis is not None else None

    @property
    def tls_files(self) -> dict[str, TlsFiles]:
        """Process name ("gateway", worker ids, "probe") -> its cluster certificate, key and CA; empty with
        insecure_internal."""
        return dict(self._pki)

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
        """Process name -> pid of the gateway and the workers (a restarted worker's new pid)."""
        return {child.name: child.process.pid for child in self._children()}

    @property
    def exits(self) -> list[tuple[str, int]]:
        """Every exit the supervisor saw while the cluster ran, in order: (process name, exit code); "redis" for
        the embedded redis-server (code -1: it is not our child to reap)."""
        return list(self._exits)

    @property
    def restarts(self) -> dict[str, int]:
        """Process name ("redis" included) -> how many times the supervisor restarted it."""
        return dict(self._restarts)

    # -------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> LocalCluster:
        """Start everything and wait until all of it is SERVING, then supervise it; on any failure stop what
        started and raise. A LocalCluster starts once; after stop() it still reports what ran (endpoints, pids,
        logs, exits)."""
        if self._run_dir is not None:
            raise RuntimeError("this LocalCluster was already started; create a new one")
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.keep_run_dir = True  # the logs explain the failure
            self.stop()
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="cluster-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def stop(self) -> None:
        """Stop the supervisor, then every process (gateway, workers, Redis), each SIGTERM then SIGKILL; idempotent."""
        atexit.unregister(self.stop)
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()  # a pass in progress finishes (a restart it began included)
        interrupted = False
        if self._gateway is not None:
            interrupted = _terminate([self._gateway], self.config.stop_timeout_s, force=interrupted)
        interrupted = _terminate(self._workers, self.config.stop_timeout_s, force=interrupted) or interrupted
        self._stop_reaper()
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
        """Block until the cluster can no longer serve: (the name and exit code of the process that ended it: the
        gateway, or the last decode worker), or None after `timeout` seconds. Dead workers the supervisor
        restarts, or that leave a decode worker alive, and a dead Redis (restarted) do not end the wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._down is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if self._supervisor is None or not self._supervisor.is_alive():
                break
            time.sleep(_POLL_S)
        return self._down

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -------------------------------------------------------------------------------------------- internals
    def _start(self) -> None:
        config = self.config
        deadline = time.monotonic() + config.start_timeout_s
        if config.run_dir:
            self._run_dir = Path(config.run_dir)
        else:
            self._run_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
            self._temporary_run_dir = True
        self._run_dir.mkdir(parents=True, exist_ok=True)
        if config.engine.model == "default":  # once here, rather than every worker racing to download it
            fetch_default_model()
        self._pipe = os.pipe()
        num_workers = config.num_prefill + config.num_decode
        ports = free_ports(num_workers)
        gateway_port = _check_port_free(config.host, config.port, "--port") if config.port else 0
        if config.http_port > 0:
            self._http_port = _check_port_free(config.host, config.http_port, "--http-port")
        if config.redis_url is None:
            self._redis = EmbeddedRedis().start()
            self._redis_url = self._redis.url
        else:
            self._redis_url = config.redis_url
        self._start_reaper()
        self._child_env = {**os.environ, REDIS_URL_ENV: self._redis_url}

        roles = ["prefill"] * config.num_prefill + ["decode"] * config.num_decode
        threads = worker_threads(config, roles, config.num_cpus or available_cpus())
        cpus = worker_cpus(config, threads, allowed_cpus())
        indexes = list(range(config.num_prefill)) + list(range(config.num_decode))
        worker_ids = [f"{role}-{index}" for role, index in zip(roles, indexes)]
        if config.insecure_internal:
            log.warning("--insecure-internal: the workers and the gateway talk plaintext without authentication; "
                        "any local process may call every internal RPC")
        else:
            self._pki = write_cluster_pki(self._run_dir / "pki", [("gateway", "gateway"), *zip(roles, worker_ids),
                                                                 ("probe", "probe")])
        if config.tls:
            pki_dir = self._run_dir / "pki"
            pki_dir.mkdir(mode=0o700, exist_ok=True)
            host = connect_host(config.host)
            public = write_public_tls(pki_dir, hosts=[] if host in ("127.0.0.1", "localhost") else [host])
            config = self.config = dataclasses.replace(config, tls=False, tls_cert=str(public.cert_path),
                                                       tls_key=str(public.key_path), ca_cert=str(public.ca_path))
        probe = self._pki.get("probe")
        lending = lending_flags(config, roles, worker_ids, cpus, self._run_dir)
        for role, worker_id, port, num_threads, pinned, lend in zip(roles, worker_ids, ports, threads, cpus, lending):
            argv = worker_argv(role, worker_id, port, config, num_threads, self._pki.get(worker_id), pinned) + lend
            credentials = health.Credentials.cluster(probe, server_role=role) if probe else None
            self._workers.append(self._spawn(worker_id, argv, f"127.0.0.1:{port}", credentials))
        _wait_serving(self._workers, deadline)

        # The gateway's free ports are picked only now: picked at the start, one was taken meanwhile as the local
        # port of a connection the start made (every one draws from the same ephemeral range), and the gateway
        # failed to bind it.
        free_grpc, free_http = free_ports(2)
        gateway_port = gateway_port or free_grpc
        if config.http_port == 0:
            self._http_port = free_http
        argv = gateway_argv(config, gateway_port, -1 if self._http_port is None else self._http_port,
                            self._pki.get("gateway"))
        credentials = health.Credentials.public(config.ca_cert) if config.tls_cert else None
        self._gateway = self._spawn("gateway", argv, f"{connect_host(config.host)}:{gateway_port}", credentials)
        _wait_serving([self._gateway], deadline)
        log.info("local cluster up: gateway %s, workers %s, redis %s", self.gateway_target, self.workers,
                 redacted_url(self._redis_url))

    def _spawn(self, name: str, argv: list[str], endpoint: str,
               health_credentials: health.Credentials | None = None) -> _Child:
        assert self._run_dir is not None
        log_path = self._run_dir / f"{name}.log"
        return _Child(name, argv, endpoint, log_path, self._popen(argv, log_path), time.monotonic(),
                      health_credentials=health_credentials)

    def _popen(self, argv: list[str], log_path: Path) -> subprocess.Popen:
        assert self._pipe is not None
        read_fd = self._pipe[0]  # kept open until stop(): a restarted child needs its copy too
        with open(log_path, "ab") as log_file:
            # A session of its own: the terminal's Ctrl-C reaches only us, and we stop the children in order.
            process = subprocess.Popen(child_command([*argv, "--parent-pipe-fd", str(read_fd)]),
                                       stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                       env=self._child_env, start_new_session=True, pass_fds=(read_fd,))
        log.info("started %s (pid %d), log %s", argv[0], process.pid, log_path)
        return process

    def _children(self) -> list[_Child]:
        return self._workers + ([self._gateway] if self._gateway is not None else [])

    # -------------------------------------------------------------------------------------------- supervision
    def _supervise(self) -> None:
        while not self._stopping.wait(_POLL_S):
            try:
                down = self._supervise_once()
            except Exception:  # a supervisor that dies silently would leave the cluster unwatched
                log.exception("cluster supervisor pass failed")
                continue
            if down is not None:
                self._down = down
                return

    def _supervise_once(self) -> tuple[str, int] | None:
        """One pass: restart Redis if it died, report and (where configured) restart dead workers; the
        (name, code) that ends the cluster, or None."""
        assert self._gateway is not None
        code = self._gateway.process.poll()
        if code is not None:
            self._exits.append(("gateway", code))
            log.error("gateway exited with code %d; last lines of %s:\n%s", code, self._gateway.log_path,
                      _log_tail(self._gateway.log_path))
            return "gateway", code
        if self._redis is not None and not self._redis.running:
            self._restart_redis()
        now = time.monotonic()
        for child in self._workers:
            if self._stopping.is_set():
                return None
            code = child.process.poll()
            if code is None:
                continue
            if not child.exit_seen:
                child.exit_seen = True
                self._exits.append((child.name, code))
                log.warning("%s exited with code %d%s; last lines of %s:\n%s", child.name, code,
                            "" if self.config.restart_workers else " (not restarted: see --restart-workers)",
                            child.log_path, _log_tail(child.log_path, 10))
                if self.config.restart_workers:
                    child.failures = child.failures + 1 if now - child.started_at < _RESTART_STABLE_S else 0
                    delay = min(_RESTART_BACKOFF_MAX_S, _RESTART_BACKOFF_S * 2 ** max(0, child.failures - 1))
                    child.restart_at = now + delay
            if child.restart_at is not None and now >= child.restart_at:
                child.process = self._popen(child.argv, child.log_path)
                child.started_at, child.restart_at, child.exit_seen = time.monotonic(), None, False
                self._restarts[child.name] = self._restarts.get(child.name, 0) + 1
                log.warning("restarted %s (pid %d) at %s", child.name, child.process.pid, child.endpoint)
        decode = [child for child in self._workers if child.argv[0] == "decode-worker"]
        if not self.config.restart_workers and all(child.process.poll() is not None for child in decode):
            last = max(decode, key=lambda child: self._exits.index((child.name, child.process.returncode)))
            return last.name, last.process.returncode
        return None

    def _restart_redis(self) -> None:
        assert self._redis is not None
        self._exits.append(("redis", -1))
        log.warning("redis-server exited; restarting it on port %d (routing is load-only until the workers "
                    "re-publish)", self._redis.port)
        try:
            self._redis.start()  # same port, empty: the workers re-register and re-publish on reconnect
        except RuntimeError as exc:
            log.error("could not restart redis-server (the next pass tries again): %s", exc)
            return
        self._restarts["redis"] = self._restarts.get("redis", 0) + 1
        self._stop_reaper()
        self._start_reaper()
        log.warning("redis-server restarted (pid %d) on port %d", self._redis.pid, self._redis.port)

    def _start_reaper(self) -> None:
        assert self._pipe is not None and self._run_dir is not None
        dirs = [str(self._run_dir)] if self._temporary_run_dir else []
        pgid = 0
        if self._redis is not None:
            pgid = self._redis.pid or 0  # EmbeddedRedis starts it as the leader of its own group
            dirs.append(_redis_data_dir(self._redis.url))
        self._reaper = subprocess.Popen([sys.executable, "-I", "-c", _REAPER, str(self._pipe[0]), str(pgid), *dirs],
                                        stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(self._pipe[0],))

    def _stop_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait()
            self._reaper = None


def _redis_data_dir(url: str) -> str:
    """The embedded redis-server's data directory (its --dir), as the server reports it."""
    client = redis.Redis.from_url(url, socket_timeout=5.0)
    try:
        return client.config_get("dir")["dir"]
    finally:
        client.close()


def _wait_serving(children: list[_Child], deadline: float) -> None:
    pending = list(children)
    while pending:
        for child in list(pending):
            code = child.process.poll()
            if code is not None:
                raise ClusterError(f"{child.name} exited with code {code} while starting; "
                                   f"last lines of {child.log_path}:\n{_log_tail(child.log_path)}")
            if health.check(child.endpoint, timeout=1.0, credentials=child.health_credentials):
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


def _log_tail(path: Path, num_lines: int = _LOG_TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(lines[-num_lines:]) or "(empty log)"


def _close_fd(fd: int) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
