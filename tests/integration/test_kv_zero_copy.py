"""Zero-copy same-host KV pushes (issue 16, kvstore.shm_cache) over real gRPC sockets and real shared memory:
the receiver copies blocks straight out of the sender's cache segment through one kept mapping; a corrupted
source block rejects the whole transfer and leaves nothing behind; an old receiver keeps the pooled path; a
sender killed mid-push and a restarted sender (new segment, new epoch) in their own processes; and a 1P+1D
pair whose prefill cache lives in shared memory gives the offline engine's tokens."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import start_server as start_decode
from engine.llm_engine import LLMEngine
from kernels import gather_blocks
from kvstore.shm import SHM_DIR
from kvstore.shm_cache import SharedKvCache, block_digests_in_place, is_cache_name
from kvstore.transfer import block_digest, encode_records
from kvstore.transfer_service import KvTransferServicer
from kvstore.kv_sender import FaultInjection, KvSender, TransferFailed
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.server import start_server as start_prefill
from tests.integration.test_kv_streaming import DST_IDS, SRC_IDS, push_outcome, record_push_digests
from tests.integration.test_kv_transfer import TIMEOUT_S, CacheReceiver, RankedReceiver, layout_of, source_cache
from tests.integration.test_workers import ENGINE, GREEDY, PROMPT, disaggregated, stubs, wait_idle
from tests.unit.engine.tiny_model import run, tiny_engine, tiny_loaded

REPO = Path(__file__).resolve().parents[2]
CACHE_BLOCKS = 64
NEW_FIELDS = ("cache_segment", "src_block_ids", "cache_num_blocks", "sender_epoch")


@pytest.fixture(scope="module")
def layout():
    return layout_of()


@pytest.fixture
def shared(layout):
    cache = SharedKvCache((layout.num_layers, 2, CACHE_BLOCKS, layout.block_size, layout.num_kv_heads,
                           layout.head_dim), torch.float32)
    yield cache
    cache.close()


def push(sender, endpoint, receiver, cache, layout, request_id, dst_ids=DST_IDS, **kw):
    handle = receiver.reserve(request_id, dst_ids)
    return sender.push(endpoint, request_id=request_id, handle=handle, layout=layout, kv_cache=cache,
                       src_block_ids=SRC_IDS, dst_block_ids=dst_ids, transport="shm",
                       timeout_s=kw.pop("timeout_s", TIMEOUT_S), **kw)


def landed(receiver, src, dst_ids=DST_IDS) -> bool:
    return torch.equal(gather_blocks(receiver.kv_cache, torch.tensor(dst_ids)),
                       gather_blocks(src, torch.tensor(SRC_IDS)))


def test_blocks_are_copied_out_of_the_senders_cache_through_one_kept_mapping(kv_served, layout, shared):
    # Hashing the blocks where they are gives exactly the digests of their records (the definition is kept).
    shared.tensor.copy_(source_cache(layout, CACHE_BLOCKS))
    records = encode_records(shared.tensor, SRC_IDS, "raw").view(len(SRC_IDS), -1)
    assert block_digests_in_place(shared.tensor, SRC_IDS) == tuple(block_digest(r.numpy()) for r in records)

    receiver = CacheReceiver(layout, 100)
    endpoint, servicer = kv_served(receiver)
    with KvSender(shm_pool_bytes=64 << 20, shared_cache=shared) as sender:
        for i in range(3):  # new bytes in the same blocks each time: the kept mapping must show them
            shared.tensor.copy_(source_cache(layout, CACHE_BLOCKS, seed=i))
            stats = push(sender, endpoint, receiver, shared.tensor, layout, f"req-{i}")
            assert stats.data_path == "cache" and stats.transport == "shm" and stats.num_bytes == 40 * 65536
            assert landed(receiver, shared.tensor)
        assert sender.segment_pool.stats().num_created == 0          # nothing staged
        # a cache not in shared memory (or the int8 codec) takes the pooled path, from the same sender
        assert push(sender, endpoint, receiver, source_cache(layout, CACHE_BLOCKS), layout,
                    "private").data_path == "pooled"
    probes = [m for m in receiver.checked if not m.request_id]
    assert probes == []                                              # the servicer answered the probe itself
    pushed = [m for m in receiver.checked if m.cache_segment]
    assert len(pushed) == 3 and {m.cache_segment for m in pushed} == {shared.name} and is_cache_name(shared.name)
    assert all(m.shm_name == "" and m.digests_in_trailer and m.sender_epoch == shared.epoch
               and list(m.src_block_ids) == SRC_IDS for m in pushed)
    assert servicer.segments.num_mapped == 2                         # the cache once, the pool's segment once
    assert [r[0] for r in receiver.committed] == ["req-0", "req-1", "req-2", "private"] and receiver.rejected == []


def test_a_tensor_parallel_receiver_gets_the_blocks_through_a_staging_buffer_and_its_plan(kv_served, layout, shared):
    shared.tensor.copy_(source_cache(layout, CACHE_BLOCKS))
    receiver = RankedReceiver(layout, 100, 2)  # one KV head per rank: not one cache to copy into
    endpoint, servicer = kv_served(receiver)
    with KvSender(shared_cache=shared) as sender:
        assert push(sender, endpoint, receiver, shared.tensor, layout, "tp").data_path == "cache"
    sent = gather_blocks(shared.tensor, torch.tensor(SRC_IDS))  # [n, L, 2, block_size, Hkv, D]
    for heads, cache in zip(receiver.rank_kv_heads, receiver.rank_caches):
        assert torch.equal(gather_blocks(cache, torch.tensor(DST_IDS)), sent[..., heads.start:heads.stop, :])
    assert servicer.buffers.idle_bytes() > 0 and [r[0] for r in receiver.committed] == ["tp"]


def test_a_corrupted_source_block_rejects_the_whole_transfer_and_leaves_nothing(kv_served, layout, shared):
    shared.tensor.copy_(source_cache(layout, CACHE_BLOCKS))
    before = shared.tensor.clone()
    receiver = CacheReceiver(layout, 100)
    untouched = receiver.kv_cache.clone()
    endpoint, _ = kv_served(receiver)
    with KvSender(shared_cache=shared) as sender:
        with pytest.raises(TransferFailed) as info:  # chunk 1 starts in block 32 (2 MiB / 64 KiB)
            push(sender, endpoint, receiver, shared.tensor, layout, "bad", fault=FaultInjection(corrupt_chunk_index=1))
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details.startswith("block_digests[32]: ") and "source block 8" in info.value.details
        assert torch.equal(shared.tensor, before)                      # the hook corrupted the read, not the KV
        rest = [b for b in range(100) if b not in DST_IDS]
        assert torch.equal(receiver.kv_cache[:, :, rest], untouched[:, :, rest])
        assert not receiver.kv_cache[:, :, DST_IDS].any()            # no byte of the rejected transfer stays
        assert [r[0] for r in receiver.rejected] == ["bad"] and receiver.committed == []
        push(sender, endpoint, receiver, shared.tensor, layout, "good")  # the same blocks, uncorrupted
    assert landed(receiver, shared.tensor) and [r[0] for r in receiver.committed] == ["good"]
    assert len(receiver.rejected) == 1                               # released once


def test_digests_the_caller_passes_go_as_they_are_and_the_receiver_checks_them(kv_served, layout, shared):
    # A prefill worker passes the digests its steps took (engine.kv_digests); the sender hashes only the others.
    # A passed digest that does not match the bytes (blocks changed since) rejects the transfer at the receiver.
    shared.tensor.copy_(source_cache(layout, CACHE_BLOCKS))
    truth = list(block_digests_in_place(shared.tensor, SRC_IDS))
    receiver = CacheReceiver(layout, 100)
    endpoint, _ = kv_served(receiver)
    with KvSender(shared_cache=shared) as sender:
        for i, known in enumerate((truth, [d if k % 3 else None for k, d in enumerate(truth)], [None] * 40)):
            stats = push(sender, endpoint, receiver, shared.tensor, layout, f"ok-{i}", block_digests=known)
            assert stats.data_path == "cache" and landed(receiver, shared.tensor)
        stale = list(truth)
        stale[5] = bytes(16)
        with pytest.raises(TransferFailed) as info:
            push(sender, endpoint, receiver, shared.tensor, layout, "stale", block_digests=stale)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details.startswith("block_digests[5]: ")
        assert not receiver.kv_cache[:, :, DST_IDS].any()            # no byte of the rejected transfer stays
        for bad in (truth[:-1], [*truth[:-1], b"short"]):
            with pytest.raises(ValueError, match="block_digests"):
                push(sender, endpoint, receiver, shared.tensor, layout, "bad", block_digests=bad)
    assert [r[0] for r in receiver.committed] == ["ok-0", "ok-1", "ok-2"]


def test_blocks_reused_after_a_push_timed_out_are_caught_by_the_digests_of_what_landed(kv_served, layout, shared):
    # The sender holds the blocks until its push returns; one that times out frees them while the receiver may
    # still copy. Blocks rewritten then must not be committed: the receiver hashes what landed.
    shared.tensor.copy_(source_cache(layout, CACHE_BLOCKS))
    receiver = CacheReceiver(layout, 100)
    endpoint, _ = kv_served(receiver)
    gate, check = threading.Event(), receiver.check
    receiver.check = lambda manifest: (gate.wait(TIMEOUT_S) if manifest.request_id else None, check(manifest))[1]
    with KvSender(shared_cache=shared) as sender:
        with pytest.raises(TransferFailed) as info:
            push(sender, endpoint, receiver, shared.tensor, layout, "slow", timeout_s=1.0)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        shared.tensor[:, :, SRC_IDS[5]] += 1.0                       # the freed block, reused by another request
        gate.set()
        _wait(lambda: receiver.rejected)
    assert [r[0] for r in receiver.rejected] == ["slow"] and receiver.committed == []
    # (here the deadline cut the stream before the receiver read the trailer; had it read it, block 5 mismatches)
    assert receiver.rejected[0][2].startswith(("data: the Push stream was cut", "block_digests[5]: "))
    assert not receiver.kv_cache[:, :, DST_IDS].any()


def test_a_receiver_killed_mid_push_fails_it_promptly(layout, shared):
    # A KvTransfer server in its own process that answers the probe, takes the victim's manifest, says so, then
    # waits to be killed: the push must fail with a retryable status, not hang.
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import threading
        from concurrent import futures
        import grpc
        from kvstore.transfer_service import GRPC_OPTIONS, KvTransferServicer, add_kv_transfer_servicer

        class Stuck:
            def check(self, manifest):
                print("checked", flush=True)
                threading.Event().wait()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
        add_kv_transfer_servicer(KvTransferServicer(Stuck()), server)
        print(server.add_insecure_port("127.0.0.1:0"), flush=True)
        server.start()
        threading.Event().wait()
    """)], cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        endpoint = f"127.0.0.1:{child.stdout.readline().strip()}"
        with KvSender(shared_cache=shared) as sender:
            result: list = []
            thread = threading.Thread(target=lambda: result.append(push_outcome(sender, endpoint, layout, shared.tensor, "shm", "victim")))
            thread.start()
            assert child.stdout.readline().strip() == "checked"
            child.send_signal(signal.SIGKILL)
            thread.join(TIMEOUT_S)
            assert not thread.is_alive()
            assert isinstance(result[0], TransferFailed) and result[0].code == grpc.StatusCode.UNAVAILABLE
            assert sender.data_path(endpoint, shared.tensor, layout, "shm", "raw", time.perf_counter() + 5) == "cache"
    finally:
        child.kill()
        child.wait()


class OldServicer(KvTransferServicer):
    """A receiver that predates KvManifest 17-20: it never sees those fields (unknown to its protobuf)."""

    def Push(self, request_iterator, context):
        def as_before():
            first = next(request_iterator)
            for name in NEW_FIELDS:
                first.manifest.ClearField(name)
            yield first
            yield from request_iterator

        return super().Push(as_before(), context)


def test_an_old_receiver_refuses_the_probe_and_keeps_the_pooled_path(kv_served, layout, shared):
    shared.tensor.copy_(source_cache(layout, CACHE_BLOCKS))
    receiver = CacheReceiver(layout, 100)
    endpoint, _ = kv_served(receiver, OldServicer)
    with KvSender(shm_pool_bytes=64 << 20, shared_cache=shared) as sender:
        for i in range(2):
            assert push(sender, endpoint, receiver, shared.tensor, layout, f"old-{i}").data_path == "pooled"
            assert landed(receiver, shared.tensor)
    # one probe, refused at the handle check: nothing was reserved, so nothing was released
    assert [m.request_id for m in receiver.checked] == ["", "old-0", "old-1"] and receiver.rejected == []
    assert [r[0] for r in receiver.committed] == ["old-0", "old-1"]


def _sender_process(layout, seed: int, request_ids: list[str], endpoint: str,
                    stop_before_trailer: str | None = None) -> subprocess.Popen:
    """A prefill worker's sending side in its own process: a shared cache filled with source_cache(seed),
    pushing SRC_IDS for each request id in turn (dst blocks by request id prefix), printing after each. The push
    of `stop_before_trailer` sends its manifest and then hangs where it would hash the blocks for its trailer, so
    that a kill always lands mid-push (a trailer already sent would complete the transfer, rightly)."""
    code = f"""
        import sys, time, torch
        import kvstore.kv_sender
        from kvstore.shm_cache import SharedKvCache
        from kvstore.kv_sender import KvSender
        from tests.integration.test_kv_transfer import layout_of, source_cache
        hashed = kvstore.kv_sender.block_digests_in_place
        def digests(cache, block_ids, pushes=[0]):
            pushes[0] += 1
            if {request_ids!r}[pushes[0] - 1] == {stop_before_trailer!r}:
                time.sleep(3600)
            return hashed(cache, block_ids)
        kvstore.kv_sender.block_digests_in_place = digests
        CACHE_BLOCKS, SRC_IDS, DST = {CACHE_BLOCKS}, {SRC_IDS!r}, { {r: dst_ids_for(r) for r in request_ids}!r}
        layout = layout_of()
        cache = SharedKvCache(source_cache(layout, CACHE_BLOCKS).shape, torch.float32)
        cache.tensor.copy_(source_cache(layout, CACHE_BLOCKS, seed={seed}))
        print(cache.name, flush=True)
        with KvSender(shared_cache=cache) as sender:
            for rid in {request_ids!r}:
                stats = sender.push({endpoint!r}, request_id=rid, handle="h-" + rid, layout=layout,
                                    kv_cache=cache.tensor, src_block_ids=SRC_IDS, dst_block_ids=DST[rid],
                                    transport="shm", timeout_s=120)
                print(stats.data_path, flush=True)
        cache.close()
    """
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def dst_ids_for(request_id: str) -> list[int]:
    return DST_IDS if request_id.startswith("ok") else [i * 2 for i in range(40)]


def _wait(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert condition()


def test_a_sender_killed_mid_push_and_a_restarted_one(kv_served, layout):
    receiver = CacheReceiver(layout, 100)
    noise = receiver.kv_cache.clone()
    endpoint, servicer = kv_served(receiver)
    for rid in ("ok-1", "ok-2", "victim", "ok-after-restart"):
        receiver.reserve(rid, dst_ids_for(rid))
    arrived, gate = threading.Event(), threading.Event()
    check = receiver.check

    def gated_check(manifest):  # the victim's push waits here, mid-push, until its sender is dead
        if manifest.request_id == "victim":
            arrived.set()
            gate.wait(TIMEOUT_S)
        return check(manifest)

    receiver.check = gated_check

    first = _sender_process(layout, 1, ["ok-1", "ok-2", "victim"], endpoint, stop_before_trailer="victim")
    try:
        name = first.stdout.readline().strip()
        assert [first.stdout.readline().strip() for _ in range(2)] == ["cache", "cache"]
        assert landed(receiver, source_cache(layout, CACHE_BLOCKS, seed=1))
        assert servicer.segments.num_mapped == 1                     # two pushes, one mapping
        assert arrived.wait(TIMEOUT_S)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    gate.set()
    _wait(lambda: receiver.rejected)
    assert [r[0] for r in receiver.rejected] == ["victim"] and len(receiver.committed) == 2
    victim = dst_ids_for("victim")  # each block as it was, or zeroed: nothing of the cut transfer stays
    assert all(torch.equal(receiver.kv_cache[:, :, b], noise[:, :, b]) or not receiver.kv_cache[:, :, b].any()
               for b in victim)
    _wait(lambda: not (SHM_DIR / name).exists())                     # the dead sender's tracker unlinked it

    second = _sender_process(layout, 2, ["ok-after-restart"], endpoint)
    try:
        assert second.stdout.readline().strip() != name
        assert second.stdout.readline().strip() == "cache"
    finally:
        second.wait(timeout=60)
    assert landed(receiver, source_cache(layout, CACHE_BLOCKS, seed=2))
    assert servicer.segments.num_mapped == 2 and servicer.segments.num_mappings() == 1  # the old mapping dropped
    assert not any(SHM_DIR.glob(f"pdkv_{first.pid:x}_*")) and not any(SHM_DIR.glob(f"pdkv_{second.pid:x}_*"))


def test_a_1p1d_pair_with_the_prefill_cache_in_shared_memory_gives_the_offline_tokens():
    d = start_decode(DecodeWorkerConfig("d0", None, max_lease_ms=60_000, insecure_internal=True), ENGINE,
                     engine=tiny_engine())
    endpoint = f"127.0.0.1:{d.port}"
    p = start_prefill(PrefillWorkerConfig("p0", None, transport="shm", decode_endpoints=(endpoint,)), ENGINE,
                      engine=LLMEngine(ENGINE, loaded=tiny_loaded(), kv_cache_in_shm=True, kv_digests=True))
    segment = p.worker.loop.engine.runner.kv_segment
    passed = record_push_digests(p)  # request id -> the digests the worker passed
    try:
        pstub, dstub = stubs(p, d)
        for rid, prompt in (("r1", PROMPT), ("r2", PROMPT + [7, 8, 9])):  # r2: a delta of r1's blocks
            tokens, pre, _ = disaggregated(pstub, dstub, rid, prompt, GREEDY)
            assert tokens == run(tiny_engine(), [prompt], [GREEDY])[0]
            assert pre.transport == "shm" and pre.transfer_bytes > 0
        assert passed["r1"] and None not in passed["r1"]             # the prefill steps took every digest
        sender = p.worker.sender
        assert sender.data_path(endpoint, segment.tensor, p.worker.layout, "shm", "raw",
                                time.perf_counter() + 10) == "cache"
        assert sender.segment_pool.stats().num_created == 0          # every push went zero-copy
        assert wait_idle(dstub).used_blocks == 0 and wait_idle(pstub).used_blocks == 0
    finally:
        p.stop(0)
        d.stop(0)
    assert segment is not None and not (SHM_DIR / segment.name).exists()   # unlinked at shutdown


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_1p1d_pair_with_bfloat16_kv_caches_gives_one_such_engines_tokens(transport):
    """kv_cache_dtype="bfloat16" on both workers: the prefill worker's bfloat16 blocks (zero-copy out of its
    shared-memory cache, or in gRPC chunks) land in the decode worker's bfloat16 cache and decode to the tokens one
    engine with such a cache gives alone."""
    config = dataclasses.replace(ENGINE, kv_cache_dtype="bfloat16")
    d = start_decode(DecodeWorkerConfig("d0", None, max_lease_ms=60_000, insecure_internal=True), config,
                     engine=tiny_engine(kv_cache_dtype="bfloat16"))
    endpoint = f"127.0.0.1:{d.port}"
    p = start_prefill(PrefillWorkerConfig("p0", None, transport=transport, decode_endpoints=(endpoint,)), config,
                      engine=LLMEngine(config, loaded=tiny_loaded(), kv_cache_in_shm=True, kv_digests=True))
    try:
        assert p.worker.layout.dtype == d.worker.layout.dtype == "bfloat16"
        pstub, dstub = stubs(p, d)
        for rid, prompt in (("r1", PROMPT), ("r2", PROMPT + [7, 8, 9])):
            tokens, pre, _ = disaggregated(pstub, dstub, rid, prompt, GREEDY)
            assert tokens == run(tiny_engine(kv_cache_dtype="bfloat16"), [prompt], [GREEDY])[0]
            assert pre.transport == transport and pre.transfer_bytes > 0
        assert wait_idle(dstub).used_blocks == 0 and wait_idle(pstub).used_blocks == 0
        assert d.worker.num_transfer_errors == 0
    finally:
        p.stop(0)
        d.stop(0)
