"""`pdserve up` and LocalCluster with real processes: a real redis-server, workers loading the default model,
the gateway. Nothing may be left running, whether the cluster answered or failed to start.

"Nothing left" is checked exactly: `pdserve up` runs under a child subreaper (Linux), so anything it leaves
behind is re-parented to the subreaper, which lists (and then kills) it.

The supervisor is tested by killing what it watches: redis-server (restarted on the same port; the workers
re-register and re-publish), a worker (restarted with --restart-workers; reported otherwise), and the launcher
itself (SIGKILL: its processes stop and its directories leave TMPDIR).
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import redis
from cryptography import x509

from engine.config import EngineConfig
from kvstore.embedded_redis import free_ports
from pdserve import health
from pdserve.client import Client
from pdserve.launch_plan import ClusterError, child_command
from pdserve.launcher import LocalCluster, LocalClusterConfig

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


# A `pdserve` package that must never be imported: a folder named like it in the working directory.
SHADOW_INIT = 'raise ImportError("the pdserve/ folder of the working directory was imported")\n'
WAIT_S = 120.0
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def run_reaped(*argv: str, cwd: Path = REPO) -> dict:
    result = subprocess.run([sys.executable, "-c", SUBREAPER, *argv], cwd=cwd, capture_output=True, text=True,
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


def shadowing_dir(tmp_path: Path) -> Path:
    """A working directory that holds a `pdserve/` folder, as the checkout's parent folder does."""
    folder = tmp_path / "cwd"
    (folder / "pdserve").mkdir(parents=True)
    (folder / "pdserve" / "__init__.py").write_text(SHADOW_INIT)
    (folder / "pdserve" / "cli.py").write_text(SHADOW_INIT)
    return folder


def test_children_import_the_installed_package_whatever_the_working_directory_holds(tmp_path):
    # `health` of a closed port: exit 1, UNAVAILABLE.
    result = subprocess.run(child_command(["health", "127.0.0.1:1", "--timeout", "0.5"]),
                            cwd=shadowing_dir(tmp_path), capture_output=True, text=True, timeout=60)
    assert "working directory was imported" not in result.stderr
    assert (result.returncode, result.stdout.strip()) == (1, "UNAVAILABLE"), result.stderr


@pytest.mark.slow
def test_up_once_answers_through_the_cluster_and_leaves_nothing_behind(default_model_path, tmp_path):
    # Started from a folder that holds a `pdserve/` directory: the children must not import it.
    run_dir = tmp_path / "run"
    out = run_reaped(sys.executable, "-P", "-m", "pdserve.cli", "up", "--once", "What is the capital of France?",
                     "--port", "0", "--http-port", "0", "--kv-cache-memory", str(KV_CACHE_MEMORY), "--max-tokens", "32",
                     "--run-dir", str(run_dir), cwd=shadowing_dir(tmp_path))
    logs = {path.name: path.read_text()[-2000:] for path in run_dir.glob("*.log")}
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
        redis_address = re.search(r"redis://(?:[^@/\s]*@)?([\d.]+:\d+)", output)
        assert redis_address, output
        assert ":***@" in output                                # the password is never printed
        assert processes_mentioning([redis_address[1]]) != []  # serving: Redis and the workers are running
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM
        assert processes_mentioning([redis_address[1]]) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def assert_all_stopped(cluster: LocalCluster) -> None:
    redis_address = cluster.redis_url.removeprefix("redis://").split("/")[0].split("@")[-1]
    ports = [endpoint.rsplit(":", 1)[1] for endpoint in cluster.workers.values()]
    assert processes_mentioning([redis_address, *(f"--port {port} " for port in ports)]) == []


# ------------------------------------------------------------------------------------------------ supervision
def wait_until(condition, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.2)


def ask_paris(cluster: LocalCluster) -> str:
    with Client(cluster.gateway_target, timeout=WAIT_S) as client:
        return client.complete_chat(PARIS, max_tokens=16, temperature=0.0).text


def published_blocks(url: str) -> dict[str, int]:
    """Worker id -> number of block hashes its current epoch has in the prefix index."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        counts: dict[str, int] = {}
        for key in client.scan_iter("pdserve:blocks:*"):
            worker_id = key.split(":")[2]
            counts[worker_id] = counts.get(worker_id, 0) + client.scard(key)
        return counts
    except redis.RedisError:   # down or restarting
        return {}
    finally:
        client.close()


def registered_workers(url: str) -> set[str]:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return {key.split(":", 2)[2] for key in client.scan_iter("pdserve:worker:*")}
    except redis.RedisError:
        return set()
    finally:
        client.close()


@pytest.mark.slow
def test_a_killed_redis_and_a_killed_worker_come_back_and_the_cluster_answers(default_model_path, tmp_path):
    config = LocalClusterConfig(port=0, http_port=-1, restart_workers=True, run_dir=str(tmp_path),
                                engine=EngineConfig(model="default", kv_cache_memory=KV_CACHE_MEMORY))
    with LocalCluster(config) as cluster:
        assert "Paris" in ask_paris(cluster)
        url = cluster.redis_url

        def both_published() -> dict[str, int] | None:
            counts = published_blocks(url)
            return counts if {"prefill-0", "decode-0"} <= set(counts) else None

        before = wait_until(both_published, "both workers' cached blocks in the index")

        redis_pid = cluster.redis_pid
        os.kill(redis_pid, signal.SIGKILL)
        wait_until(lambda: cluster.redis_pid not in (None, redis_pid), "a new redis-server")
        assert cluster.redis_url == url                          # same port: the workers' URL still works
        wait_until(lambda: registered_workers(url) >= {"prefill-0", "decode-0"}, "the workers re-registered")
        def republished() -> bool:   # the new server starts empty: only a re-publish puts the blocks back
            counts = published_blocks(url)
            return all(counts.get(worker_id, 0) >= count for worker_id, count in before.items())

        wait_until(republished, "the workers re-published their cached blocks")
        assert "Paris" in ask_paris(cluster)
        assert ("redis", -1) in cluster.exits and cluster.restarts["redis"] == 1

        decode_pid = cluster.pids["decode-0"]
        os.kill(decode_pid, signal.SIGKILL)
        wait_until(lambda: cluster.pids["decode-0"] != decode_pid, "decode-0 restarted")
        wait_until(lambda: probe_status(cluster, "decode-0") == health.SERVING, "the new decode-0 SERVING")
        wait_until(lambda: "decode-0" in registered_workers(url), "the new decode-0 registered")
        assert "Paris" in wait_until(lambda: _answer_or_none(cluster), "an answer through the new decode-0")
        assert ("decode-0", -signal.SIGKILL) in cluster.exits and cluster.restarts["decode-0"] == 1
        assert cluster.wait(timeout=1.0) is None                 # nothing ended the cluster
    assert_all_stopped(cluster)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="lending needs two CPUs")
def test_lend_idle_cpus_lets_each_worker_step_on_the_others_cpu_while_it_idles(default_model_path, tmp_path):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    config = LocalClusterConfig(port=0, http_port=-1, num_cpus=2, pin_workers=True, lend_idle_cpus=True,
                                gateway_args=("--local-prefill-threshold", "0"), run_dir=str(tmp_path),
                                engine=EngineConfig(model="default", kv_cache_memory=KV_CACHE_MEMORY))
    with LocalCluster(config) as cluster:
        assert ask_paris(cluster).startswith("The capital of France is Paris")

        def masks(worker: str) -> set[tuple[int, ...]]:
            pid = cluster.pids[worker]
            return {tuple(sorted(os.sched_getaffinity(int(tid)))) for tid in os.listdir(f"/proc/{pid}/task")}

        # the prefill ran while the decode worker had nothing to do, and the decode while the prefill worker had
        # nothing to do: each stepped on both CPUs (its loop thread and the OpenMP thread it started keep that
        # mask); the rest of each process stays on its own CPU
        assert masks("prefill-0") == {(first,), (first, second)}
        assert masks("decode-0") == {(second,), (first, second)}
        assert (tmp_path / "decode-0.busy").exists() and (tmp_path / "prefill-0.busy").exists()
    assert_all_stopped(cluster)


def probe_status(cluster: LocalCluster, worker: str, server_role: str | None = None) -> str:
    """A worker's health over mutual TLS with the launcher's probe certificate, checking its role."""
    credentials = health.Credentials.cluster(cluster.tls_files["probe"], server_role or worker.split("-")[0])
    return health.status(cluster.workers[worker], timeout=2.0, credentials=credentials)


@pytest.mark.slow
def test_internal_ports_take_only_cluster_certificates_and_no_command_line_holds_the_redis_password(
        default_model_path, tmp_path):
    [health_port] = free_ports(1)
    config = LocalClusterConfig(port=0, http_port=-1, run_dir=str(tmp_path),
                                engine=EngineConfig(model="default", kv_cache_memory=KV_CACHE_MEMORY),
                                gateway_args=("--health-port", str(health_port)))
    with LocalCluster(config) as cluster:
        assert "Paris" in ask_paris(cluster)
        pki = tmp_path / "pki"
        assert stat.S_IMODE(pki.stat().st_mode) == 0o700
        assert set(cluster.tls_files) == {"gateway", "prefill-0", "decode-0", "probe"}
        for files in cluster.tls_files.values():
            assert files.key_path.parent == pki and stat.S_IMODE(files.key_path.stat().st_mode) == 0o600
        for worker in ("prefill-0", "decode-0"):
            assert probe_status(cluster, worker) == health.SERVING
            # Plaintext (no client certificate) fails the handshake; so does a server of another role.
            assert health.status(cluster.workers[worker], timeout=2.0) == "UNAVAILABLE"
            other = "decode" if worker.startswith("prefill") else "prefill"
            assert probe_status(cluster, worker, server_role=other) == "UNAVAILABLE"
        # Each process was given its own certificate, on its command line; the Redis URL only in its environment.
        password = unquote(urlsplit(cluster.redis_url).password or "")
        assert len(password) >= 32
        for name, pid in cluster.pids.items():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            assert str(cluster.tls_files[name].cert_path) in argv, name
            assert "--insecure-internal" not in argv and "--redis-url" not in argv, name
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
            assert f"PDSERVE_REDIS_URL={cluster.redis_url}" in environ, name
        assert processes_mentioning([password]) == []

        # The gateway's plaintext health-only port (what the kubelet probes): readiness ("") follows the decode
        # pool, "liveness" stays SERVING without it, so a liveness probe does not restart the gateway.
        gateway_health = f"127.0.0.1:{health_port}"
        assert health.status(gateway_health) == health.status(gateway_health, "liveness") == health.SERVING
        os.kill(cluster.pids["decode-0"], signal.SIGKILL)
        wait_until(lambda: health.status(gateway_health) == "NOT_SERVING", "the gateway NOT_SERVING")
        assert health.status(gateway_health, "liveness") == health.SERVING
    assert_all_stopped(cluster)



@pytest.mark.slow
def test_up_once_sends_the_first_api_key_over_the_gateways_public_tls(default_model_path, tmp_path):
    certs = tmp_path / "certs"
    assert subprocess.run([sys.executable, "-m", "pdserve.cli", "certs", "--out", str(certs), "--name", "gateway"],
                          cwd=REPO, capture_output=True, timeout=120).returncode == 0
    keys = tmp_path / "api-keys"
    keys.write_text("# the first key is --once's\n" + "k" * 24 + " team-a\n" + "z" * 24 + " team-b\n")
    run_dir = tmp_path / "run"
    out = run_reaped(sys.executable, "-m", "pdserve.cli", "up", "--once", "What is the capital of France?",
                     "--kv-cache-memory", str(KV_CACHE_MEMORY), "--max-tokens", "32", "--run-dir", str(run_dir),
                     "--api-key-file", str(keys), "--tls-cert", str(certs / "public.pem"),
                     "--tls-key", str(certs / "public-key.pem"), "--ca-cert", str(certs / "public-ca.pem"))
    logs = {path.name: path.read_text()[-2000:] for path in run_dir.glob("*.log")}
    assert out["rc"] == 0, (out["stderr"], logs)
    assert "Paris" in out["stdout"]
    assert out["left"] == {}


@pytest.mark.slow
def test_up_tls_makes_a_public_certificate_that_once_verifies_with_the_runs_ca(default_model_path, tmp_path):
    out = run_reaped(sys.executable, "-m", "pdserve.cli", "up", "--once", "What is the capital of France?", "--tls",
                     "--http-port", "0", "--kv-cache-memory", str(KV_CACHE_MEMORY), "--max-tokens", "32",
                     "--run-dir", str(tmp_path))
    assert out["rc"] == 0, out["stderr"]
    assert "Paris" in out["stdout"]
    assert re.search(r"^\s+http\s+https://127\.0\.0\.1:\d+$", out["stderr"], re.MULTILINE), out["stderr"]
    pki = tmp_path / "pki"
    assert stat.S_IMODE((pki / "public-key.pem").stat().st_mode) == 0o600
    # The public certificate comes from its own CA, not the cluster's: it is no cluster member.
    public = x509.load_pem_x509_certificate((pki / "public.pem").read_bytes())
    public.verify_directly_issued_by(x509.load_pem_x509_certificate((pki / "public-ca.pem").read_bytes()))
    assert public.issuer != x509.load_pem_x509_certificate((pki / "ca.pem").read_bytes()).subject
    assert out["left"] == {}


@pytest.mark.slow
def test_up_insecure_internal_runs_plaintext_and_says_so(default_model_path, tmp_path):
    out = run_reaped(sys.executable, "-m", "pdserve.cli", "up", "--once", "What is the capital of France?",
                     "--insecure-internal", "--kv-cache-memory", str(KV_CACHE_MEMORY), "--max-tokens", "32",
                     "--run-dir", str(tmp_path))
    assert out["rc"] == 0, out["stderr"]
    assert "Paris" in out["stdout"]
    assert "--insecure-internal: the workers and the gateway talk plaintext" in out["stderr"]
    assert not (tmp_path / "pki").exists()
    assert out["left"] == {}


def _answer_or_none(cluster: LocalCluster) -> str | None:
    try:
        return ask_paris(cluster)
    except Exception:  # the gateway may still route to the dead decode worker's registration for a moment
        return None


@pytest.mark.slow
def test_without_restart_a_dead_worker_is_reported_and_the_last_decode_worker_ends_the_wait(default_model_path,
                                                                                               tmp_path):
    config = LocalClusterConfig(port=0, http_port=-1, run_dir=str(tmp_path),
                                engine=EngineConfig(model="default", kv_cache_memory=KV_CACHE_MEMORY))
    with LocalCluster(config) as cluster:
        prefill_pid = cluster.pids["prefill-0"]
        os.kill(prefill_pid, signal.SIGKILL)
        wait_until(lambda: ("prefill-0", -signal.SIGKILL) in cluster.exits, "the dead prefill worker reported")
        assert cluster.wait(timeout=1.0) is None                 # the decode worker still serves
        assert "Paris" in wait_until(lambda: _answer_or_none(cluster), "an answer prefilled on the decode worker")
        assert cluster.pids["prefill-0"] == prefill_pid and cluster.restarts == {}

        os.kill(cluster.pids["decode-0"], signal.SIGKILL)
        assert cluster.wait(timeout=WAIT_S) == ("decode-0", -signal.SIGKILL)
    assert_all_stopped(cluster)


@pytest.mark.slow
def test_a_sigkilled_launcher_leaves_no_process_and_no_directory(default_model_path, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--prefill", "0", "--port", "0",
                             "--http-port", "-1", "--kv-cache-memory", str(KV_CACHE_MEMORY)], cwd=REPO,
                            env={**os.environ, "TMPDIR": str(tmpdir)}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        output = "".join(lines)
        redis_address = re.search(r"redis://(?:[^@/\s]*@)?([\d.]+:\d+)", output)
        assert redis_address, output
        made = sorted(path.name for path in tmpdir.iterdir())
        assert any(name.startswith("pdserve-redis-") for name in made), made
        assert any(name.startswith("pdserve-up-") for name in made), made
        proc.kill()
        proc.wait(30)
        wait_until(lambda: processes_mentioning([redis_address[1]]) == [], "redis-server and the workers gone")
        wait_until(lambda: not any(name.startswith("pdserve-") for name in os.listdir(tmpdir)),
                   f"no pdserve-* directory left in TMPDIR: {os.listdir(tmpdir)}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
