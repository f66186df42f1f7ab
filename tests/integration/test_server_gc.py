"""The server commands freeze the heap they start with (protos.gc_tuning): a `pdserve decode-worker` and a `pdserve
gateway`, real processes started as `pdserve up` and the Kubernetes manifests start them (the default model, a real
redis-server), report on their metrics port the objects frozen once they served, a worker's whole start: torch,
grpc and the model's modules, so tens of thousands of objects, where an unfrozen process reports 0."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from kvstore.embedded_redis import EmbeddedRedis, free_ports
from tests.integration.cluster import REPO, START_TIMEOUT_S

pytestmark = pytest.mark.slow


def frozen_objects(port: int, proc: subprocess.Popen) -> float:
    """pdserve_gc_frozen_objects once the process serves its metrics and has frozen (bounded poll)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                text = response.read().decode()
        except OSError:
            text = ""
        for line in text.splitlines():
            if line.startswith("pdserve_gc_frozen_objects ") and float(line.split()[1]) > 0:
                return float(line.split()[1])
        assert time.monotonic() < deadline, "no frozen heap reported"
        time.sleep(0.2)


def test_worker_and_gateway_commands_freeze_their_startup_heap(default_model_path, tmp_path):
    worker_metrics, gateway_metrics = free_ports(2)
    common = ["--model", str(default_model_path), "--insecure-internal"]
    with EmbeddedRedis() as redis:
        env = {**os.environ, "PDSERVE_REDIS_URL": redis.url}
        commands = [["decode-worker", "--port", "0", "--metrics-port", str(worker_metrics), "--threads", "1",
                     "--kv-cache-memory", str(64 << 20), *common],
                    ["gateway", "--port", "0", "--http-port", "-1", "--metrics-port", str(gateway_metrics), *common]]
        procs = [subprocess.Popen([sys.executable, "-m", "pdserve", *argv], cwd=REPO, env=env,
                                  stdout=subprocess.DEVNULL, stderr=(tmp_path / f"{argv[0]}.log").open("wb"))
                 for argv in commands]
        try:
            assert frozen_objects(worker_metrics, procs[0]) > 20_000
            assert frozen_objects(gateway_metrics, procs[1]) > 20_000
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
