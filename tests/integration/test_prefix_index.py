"""The Redis prefix index against a real redis-server, checked against a plain-dict model (`Oracle`)."""
import random
import time

import pytest
import redis

from kvstore.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored
from kvstore.embedded_redis import EmbeddedRedis
from kvstore.hashing import block_hash_hex, hash_prompt_blocks, root_hash
from kvstore.index import IndexUnavailable, PrefixIndex, worker_from_record, worker_to_record
from kvstore.index_publisher import IndexPublisher
from kvstore.local_index import WorkerInfo, WorkerNotRegistered

ROOT = root_hash("test-model")
PROMPT = hash_prompt_blocks(list(range(160)), 16, ROOT)     # 10 blocks


class Oracle:
    """The index's semantics (module doc of kvstore.index) over plain dicts, without TTLs."""

    def __init__(self) -> None:
        self.epochs: dict[str, int] = {}          # worker_id -> epoch counter
        self.live: dict[str, tuple[str, int]] = {}  # worker_id -> (role, current epoch)
        self.hashes: dict[str, set[int]] = {}     # worker_id -> hashes of its current epoch

    def register(self, worker: WorkerInfo) -> int:
        epoch = self.epochs[worker.worker_id] = self.epochs.get(worker.worker_id, 0) + 1
        self.live[worker.worker_id] = (worker.role, epoch)
        self.hashes[worker.worker_id] = set()
        return epoch

    def deregister(self, worker_id: str, epoch: int) -> None:
        if self.live.get(worker_id, (None, None))[1] == epoch:
            del self.live[worker_id], self.hashes[worker_id]

    def publish(self, worker_id: str, epoch: int, events) -> int:
        role, current = self.live[worker_id]
        assert current == epoch
        for event in events:
            if isinstance(event, AllBlocksCleared):
                epoch = self.epochs[worker_id] = self.epochs[worker_id] + 1
                self.live[worker_id] = (role, epoch)
                self.hashes[worker_id] = set()
            elif isinstance(event, BlockStored):
                self.hashes[worker_id].update(event.block_hashes)
            else:
                self.hashes[worker_id].difference_update(event.block_hashes)
        return epoch

    def lookup(self, block_hashes, role=None) -> dict[str, int]:
        counts = {}
        for worker_id, (worker_role, _) in self.live.items():
            if role in (None, worker_role):
                n = 0
                while n < len(block_hashes) and block_hashes[n] in self.hashes[worker_id]:
                    n += 1
                counts[worker_id] = n
        return counts


def wait_until(condition, timeout_s=10.0):
    """Poll ``condition`` until it returns a truthy value; fail after a generous bound."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s}s (last value {value!r})")
        time.sleep(0.02)


def raw_keys(url):
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return sorted(client.keys("pdserve:*"))
    finally:
        client.close()


@pytest.fixture
def index(redis_url):
    idx = PrefixIndex(redis_url, worker_ttl_s=30.0)
    yield idx
    idx.close()


def test_lookup_returns_exact_leading_blocks_per_worker(index):
    d0 = index.register(WorkerInfo("d0", "decode"))
    d1 = index.register(WorkerInfo("d1", "decode"))
    p0 = index.register(WorkerInfo("p0", "prefill"))
    assert (d0, d1, p0) == (1, 1, 1)
    index.publish("d0", d0, [BlockStored(tuple(PROMPT))])
    index.publish("d1", d1, [BlockStored(tuple(PROMPT[:4])), BlockStored(tuple(PROMPT[5:]))])
    index.publish("p0", p0, [BlockStored(tuple(PROMPT[1:]))])

    assert index.lookup(PROMPT, "decode") == {"d0": 10, "d1": 4}
    assert index.lookup(PROMPT, "prefill") == {"p0": 0}
    assert index.lookup(PROMPT) == {"d0": 10, "d1": 4, "p0": 0}
    assert index.lookup(PROMPT[:3], "decode") == {"d0": 3, "d1": 3}
    assert index.lookup([], "decode") == {"d0": 0, "d1": 0}
    assert index.lookup(hash_prompt_blocks(list(range(160)), 16, ROOT, "tenant-a")) == {
        "d0": 0, "d1": 0, "p0": 0}

    assert index.publish("d0", d0, [BlockRemoved((PROMPT[6],))]) == d0
    assert index.lookup(PROMPT, "decode") == {"d0": 6, "d1": 4}


def test_match_returns_each_live_workers_typed_record_and_load(index):
    registered = WorkerInfo("d0", "decode", "10.0.0.5:50061", capacity_blocks=512, free_blocks=500, running=1,
                            waiting=0, block_size=16, fingerprint="fp", max_model_len=2048, host_id="host-a")
    epoch = index.register(registered)
    index.heartbeat("d0", epoch, free_blocks=480, running=3, waiting=2)
    index.publish("d0", epoch, [BlockStored(tuple(PROMPT[:2]))])
    [match] = index.match(PROMPT, "decode")
    assert match.num_cached_blocks == 2
    assert match.worker == WorkerInfo("d0", "decode", "10.0.0.5:50061", epoch=1, capacity_blocks=512,
                                      free_blocks=480, running=3, waiting=2, block_size=16, fingerprint="fp",
                                      max_model_len=2048, host_id="host-a")
    assert index.list_workers("decode") == [match.worker]
    assert index.list_workers("prefill") == []


def test_worker_records_round_trip_and_older_string_records_are_read():
    worker = WorkerInfo("p0", "prefill", "h:1", block_size=16, fingerprint="fp", max_model_len=4096, host_id="x")
    assert worker_from_record("p0", "prefill", worker_to_record(worker)) == worker
    assert worker_to_record(WorkerInfo("p0", "prefill")) == "{}"
    old = '{"grpc": "h:1", "block_size": "16", "max_model_len": "4096", "fingerprint": "fp", "host_id": "x"}'
    assert worker_from_record("p0", "prefill", old) == worker


def test_new_epoch_invalidates_old_entries_and_old_epoch_is_refused(index, redis_url):
    old = index.register(WorkerInfo("d0", "decode"))
    index.publish("d0", old, [BlockStored(tuple(PROMPT))])
    new = index.register(WorkerInfo("d0", "decode"))        # the worker restarted
    assert (old, new) == (1, 2)
    assert index.lookup(PROMPT, "decode") == {"d0": 0}
    with pytest.raises(WorkerNotRegistered):
        index.publish("d0", old, [BlockStored(tuple(PROMPT))])
    with pytest.raises(WorkerNotRegistered):
        index.heartbeat("d0", old, 0, 0, 0)
    index.publish("d0", new, [BlockStored(tuple(PROMPT[:2]))])
    assert index.lookup(PROMPT, "decode") == {"d0": 2}

    assert raw_keys(redis_url) == ["pdserve:blocks:d0:2", "pdserve:epoch:d0", "pdserve:role:decode",
                                   "pdserve:worker:d0"]    # epoch 1's set was freed at re-register
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    assert client.smembers("pdserve:blocks:d0:2") == {block_hash_hex(PROMPT[0]), block_hash_hex(PROMPT[1])}
    client.close()


def test_long_prompts_cross_the_script_chunk_limits(index):
    long_prompt = hash_prompt_blocks([7] * 16 * 9000, 16, ROOT)          # 9000 blocks, 144k tokens
    epoch = index.register(WorkerInfo("d0", "decode"))
    index.publish("d0", epoch, [BlockStored(tuple(long_prompt[:8500]))])
    assert index.lookup(long_prompt, "decode") == {"d0": 8500}
    index.publish("d0", epoch, [BlockRemoved(tuple(long_prompt[4321:4322]))])
    assert index.lookup(long_prompt, "decode") == {"d0": 4321}


def test_role_change_moves_the_worker(index):
    index.register(WorkerInfo("w", "prefill"))
    index.register(WorkerInfo("w", "decode"))
    assert index.lookup(PROMPT, "prefill") == {}
    assert index.lookup(PROMPT, "decode") == {"w": 0}


def test_all_blocks_cleared_starts_a_new_epoch(index, redis_url):
    epoch = index.register(WorkerInfo("d0", "decode"))
    index.publish("d0", epoch, [BlockStored(tuple(PROMPT))])
    new_epoch = index.publish("d0", epoch, [AllBlocksCleared(), BlockStored(tuple(PROMPT[:3]))])
    assert new_epoch == 2
    assert index.lookup(PROMPT, "decode") == {"d0": 3}
    assert index.list_workers("decode")[0].epoch == 2
    with pytest.raises(WorkerNotRegistered):
        index.publish("d0", epoch, [])
    assert "pdserve:blocks:d0:1" not in raw_keys(redis_url)


def test_deregister_and_heartbeat_expiry(redis_url):
    index = PrefixIndex(redis_url, worker_ttl_s=2.0)
    live = index.register(WorkerInfo("d0", "decode"))
    dying = index.register(WorkerInfo("d1", "decode"))
    gone = index.register(WorkerInfo("d2", "decode"))
    for worker_id, epoch in (("d0", live), ("d1", dying), ("d2", gone)):
        index.publish(worker_id, epoch, [BlockStored(tuple(PROMPT))])
    index.deregister("d2", gone)
    assert index.lookup(PROMPT, "decode") == {"d0": 10, "d1": 10}

    def d1_expired():
        index.heartbeat("d0", live, 0, 0, 0)                 # only d0 stays alive
        return index.lookup(PROMPT, "decode") == {"d0": 10}
    wait_until(d1_expired)
    with pytest.raises(WorkerNotRegistered):
        index.heartbeat("d1", dying, 0, 0, 0)
    with pytest.raises(WorkerNotRegistered):
        index.publish("d1", dying, [])
    assert [k for k in raw_keys(redis_url) if k.startswith("pdserve:blocks:")] == ["pdserve:blocks:d0:1"]
    index.close()


def test_collect_garbage_sweeps_dead_workers_of_every_role(redis_url):
    index = PrefixIndex(redis_url, worker_ttl_s=1.0)
    for worker_id, role in (("p0", "prefill"), ("d0", "decode")):
        index.publish(worker_id, index.register(WorkerInfo(worker_id, role)), [BlockStored(tuple(PROMPT))])
    wait_until(lambda: not any(k.startswith("pdserve:worker:") for k in raw_keys(redis_url)))
    assert index.collect_garbage() == 2
    assert index.collect_garbage() == 0
    assert raw_keys(redis_url) == ["pdserve:epoch:d0", "pdserve:epoch:p0"]
    index.close()


def test_matches_the_local_index_on_random_operations(index):
    oracle = Oracle()
    rng = random.Random(20240607)
    prompts = [hash_prompt_blocks([p] * 8 + list(range(1024)), 16, ROOT) for p in range(3)]  # 64 blocks
    universe = sorted({h for prompt in prompts for h in prompt})
    epochs: dict[str, int] = {}
    seen_counts = set()
    for step in range(300):
        worker_id = f"w{rng.randrange(16)}"
        action = rng.random()
        if worker_id not in epochs or action < 0.03:
            role = "decode" if int(worker_id[1:]) % 2 else "prefill"
            epochs[worker_id] = index.register(WorkerInfo(worker_id, role))
            assert oracle.register(WorkerInfo(worker_id, role)) == epochs[worker_id]
        elif action < 0.05:
            index.deregister(worker_id, epochs[worker_id])
            oracle.deregister(worker_id, epochs.pop(worker_id))
        else:
            events = []
            for _ in range(rng.randrange(1, 4)):
                kind = rng.random()
                if kind < 0.02:
                    events.append(AllBlocksCleared())
                elif kind < 0.3:
                    events.append(BlockRemoved(tuple(rng.sample(universe, 8))))
                else:
                    prompt = prompts[rng.randrange(3)]
                    start = rng.choice((0, 0, rng.randrange(len(prompt))))
                    events.append(BlockStored(tuple(prompt[start:start + rng.randrange(1, 64)])))
            before = epochs[worker_id]
            epochs[worker_id] = index.publish(worker_id, before, events)
            assert oracle.publish(worker_id, before, events) == epochs[worker_id]
        if step % 10 == 0:
            assert index.collect_garbage() == 0
        for prompt in prompts:
            for role in ("decode", "prefill", None):
                expected = oracle.lookup(prompt, role)
                assert index.lookup(prompt, role) == expected
                seen_counts.update(expected.values())
    assert len(seen_counts) > 20 and max(seen_counts) > 32      # the walk was exercised, not just zeros


def test_redis_down_lookups_return_none_and_republish_restores(own_redis):
    index = PrefixIndex(own_redis.url, worker_ttl_s=5.0, breaker_cooldown_s=2.0)
    pool = BlockPool(10)
    blocks = pool.allocate(10)
    for block_id, block_hash in zip(blocks, PROMPT):
        pool.cache_block(block_id, block_hash)
    pool.take_events()                                       # covered by initial_hashes
    publisher = IndexPublisher(index, WorkerInfo("d0", "decode"), flush_interval_s=0.02,
                               initial_hashes=pool.get_cached_hashes())
    publisher.start()
    wait_until(lambda: index.lookup(PROMPT, "decode") == {"d0": 10})

    own_redis.stop()
    started = time.monotonic()
    assert index.lookup(PROMPT, "decode") is None
    assert index.list_workers() is None
    assert index.match(PROMPT) is None
    assert time.monotonic() - started < 1.0                 # contract: <= 100 ms each
    with pytest.raises(IndexUnavailable):
        index.register(WorkerInfo("d9", "decode"))

    pool.free(blocks[::-1])
    assert pool.allocate(7) == [9, 8, 7, 6, 5, 4, 3]         # evicts PROMPT[3:]
    publisher.submit(pool.take_events())                     # never blocks nor raises while Redis is down
    wait_until(lambda: not publisher.synced)

    own_redis.start()                                        # same port, empty: the index was lost
    wait_until(lambda: index.lookup(PROMPT, "decode") == {"d0": 3})
    stats = publisher.get_stats()
    assert stats.num_republishes == 2 and stats.epoch == 1 and stats.synced
    assert stats.num_dropped_events == 1
    publisher.stop()
    assert index.lookup(PROMPT, "decode") == {}
    index.close()


def test_stalled_redis_lookup_returns_none_within_bounded_time(own_redis):
    index = PrefixIndex(own_redis.url, lookup_timeout_s=0.05, breaker_cooldown_s=0.2)
    index.register(WorkerInfo("d0", "decode"))
    assert index.lookup(PROMPT) == {"d0": 0}
    own_redis.pause()
    try:
        started = time.monotonic()
        assert index.lookup(PROMPT) is None
        assert time.monotonic() - started < 1.0             # contract: <= 100 ms
    finally:
        own_redis.resume()
    wait_until(lambda: index.lookup(PROMPT) == {"d0": 0})   # after the breaker's cooldown
    index.close()


def test_publisher_tracks_the_pool_and_recovers_an_expired_record(redis_url):
    index = PrefixIndex(redis_url, worker_ttl_s=30.0)
    pool = BlockPool(4)
    publisher = IndexPublisher(index, WorkerInfo("d0", "decode", capacity_blocks=4), heartbeat_interval_s=0.05)
    assert publisher.flush() is True
    blocks = pool.allocate(4)
    for block_id, block_hash in zip(blocks, PROMPT):
        pool.cache_block(block_id, block_hash)
    publisher.submit(pool.take_events())
    publisher.set_load(free_blocks=0, running=1, waiting=0)
    publisher.flush()
    assert index.lookup(PROMPT, "decode") == {"d0": 4}

    pool.free(blocks[::-1])
    assert pool.clear_cache() is True
    [block_id] = pool.allocate(1)
    pool.cache_block(block_id, PROMPT[0])
    publisher.submit(pool.take_events())
    publisher.flush()
    assert publisher.epoch == 2 and index.lookup(PROMPT, "decode") == {"d0": 1}

    index.deregister("d0", publisher.epoch)                  # as if the record had expired
    time.sleep(0.06)                                         # let a heartbeat fall due
    publisher.flush()                                        # heartbeat refused -> resync
    assert publisher.flush() is True
    assert publisher.epoch == 3 and publisher.get_stats().num_republishes == 2
    assert index.lookup(PROMPT, "decode") == {"d0": 1}
    assert index.list_workers("decode")[0].running == 1
    publisher.stop(deregister=False)
    assert index.lookup(PROMPT, "decode") == {"d0": 1}
    index.close()


def test_publisher_overflow_drops_pending_then_republishes_everything(redis_url):
    index = PrefixIndex(redis_url)
    publisher = IndexPublisher(index, WorkerInfo("d0", "decode"), initial_hashes=PROMPT[:2],
                               max_pending_hashes=4, max_hashes_per_call=3)
    publisher.flush()
    assert index.lookup(PROMPT, "decode") == {"d0": 2}
    publisher.submit([BlockStored((PROMPT[2],)), BlockStored(tuple(PROMPT[3:8]))])
    assert not publisher.synced and publisher.get_stats().num_dropped_events == 2
    assert publisher.flush() is True
    assert index.lookup(PROMPT, "decode") == {"d0": 8} and publisher.epoch == 2
    publisher.stop()


def test_auth_and_acl_user_via_url():
    with EmbeddedRedis(password="s3cret/pw") as server:
        assert PrefixIndex(server.url.replace(":s3cret%2Fpw@", "")).lookup(PROMPT) is None
        with pytest.raises(IndexUnavailable):
            PrefixIndex(server.url.replace("s3cret%2Fpw", "wrong")).register(WorkerInfo("d0", "decode"))

        index = PrefixIndex(server.url)
        epoch = index.register(WorkerInfo("d0", "decode"))
        index.publish("d0", epoch, [BlockStored(tuple(PROMPT[:5]))])
        assert index.lookup(PROMPT) == {"d0": 5}

        admin = redis.Redis.from_url(server.url)
        admin.execute_command("ACL", "SETUSER", "router", "on", ">router-pw", "~pdserve:*", "+@all")
        admin.close()
        router = PrefixIndex(f"redis://router:router-pw@127.0.0.1:{server.port}/0")
        assert router.lookup(PROMPT) == {"d0": 5}
        assert PrefixIndex(f"redis://router:bad@127.0.0.1:{server.port}/0").lookup(PROMPT) is None


def test_unix_socket_url():
    with EmbeddedRedis(unix_socket=True) as server:
        assert server.url.startswith("unix://")
        index = PrefixIndex(server.url)
        epoch = index.register(WorkerInfo("d0", "decode"))
        index.publish("d0", epoch, [BlockStored(tuple(PROMPT[:3]))])
        assert index.lookup(PROMPT) == {"d0": 3}
        index.close()
