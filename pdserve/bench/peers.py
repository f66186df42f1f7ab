"""Peer systems started for a comparison: llama.cpp's `llama-server` on the same GGUF.

llama-server is a benchmark-only binary, never a project dependency: `bench/build_llama_server.sh` builds it
from the llama.cpp sources vendored in the llama-cpp-python sdist into `bench/peers/` (git-ignored), and the
suite takes its path as `--llama-server PATH`. It is run with continuous batching over `parallel` slots of
`ctx_per_slot` tokens each and the same thread count as every other system (for prompt processing too),
its host-memory prompt cache off (`--cache-ram 0`: on this workload it only costs, about half of llama-server's
32-stream throughput on the development machine, while slot KV reuse still serves cached prefixes), and
driven through its OpenAI-compatible `/v1/completions` with token-id prompts (`OpenAIBackend`), the request
body setting `cache_prompt` (reuse of a slot's KV for a common prompt prefix, llama-server's prefix cache)
and `n_probs: 0` (no per-token probabilities) explicitly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvstore.embedded_redis import free_ports

DEFAULT_BUILD_DIR = Path(__file__).resolve().parents[2] / "bench" / "peers"
"""Where bench/build_llama_server.sh builds by default (in a source checkout)."""
LLAMA_SERVER_IN_BUILD = "llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"


class PeerError(RuntimeError):
    """A peer could not be found or started (the message says how to get it, or ends with its log)."""


def find_llama_server(explicit: str | None, build_dir: Path = DEFAULT_BUILD_DIR) -> Path:
    """`explicit` if given, else the binary that `bench/build_llama_server.sh` leaves in `build_dir`."""
    path = Path(explicit) if explicit else build_dir / LLAMA_SERVER_IN_BUILD
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise PeerError(f"llama-server not found at {path}: build it with `bash bench/build_llama_server.sh` "
                        "(about 10 minutes on 2 cores) or pass --llama-server PATH")
    return path



@dataclass(frozen=True)
class LlamaServerConfig:
    binary: Path
    model: Path
    """The .gguf file."""
    threads: int
    """Threads for generation and for prompt processing (-t and -tb)."""
    parallel: int = 32
    """Slots decoded together (continuous batching)."""
    ctx_per_slot: int = 2048
    """Context of each slot; the server's -c is parallel x this."""
    port: int = 0
    """0 picks a free port."""
    start_timeout_s: float = 120.0

    def argv(self, port: int) -> list[str]:
        return [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
                "--parallel", str(self.parallel), "-c", str(self.parallel * self.ctx_per_slot),
                "-t", str(self.threads), "-tb", str(self.threads), "--cont-batching", "--cache-ram", "0", "--no-webui"]


class LlamaServer:
    """llama-server as a child process; a context manager. `base_url` once started."""

    extra_body = {"cache_prompt": True, "n_probs": 0}
    """Request body fields every benchmark request to it sets."""

    def __init__(self, config: LlamaServerConfig, log_path: Path) -> None:
        self.config = config
        self.log_path = log_path
        self.port = config.port or free_ports(1)[0]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.argv = config.argv(self.port)
        self._process: subprocess.Popen | None = None

    def start(self) -> LlamaServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            code = self._process.poll()
            if code is not None:
                raise PeerError(f"llama-server exited with code {code} while starting; log {self.log_path}:\n"
                                f"{self._tail()}")
            if self._healthy():
                return self
            time.sleep(0.25)
        self.stop()
        raise PeerError(f"llama-server not healthy within {self.config.start_timeout_s:.0f} s; log {self.log_path}:\n"
                        f"{self._tail()}")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    @property
    def pid(self) -> int:
        assert self._process is not None, "llama-server is not running"
        return self._process.pid

    def version(self) -> str:
        """What `llama-server --version` prints (version, build, commit, compiler), on one line."""
        try:
            done = subprocess.run([str(self.config.binary), "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unknown ({exc})"
        return "; ".join(line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip())

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=1.0) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"
