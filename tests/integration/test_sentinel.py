"""The prefix index over Redis Sentinel, against real processes: a master redis-server, a replica
(``replicaof``) and three sentinels (the same binary with ``--sentinel``), all on loopback, quorum 2, with
short failure detection so a failover takes a few seconds. Killing the master degrades lookups to "no
information" and, once the sentinels promote the replica, the index works against it and the publisher has
re-registered and re-published the worker's full cached set.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from kvstore.block_pool import BlockStored
from kvstore.embedded_redis import find_redis_server, free_ports, generate_password
from kvstore.hashing import hash_prompt_blocks, root_hash
from kvstore.index import IndexUnavailable, PrefixIndex, parse_sentinel_url, redacted_url, redis_client
from kvstore.index_publisher import IndexPublisher
from kvstore.local_index import WorkerInfo
from tests.integration.cluster import RPC_TIMEOUT_S, Cluster, assert_idle

SERVICE = "pdindex"
ROOT = root_hash("test-model")
PROMPT = hash_prompt_blocks(list(range(160)), 16, ROOT)              # 10 blocks
LATER_PROMPT = hash_prompt_blocks(list(range(1000, 1128)), 16, ROOT)  # 8 blocks, cached while the master is dead
SETTLE_TIMEOUT_S = 20.0
FAILOVER_TIMEOUT_S = 30.0
HANG_BOUND_S = 2.0
"""A lookup taking this long is hanging, not degrading (the contract is ~2 x lookup_timeout_s)."""



def wait_until(condition, timeout_s: float, what: str):
    """Poll ``condition`` until it returns a truthy value; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s}s (last value {value!r})")
        time.sleep(0.05)


class RedisProcess:
    """One redis-server (or sentinel) child on 127.0.0.1, in its own process group, configured by a file."""

    def __init__(self, directory: Path, name: str, port: int, config: list[str], sentinel: bool = False) -> None:
        self.name = name
        self.port = port
        self.config_path = directory / f"{name}.conf"
        self.log_path = directory / f"{name}.log"
        lines = [f"port {self.port}", "bind 127.0.0.1", f"dir {directory}", f'logfile "{self.log_path}"', *config]
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:          # a sentinel rewrites its own file: it must be writable
            f.write("\n".join(lines) + "\n")
        args = [find_redis_server(), str(self.config_path), *(["--sentinel"] if sentinel else [])]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text()[-1500:]
        except OSError:
            return "(no log)"


class SentinelGroup:
    """A password-protected master, its replica and three sentinels (also password-protected) watching it."""

    def __init__(self, directory: Path) -> None:
        self.password = generate_password()
        self.sentinel_password = generate_password()
        auth = [f'requirepass "{self.password}"', f'masterauth "{self.password}"', 'save ""', "appendonly no"]
        master_port, replica_port, *sentinel_ports = free_ports(5)
        self.master = RedisProcess(directory, "master", master_port, auth)
        self.replica = RedisProcess(directory, "replica", replica_port, [*auth, f"replicaof 127.0.0.1 {master_port}"])
        self.sentinels = [
            RedisProcess(directory, f"sentinel{i}", sentinel_ports[i], [
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 2",
                f'sentinel auth-pass {SERVICE} "{self.password}"',
                f"sentinel down-after-milliseconds {SERVICE} 1000",
                f"sentinel failover-timeout {SERVICE} 5000",
                f"sentinel parallel-syncs {SERVICE} 1",
                f'requirepass "{self.sentinel_password}"',
                f'sentinel sentinel-pass "{self.sentinel_password}"',
            ], sentinel=True)
            for i in range(3)]

    @property
    def processes(self) -> list[RedisProcess]:
        return [self.master, self.replica, *self.sentinels]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://:{self.password}@{hosts}/{SERVICE}/0?sentinel_password={self.sentinel_password}"

    def sentinel_views(self) -> list[dict]:
        """Each live sentinel's SENTINEL MASTER answer (a dict) for the service; {} where it does not answer."""
        views = []
        for s in self.sentinels:
            client = redis.Redis(port=s.port, password=self.sentinel_password, decode_responses=True,
                                 socket_timeout=1.0, socket_connect_timeout=1.0)
            try:
                views.append(client.sentinel_master(SERVICE))
            except redis.RedisError:
                views.append({})
            finally:
                client.close()
        return views

    def settled(self) -> bool:
        """Every sentinel sees the master up, its replica and the two other sentinels; the replica is in sync."""
        views = self.sentinel_views()
        sentinels_ready = all(v.get("num-other-sentinels") == 2 and v.get("num-slaves") == 1
                              and v.get("port") == self.master.port and not v.get("is_sdown") for v in views)
        replica = redis.Redis(port=self.replica.port, password=self.password, socket_timeout=1.0)
        try:
            in_sync = replica.info("replication").get("master_link_status") == "up"
        except redis.RedisError:
            in_sync = False
        finally:
            replica.close()
        return sentinels_ready and in_sync

    def promoted(self) -> bool:
        """Every sentinel names the former replica as the master."""
        return all(v.get("port") == self.replica.port and v.get("flags") == "master" for v in self.sentinel_views())

    def demoted(self) -> bool:
        """The former master runs on as a replica (the sentinels closed its clients when they demoted it)."""
        old_master = redis.Redis(port=self.master.port, password=self.password, socket_timeout=1.0)
        try:
            return old_master.info("replication")["role"] == "slave"
        except redis.RedisError:
            return False
        finally:
            old_master.close()

    def close(self) -> None:
        for process in self.processes:
            process.kill()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in self.processes)


@pytest.fixture
def sentinel_group():
    with tempfile.TemporaryDirectory(prefix="pdserve-sentinel-") as directory:
        group = SentinelGroup(Path(directory))
        try:
            wait_until(group.settled, SETTLE_TIMEOUT_S, "sentinels, master and replica settle")
            yield group
        except BaseException:
            print(group.logs())
            raise
        finally:
            group.close()


def test_sentinel_url_parses_every_part():
    url = parse_sentinel_url("redis+sentinel://pd:p%40ss@10.0.0.1:26379,sentinel-b,[::1]:5000/mymaster/2"
                             "?sentinel_password=s%26p")
    assert url.sentinels == (("10.0.0.1", 26379), ("sentinel-b", 26379), ("::1", 5000))
    assert (url.service_name, url.db, url.username, url.password) == ("mymaster", 2, "pd", "p@ss")
    assert (url.sentinel_username, url.sentinel_password) == (None, "s&p")
    assert parse_sentinel_url("redis+sentinel://:pw@h/m").username is None
    for bad, message in [("redis+sentinel://h/", "service_name"), ("redis+sentinel:///m", "no sentinel"),
                         ("redis+sentinel://h:x/m", "host:port"), ("redis+sentinel://h/m/x", "integer"),
                         ("redis+sentinel://h/m?ssl=1", "'ssl' is not supported")]:
        with pytest.raises(ValueError, match=message):
            parse_sentinel_url(bad)


def test_redacted_url_hides_every_password():
    assert redacted_url("redis+sentinel://pd:pw1@h1:26379,h2:26379/m/0?sentinel_username=s&sentinel_password=pw2") \
        == "redis+sentinel://pd:***@h1:26379,h2:26379/m/0?sentinel_username=s&sentinel_password=***"
    assert redacted_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redacted_url("unix:///run/r.sock?db=0&password=pw") == "unix:///run/r.sock?db=0&password=***"


def test_sentinel_url_reaches_the_master_with_its_passwords(sentinel_group):
    group = sentinel_group
    client = redis_client(group.url, decode_responses=True)
    try:
        client.set("pdserve:probe", "1")                      # a write: only the master takes it
        assert client.info("server")["tcp_port"] == group.master.port
    finally:
        client.close()
    wrong_sentinel_password = group.url.replace(group.sentinel_password, "wrong")
    wrong_master_password = group.url.replace(f":{group.password}@", ":wrong@")
    for url in (wrong_sentinel_password, wrong_master_password):
        index = PrefixIndex(url)
        assert index.lookup(PROMPT) is None                   # refused, never raised
        index.close()


def _lookup_returning(index: PrefixIndex, block_hashes, role=None):
    """``index.lookup`` run on a thread: fails the test if it raises or hangs, else its answer."""
    answer, errors = [], []

    def run():
        try:
            answer.append(index.lookup(block_hashes, role))
        except BaseException as exc:  # noqa: BLE001 - any exception escaping a lookup is the failure
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_BOUND_S)
    assert not thread.is_alive(), "a lookup hung while the master was down"
    assert not errors, f"a lookup raised: {errors[0]!r}"
    return answer[0]


def test_failover_degrades_lookups_then_the_publishers_republish_on_the_new_master(sentinel_group):
    """d0's publisher runs its thread (its calls fail while the master is dead); d1's runs only when flushed,
    so its first call after the promotion reconnects to the new master without any error: the index must
    still make it re-register, or what the replica missed stays missing."""
    group = sentinel_group
    index = PrefixIndex(group.url, worker_ttl_s=5.0, lookup_timeout_s=0.05, breaker_cooldown_s=0.2)
    publisher = IndexPublisher(index, WorkerInfo("d0", "decode"), initial_hashes=PROMPT, flush_interval_s=0.02)
    quiet_index = PrefixIndex(group.url, worker_ttl_s=120.0)   # no heartbeat or expiry during the test
    quiet = IndexPublisher(quiet_index, WorkerInfo("d1", "decode"), initial_hashes=PROMPT[:6])
    publisher.start()
    try:
        assert quiet.flush() is True
        epoch = index.register(WorkerInfo("p0", "prefill"))  # a worker-side call straight through the index
        index.publish("p0", epoch, [BlockStored(tuple(PROMPT[:4]))])
        wait_until(lambda: index.lookup(PROMPT) == {"d0": 10, "d1": 6, "p0": 4}, 10.0,
                   "blocks published via Sentinel")
        before, quiet_before = publisher.get_stats(), quiet.get_stats()
        assert before.synced and before.num_republishes == 1 and quiet_before.num_republishes == 1

        group.master.kill()
        wait_until(lambda: _lookup_returning(index, PROMPT) is None, 10.0, "lookups degrade to None")
        assert _lookup_returning(index, PROMPT, "decode") in (None, {"d0": 10, "d1": 6})

        publisher.submit([BlockStored(tuple(LATER_PROMPT))])  # the worker caches more while Redis is down
        wait_until(group.promoted, FAILOVER_TIMEOUT_S, "the sentinels promote the replica")
        wait_until(lambda: _lookup_returning(index, LATER_PROMPT, "decode") == {"d0": 8, "d1": 0},
                   FAILOVER_TIMEOUT_S, "d0's publisher re-publishes on the new master")
        after = publisher.get_stats()
        assert after.synced and after.num_republishes > before.num_republishes and after.epoch > before.epoch
        assert index.lookup(PROMPT, "decode") == {"d0": 10, "d1": 6}

        new_master = redis.Redis(port=group.replica.port, password=group.password, decode_responses=True)
        try:
            assert new_master.info("replication")["role"] == "master"
            assert new_master.hget("pdserve:worker:d0", "epoch") == str(after.epoch)
            # As if d1's last writes had not reached the replica before the master died:
            assert new_master.unlink(f"pdserve:blocks:d1:{quiet_before.epoch}") == 1
        finally:
            new_master.close()
        assert index.lookup(PROMPT, "decode") == {"d0": 10, "d1": 0}
        quiet.submit([BlockStored(tuple(LATER_PROMPT[:2]))])
        wait_until(quiet.flush, 10.0, "d1's publisher syncs with the new master")
        assert index.lookup(PROMPT, "decode") == {"d0": 10, "d1": 6}        # the full set, re-published
        assert index.lookup(LATER_PROMPT, "decode") == {"d0": 8, "d1": 2}
        quiet_after = quiet.get_stats()
        assert quiet_after.num_republishes == 2 and quiet_after.epoch > quiet_before.epoch

        epoch = index.register(WorkerInfo("p1", "prefill"))   # worker-side calls work against the new master
        index.publish("p1", epoch, [BlockStored(tuple(LATER_PROMPT[:3]))])
        assert index.lookup(LATER_PROMPT, "prefill")["p1"] == 3
    finally:
        publisher.stop()
        quiet.stop()
        index.close()
        quiet_index.close()


def test_planned_failover_moves_the_index_to_the_new_master(sentinel_group):
    """SENTINEL FAILOVER (maintenance): the old master lives on as a replica of the new one. For a moment
    both are masters, and writes the old one takes then are lost when it resyncs from the new one; the
    sentinels close its clients when they demote it, so each publisher's next call reaches the new master,
    which makes it re-register and re-publish everything there. The demoted one refuses writes."""
    group = sentinel_group
    index = PrefixIndex(group.url, worker_ttl_s=5.0, lookup_timeout_s=0.05, breaker_cooldown_s=0.2)
    publisher = IndexPublisher(index, WorkerInfo("d0", "decode"), initial_hashes=PROMPT, flush_interval_s=0.02)
    quiet_index = PrefixIndex(group.url, worker_ttl_s=120.0)
    quiet = IndexPublisher(quiet_index, WorkerInfo("d1", "decode"), initial_hashes=PROMPT[:6])
    publisher.start()
    try:
        assert quiet.flush() is True
        wait_until(lambda: index.lookup(PROMPT) == {"d0": 10, "d1": 6}, 10.0, "blocks published via Sentinel")
        before, quiet_before = publisher.get_stats(), quiet.get_stats()

        sentinel = redis.Redis(port=group.sentinels[0].port, password=group.sentinel_password)

        def failover_started() -> bool:
            # NOGOODSLAVE until the sentinel has seen the replica in sync (its INFO polls run every second).
            try:
                return bool(sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE))
            except redis.ResponseError as exc:
                if "NOGOODSLAVE" not in str(exc):
                    raise
                return False

        try:
            wait_until(failover_started, FAILOVER_TIMEOUT_S, "a sentinel accepts SENTINEL FAILOVER")
        finally:
            sentinel.close()
        wait_until(lambda: group.promoted() and group.demoted(), FAILOVER_TIMEOUT_S,
                   "the sentinels promote the replica and demote the master")
        publisher.submit([BlockStored(tuple(LATER_PROMPT))])
        wait_until(lambda: publisher.get_stats().num_republishes > before.num_republishes, FAILOVER_TIMEOUT_S,
                   "d0's publisher re-registers on the new master")
        quiet.submit([BlockStored(tuple(LATER_PROMPT[:2]))])
        wait_until(quiet.flush, 10.0, "d1's publisher syncs with the new master")
        assert quiet.get_stats().num_republishes == quiet_before.num_republishes + 1
        wait_until(lambda: _lookup_returning(index, LATER_PROMPT, "decode") == {"d0": 8, "d1": 2},
                   FAILOVER_TIMEOUT_S, "the blocks cached during the failover are found")
        assert index.lookup(PROMPT, "decode") == {"d0": 10, "d1": 6}
        new_master = redis.Redis(port=group.replica.port, password=group.password, decode_responses=True)
        try:
            assert new_master.info("replication")["role"] == "master"
            for worker_id, stats, num_blocks in (("d0", publisher.get_stats(), 18), ("d1", quiet.get_stats(), 8)):
                assert new_master.hget(f"pdserve:worker:{worker_id}", "epoch") == str(stats.epoch)
                assert new_master.scard(f"pdserve:blocks:{worker_id}:{stats.epoch}") == num_blocks
        finally:
            new_master.close()

        demoted = PrefixIndex(f"redis://:{group.password}@127.0.0.1:{group.master.port}/0")
        try:
            wait_until(lambda: demoted.lookup(LATER_PROMPT, "decode") == {"d0": 8, "d1": 2}, 10.0,
                       "the demoted master replicates the new one")
            with pytest.raises(IndexUnavailable, match="READONLY"):
                demoted.register(WorkerInfo("p9", "prefill"))
        finally:
            demoted.close()
    finally:
        publisher.stop()
        quiet.stop()
        index.close()
        quiet_index.close()


def _chat(gateway, content: str) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 16,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{gateway.http_port}/v1/chat/completions", data=body,
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=RPC_TIMEOUT_S) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_workers_and_gateway_over_sentinel_keep_serving_through_a_failover(sentinel_group, default_model_path):
    """Worker processes and a gateway given the redis+sentinel:// URL: requests are answered before, during
    (routing by load only) and after the failover, and both workers re-register on the new master."""
    group = sentinel_group
    cluster = Cluster(default_model_path, SimpleNamespace(url=group.url))   # Cluster reads only `.url`
    try:
        cluster.start_worker("prefill", "p0")
        cluster.start_worker("decode", "d0")
        cluster.wait_registered("p0", "d0")
        epochs_before = {w.worker_id: w.epoch for w in cluster.index.list_workers()}
        gateway = cluster.gateway()
        question = "What is the capital of France?"
        first = _chat(gateway, question)["choices"][0]["message"]["content"]
        assert "Paris" in first

        group.master.kill()
        assert _chat(gateway, question)["choices"][0]["message"]["content"] == first
        wait_until(group.promoted, FAILOVER_TIMEOUT_S, "the sentinels promote the replica")

        def reregistered() -> bool:
            epochs = {w.worker_id: w.epoch for w in cluster.index.list_workers() or []}
            return epochs.keys() == epochs_before.keys() and all(epochs[w] > epochs_before[w] for w in epochs)

        wait_until(reregistered, FAILOVER_TIMEOUT_S, "both workers re-register on the new master")
        after = _chat(gateway, question)
        assert after["choices"][0]["message"]["content"] == first
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert_idle(cluster.wait_idle())
    finally:
        cluster.close()
