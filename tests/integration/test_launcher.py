"""`pdserve up` and LocalCluster with real processes: a real redis-server, workers loading the default model,
the gateway. Nothing may be left running, whether the cluster answered or failed to start.

"Nothing left" is checked exactly: `pdserve up` runs under a child subreaper (Linux), so anything it leaves
behind is re-parented to the subreaper, which lists (and then kills) it.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from pdserve.launcher import ClusterError, LocalCluster, LocalClusterConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and PR_SET_CHILD_SUBREAPER")

REPO = Path(__file__).resolve().parents[2]
KV_CACHE_MEMORY = 64 << 20

# Runs argv as a child, then reports every process that outlived it (re-parented to us) and kills them.
SUBREAPER = r"""
import ctypes, json, os, signal, subprocess, sys, tempfile
PR_SET_CHILD_SUBREAPER = 36
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_CHILD_SUBREAPER) failed")
with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen(sys.argv[1:], stdout=out, stderr=err)
    while True:  # reap everything, orphans that already exited included, until the command itself exits
        pid, status = os.waitpid(-1, 0)
        if pid == proc.pid:
            rc = os.waitstatus_to_exitcode(status)
            break
    left = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                comm, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        state, ppid = rest.split()[:2]
        if int(ppid) == os.getpid() and state != "Z":  # alive, and orphaned by the command
            left[int(entry)] = f"{comm}: {cmdline}"
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    out.seek(0)
    err.seek(0)
    print(json.dumps({"rc": rc, "stdout": out.read(), "stderr": err.read(), "left": left}))
"""


def run_reaped(*argv: str) -> dict:
    result = subprocess.run([sys.executable, "-c", SUBREAPER, *argv], cwd=REPO, capture_output=True, text=True,
                            timeout=700)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def processes_mentioning(needles: list[str]) -> list[str]:
    found = []
    for proc_dir in Path("/proc").iterdir():
        try:
            cmdline = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(needle in cmdline for needle in needles):
            found.append(f"{proc_dir.name}: {cmdline}")
    return found


@pytest.mark.slow
def test_up_once_answers_through_the_cluster_and_leaves_nothing_behind(default_model_path, tmp_path):
    out = run_reaped(sys.executable, "-m", "pdserve.cli", "up", "--once", "What is the capital of France?",
                     "--port", "0", "--http-port", "0", "--kv-cache-memory", str(KV_CACHE_MEMORY), "--max-tokens", "32",
                     "--run-dir", str(tmp_path))
    logs = {path.name: path.read_text()[-2000:] for path in tmp_path.glob("*.log")}
    assert out["rc"] == 0, (out["stderr"], logs)
    assert "Paris" in out["stdout"]
    for name in ("gateway", "http", "prefill-0", "decode-0", "redis"):
        assert re.search(rf"^\s+{name}\s+\S+:\d+", out["stderr"], re.MULTILINE), out["stderr"]
    assert sorted(logs) == ["decode-0.log", "gateway.log", "prefill-0.log"]
    assert out["left"] == {}


def test_a_worker_that_cannot_start_fails_the_start_and_everything_is_stopped(tmp_path):
    config = LocalClusterConfig(port=0, http_port=0, engine=EngineConfig(model=str(tmp_path / "missing.gguf")),
                                run_dir=str(tmp_path), start_timeout_s=120)
    cluster = LocalCluster(config)
    with pytest.raises(ClusterError, match=r"(prefill|decode)-0 exited with code 1 while starting") as exc_info:
        cluster.start()
    assert "missing.gguf" in str(exc_info.value)  # the log's tail says why
    assert_all_stopped(cluster)


@pytest.mark.slow
def test_a_gateway_that_cannot_start_stops_the_workers_and_redis(default_model_path, tmp_path):
    config = LocalClusterConfig(port=0, http_port=0,
                                engine=EngineConfig(model="default", kv_cache_memory=KV_CACHE_MEMORY),
                                gateway_args=("--max-inflight", "0"), run_dir=str(tmp_path))
    cluster = LocalCluster(config)
    with pytest.raises(ClusterError, match="gateway exited with code 2 while starting") as exc_info:
        cluster.start()
    assert "GatewayConfig.max_inflight" in str(exc_info.value)
    assert set(cluster.workers) == {"prefill-0", "decode-0"}  # they had started and were SERVING
    assert_all_stopped(cluster)


@pytest.mark.slow
def test_up_stops_everything_on_sigterm(default_model_path, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--port", "0", "--http-port", "0",
                             "--kv-cache-memory", str(KV_CACHE_MEMORY), "--run-dir", str(tmp_path)], cwd=REPO,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        output = "".join(lines)
        redis_address = re.search(r"redis://([\d.]+:\d+)", output)
        assert redis_address, output
        assert processes_mentioning([redis_address[1]]) != []  # serving: Redis and the workers are running
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM
        assert processes_mentioning([redis_address[1]]) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def assert_all_stopped(cluster: LocalCluster) -> None:
    redis_address = cluster.redis_url.removeprefix("redis://").split("/")[0]
    ports = [endpoint.rsplit(":", 1)[1] for endpoint in cluster.workers.values()]
    assert processes_mentioning([redis_address, *(f"--port {port} " for port in ports)]) == []
