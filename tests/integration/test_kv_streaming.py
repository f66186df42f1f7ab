"""KV at memory speed (issue 16), end to end over real gRPC sockets and real shared memory: streamed pushes with
the digests in a trailer (those the prefill took sent as given), the sender's segment pool (reuse, and no segment
left behind on rejection, timeout or the sender's death), and a receiver that dies mid-stream."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import start_server as start_decode
from engine.llm_engine import LLMEngine
from kernels import gather_blocks
from kvstore.shm import SHM_DIR, SegmentRefused
from kvstore.shm_cache import block_digests_in_place
from kvstore.shm_pool import PooledSegmentReader, is_pooled_name
from kvstore.transfer import block_digest, encode_records, iter_chunks
from kvstore.transfer_manifest import TransferManifest
from kvstore.transfer_service import GRPC_OPTIONS, KvTransferServicer, add_kv_transfer_servicer
from kvstore.kv_sender import FaultInjection, KvSender, TransferFailed
from prefill_worker import server as prefill_server
from prefill_worker.config import PrefillWorkerConfig
from protos.convert import manifest_to_pb
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.integration.test_kv_transfer import TIMEOUT_S, CacheReceiver, layout_of, source_cache
from tests.integration.test_workers import ENGINE, GREEDY, PROMPT, disaggregated, stubs, wait_idle
from tests.unit.engine.tiny_model import run, tiny_engine, tiny_loaded

REPO = Path(__file__).resolve().parents[2]
SRC_IDS = list(range(40, 0, -1))           # 40 blocks of 64 KiB: 2.5 MiB, two chunks, several groups
DST_IDS = [i * 2 + 1 for i in range(40)]
POOL_BYTES = 64 << 20


@pytest.fixture(scope="module")
def layout():
    return layout_of()


@pytest.fixture(scope="module")
def src(layout):
    return source_cache(layout, 64)


def push(sender, endpoint, receiver, src, layout, request_id, transport, **kw):
    handle = receiver.reserve(request_id, DST_IDS)
    return sender.push(endpoint, request_id=request_id, handle=handle, layout=layout, kv_cache=src,
                       src_block_ids=SRC_IDS, dst_block_ids=DST_IDS, transport=transport,
                       timeout_s=kw.pop("timeout_s", TIMEOUT_S), **kw)


def landed(receiver, src) -> bool:
    dst = torch.tensor(DST_IDS)
    return torch.equal(gather_blocks(receiver.kv_cache, dst), gather_blocks(src, torch.tensor(SRC_IDS)))


def test_grpc_push_streams_the_digests_in_a_trailer_without_staging_buffers(kv_served, layout, src):
    receiver = CacheReceiver(layout, 100)
    endpoint, servicer = kv_served(receiver)
    with KvSender() as sender:
        for i in range(2):
            push(sender, endpoint, receiver, src, layout, f"req-{i}", "grpc")
        assert sender.staging.num_allocated == 0   # raw blocks of a CPU cache: chunks joined out of the cache
    assert [(m.digests_in_trailer, m.block_digests) for m in receiver.checked] == [(True, ())] * 2
    assert landed(receiver, src) and len(receiver.committed) == 2 and receiver.rejected == []
    assert servicer.buffers.num_allocated == 0      # and landed straight in the destination blocks


def test_grpc_push_sends_the_digests_the_caller_passes_and_the_receiver_checks_them(kv_served, layout, src):
    # A prefill worker passes the digests its steps took (engine.kv_digests): the raw grpc path copies those
    # blocks into the messages without hashing them and sends the digests as given; the receiver hashes what
    # landed, so a stale digest, or a chunk changed on the wire, still rejects the whole transfer.
    truth = [block_digest(r.numpy()) for r in encode_records(src, SRC_IDS, "raw").view(len(SRC_IDS), -1)]
    receiver = CacheReceiver(layout, 100)
    endpoint, _ = kv_served(receiver)
    with KvSender() as sender:
        for i, known in enumerate((truth, [d if k % 3 else None for k, d in enumerate(truth)])):
            push(sender, endpoint, receiver, src, layout, f"ok-{i}", "grpc", block_digests=known)
            assert landed(receiver, src)
        stale = list(truth)
        stale[5] = bytes(16)
        with pytest.raises(TransferFailed) as info:
            push(sender, endpoint, receiver, src, layout, "stale", "grpc", block_digests=stale)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details.startswith("block_digests[5]: ")
        assert not receiver.kv_cache[:, :, DST_IDS].any()            # no byte of the rejected transfer stays
        with pytest.raises(TransferFailed) as info:
            push(sender, endpoint, receiver, src, layout, "wire", "grpc", block_digests=truth,
                 fault=FaultInjection(corrupt_chunk_index=1))
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details.startswith("block_digests[")
    assert [r[0] for r in receiver.committed] == ["ok-0", "ok-1"]
    assert [r[0] for r in receiver.rejected] == ["stale", "wire"]


def test_grpc_int8_push_reuses_the_staging_buffers_on_both_sides(kv_served, layout, src):
    receiver = CacheReceiver(layout, 100)
    endpoint, servicer = kv_served(receiver)
    with KvSender() as sender:
        for i in range(2):
            push(sender, endpoint, receiver, src, layout, f"req-{i}", "grpc", codec="int8")
        assert sender.staging.num_allocated == 1   # the sender's staging buffer came back and was reused
    assert len(receiver.committed) == 2 and receiver.rejected == []
    assert servicer.buffers.num_allocated == 1      # the second transfer landed in the first one's buffer


def test_corrupted_trailer_digest_rejects_the_whole_transfer_and_releases_once(kv_served, layout, src):
    receiver = CacheReceiver(layout, 100)
    before = receiver.kv_cache.clone()
    endpoint, _ = kv_served(receiver)
    with KvSender() as sender, pytest.raises(TransferFailed) as info:
        push(sender, endpoint, receiver, src, layout, "req-1", "grpc", fault=FaultInjection(corrupt_trailer_digest=7))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details.startswith("block_digests[7]: ")
    rest = [b for b in range(100) if b not in DST_IDS]
    assert torch.equal(receiver.kv_cache[:, :, rest], before[:, :, rest])
    assert not receiver.kv_cache[:, :, DST_IDS].any()  # landed as it came, zeroed on rejection: nothing stays
    assert receiver.committed == [] and [r[:2] for r in receiver.rejected] == [("req-1", "h-req-1")]


def test_a_sender_with_the_digests_in_the_manifest_still_lands_and_a_missing_trailer_is_refused(kv_served, layout, src):
    receiver = CacheReceiver(layout, 100)
    endpoint, _ = kv_served(receiver)
    payload = encode_records(src, SRC_IDS, "raw")
    bb = layout.block_bytes("raw")
    digests = tuple(block_digest(payload[i * bb:(i + 1) * bb].numpy()) for i in range(len(SRC_IDS)))
    def messages(request_id, in_trailer):
        handle = receiver.reserve(request_id, DST_IDS)
        manifest = TransferManifest(request_id, handle, layout, tuple(DST_IDS), () if in_trailer else digests,
                                    "raw", "grpc", "", payload.numel(), digests_in_trailer=in_trailer)
        yield kv_transfer_pb2.KvChunk(manifest=manifest_to_pb(manifest))
        for data in iter_chunks([payload]):
            yield kv_transfer_pb2.KvChunk(data=bytes(data))

    with grpc.insecure_channel(endpoint, options=GRPC_OPTIONS) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
        result = stub.Push(messages("old", False), timeout=TIMEOUT_S)   # as a sender before issue 16 sends
        assert (result.num_blocks, result.bytes) == (len(SRC_IDS), payload.numel())
        assert landed(receiver, src)
        with pytest.raises(grpc.RpcError) as info:
            stub.Push(messages("cut", True), timeout=TIMEOUT_S)         # announced a trailer, sent none
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("trailer: ")
    assert [r[0] for r in receiver.committed] == ["old"] and [r[0] for r in receiver.rejected] == ["cut"]


def test_shm_pool_reuses_one_prefaulted_segment_and_the_receiver_one_mapping(kv_served, layout):
    receiver = CacheReceiver(layout, 100)
    endpoint, servicer = kv_served(receiver)
    with KvSender(shm_pool_bytes=POOL_BYTES) as sender:
        for i in range(3):  # different bytes each time: the kept mapping must show the new ones
            src = source_cache(layout, 64, seed=i)
            push(sender, endpoint, receiver, src, layout, f"req-{i}", "shm")
            assert landed(receiver, src)
        names = {m.shm_name for m in receiver.checked}
        stats = sender.segment_pool.stats()
        assert len(names) == 1 and is_pooled_name(names.pop())
        assert (stats.num_segments, stats.num_in_use, stats.num_created, stats.num_reused) == (1, 0, 1, 2)
        assert servicer.segments.num_mapped == 1
        # Idle in the pool, the segment names no reservation: a Push replaying the last manifest is refused.
        last = receiver.checked[-1]
        with pytest.raises(SegmentRefused, match="no payload of this reservation"):
            PooledSegmentReader().open(last.shm_name, request_id=last.request_id, handle=last.handle,
                                       payload_bytes=last.payload_bytes)
        [name] = sender.segment_pool.segment_names()
    assert not (SHM_DIR / name).exists()           # the sender's close unlinks the pool
    assert servicer.segments.num_mappings() == 1
    servicer.segments.prune()                      # (the decode worker's housekeeping) and the receiver unmaps it
    assert servicer.segments.num_mappings() == 0


def test_shm_pool_unlinks_the_segment_of_a_rejected_or_timed_out_push(kv_served, layout, src):
    receiver = CacheReceiver(layout, 100)
    endpoint, _ = kv_served(receiver)
    with KvSender(shm_pool_bytes=POOL_BYTES) as sender:
        with pytest.raises(TransferFailed) as info:
            push(sender, endpoint, receiver, src, layout, "bad", "shm", fault=FaultInjection(corrupt_chunk_index=0))
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert not (SHM_DIR / receiver.checked[-1].shm_name).exists()
        assert sender.segment_pool.stats().num_segments == 0

        # A receiver that has not answered by the deadline may still read: the segment is unlinked, not reused.
        gate = threading.Event()
        check = receiver.check
        receiver.check = lambda manifest: (gate.wait(TIMEOUT_S), check(manifest))[1]
        with pytest.raises(TransferFailed) as info:
            push(sender, endpoint, receiver, src, layout, "slow", "shm", timeout_s=0.5)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert sender.segment_pool.stats().num_segments == 0
        gate.set()
    deadline = time.monotonic() + 30
    while len(receiver.rejected) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r[0] for r in receiver.rejected] == ["bad", "slow"] and receiver.committed == []
    assert not any(SHM_DIR.glob(f"pdkv_{os.getpid():x}_*"))


def test_a_payload_the_pool_cannot_hold_fails_the_push_as_resource_exhausted(kv_served):
    layout = layout_of(head_dim=128)   # 128 KiB blocks: 40 of them need an 8 MiB segment
    receiver = CacheReceiver(layout, 100)
    endpoint, _ = kv_served(receiver)
    with KvSender(shm_pool_bytes=(4 << 20) + 4096) as sender, pytest.raises(TransferFailed) as info:
        push(sender, endpoint, receiver, source_cache(layout, 64), layout, "big", "shm")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_bytes" in info.value.details
    assert receiver.checked == []      # refused before anything was sent


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_pool_segments_of_a_killed_sender_are_removed(tmp_path):
    child = _python("""
        import sys, time
        from kvstore.shm_pool import SegmentPool
        pool = SegmentPool(64 << 20)
        idle = pool.acquire(1 << 20, request_id="r1", handle="h1")
        busy = pool.acquire(5 << 20, request_id="r2", handle="h2")
        idle.release(reusable=True)
        print(" ".join(pool.segment_names()), flush=True)
        time.sleep(600)
    """)
    try:
        names = child.stdout.readline().split()
        assert len(names) == 2 and all((SHM_DIR / n).exists() for n in names)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    deadline = time.monotonic() + 20  # the child's resource tracker unlinks what it registered
    while any((SHM_DIR / n).exists() for n in names) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any((SHM_DIR / n).exists() for n in names)


@pytest.mark.parametrize("codec", ["raw", "int8"])  # chunks joined out of the cache / cut from staging
def test_receiver_death_mid_stream_fails_the_push_and_returns_its_buffers(layout, src, codec):
    # A KvTransfer server in its own process that takes the manifest and one data chunk, says so, then waits to
    # be killed: the push must fail promptly with a retryable status, not hang, and give its staging back.
    child = _python("""
        import sys, threading
        from concurrent import futures
        import grpc
        from protos.pdserve.v1 import kv_transfer_pb2
        from kvstore.transfer_service import GRPC_OPTIONS

        def push(requests, context):
            next(requests), next(requests)
            print("mid-stream", flush=True)
            threading.Event().wait()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("pdserve.v1.KvTransfer", {
            "Push": grpc.stream_unary_rpc_method_handler(
                push, request_deserializer=kv_transfer_pb2.KvChunk.FromString,
                response_serializer=kv_transfer_pb2.PushResult.SerializeToString)})])
        print(server.add_insecure_port("127.0.0.1:0"), flush=True)
        server.start()
        server.wait_for_termination()
    """)
    try:
        endpoint = f"127.0.0.1:{child.stdout.readline().strip()}"
        outcome: list = []
        with KvSender() as sender:
            pushing = threading.Thread(target=lambda: outcome.append(push_outcome(sender, endpoint, layout, src, "grpc",
                                                                                  codec=codec)))
            pushing.start()
            assert child.stdout.readline().strip() == "mid-stream"
            child.send_signal(signal.SIGKILL)
            pushing.join(TIMEOUT_S)
            assert not pushing.is_alive()
            deadline = time.monotonic() + 10  # grpc closes the request iterator in its own thread
            while codec == "int8" and sender.staging.idle_bytes() == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            if codec == "int8":
                assert sender.staging.idle_bytes() > 0      # its staging buffer came back
            else:
                assert sender.staging.num_allocated == 0    # raw: joined out of the cache, no staging taken
        [exc] = outcome
        assert isinstance(exc, TransferFailed) and exc.code in (grpc.StatusCode.UNAVAILABLE,
                                                                grpc.StatusCode.CANCELLED), exc
    finally:
        child.kill()
        child.wait()


def push_outcome(sender, endpoint, layout, kv_cache, transport, request_id="r", codec="raw"):
    """sender.push of SRC_IDS into DST_IDS: its result, or the TransferFailed it raised."""
    try:
        return sender.push(endpoint, request_id=request_id, handle="h", layout=layout, kv_cache=kv_cache,
                           src_block_ids=SRC_IDS, dst_block_ids=DST_IDS, transport=transport, codec=codec,
                           timeout_s=TIMEOUT_S)
    except TransferFailed as exc:
        return exc


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, 2 << 20])
def test_pre_encoded_data_chunks_are_the_protobuf_bytes_and_parse_back_as_views(size):
    from kvstore.transfer_service import _deserialize_chunk, encode_data_chunk

    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    wire = encode_data_chunk(data)
    assert wire == kv_transfer_pb2.KvChunk(data=data).SerializeToString()
    parsed = _deserialize_chunk(wire)
    assert isinstance(parsed, memoryview) and parsed == data
    manifest = kv_transfer_pb2.KvChunk(manifest=kv_transfer_pb2.KvManifest(request_id="r")).SerializeToString()
    assert _deserialize_chunk(manifest).manifest.request_id == "r"
    # a data chunk followed by another field is still a valid KvChunk: parsed as one, not cut short
    longer = wire + kv_transfer_pb2.KvChunk(data=b"x").SerializeToString()
    assert _deserialize_chunk(longer).data == b"x"


def test_a_receiver_that_predates_the_trailer_fails_the_push_with_a_clear_error(layout, src):
    # A decode worker before issue 16 parses KvManifest without field 10 (digests_in_trailer): the real servicer,
    # fed manifests with that field dropped, as such a parser sees them.
    def parse_as_before(raw: bytes) -> kv_transfer_pb2.KvChunk:
        message = kv_transfer_pb2.KvChunk.FromString(raw)
        if message.WhichOneof("body") == "manifest":
            message.manifest.ClearField("digests_in_trailer")
        return message

    receiver = CacheReceiver(layout, 100)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("pdserve.v1.KvTransfer", {
        "Push": grpc.stream_unary_rpc_method_handler(
            KvTransferServicer(receiver).Push, request_deserializer=parse_as_before,
            response_serializer=kv_transfer_pb2.PushResult.SerializeToString)})])
    endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        with KvSender() as sender, pytest.raises(TransferFailed) as info:
            push(sender, endpoint, receiver, src, layout, "r", "grpc")
    finally:
        server.stop(None)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details.startswith("block_digests: 0 digests for 40 blocks")
    assert "predates digests in a trailer" in info.value.details
    assert [r[0] for r in receiver.rejected] == ["r"] and receiver.committed == []


def test_a_raw_grpc_push_over_mutual_tls_lands_straight_in_the_cache_with_the_kv_options(tmp_path, layout, src):
    # The KV options (GRPC_OPTIONS: frame and read sizes) on both ends of a mutual-TLS channel, as a prefill
    # worker pushes to a decode worker: several chunks, landed without a staging buffer, the trailer checked.
    from protos import tls

    pki = tls.write_cluster_pki(tmp_path, [("prefill", "p0"), ("decode", "d0")])
    receiver = CacheReceiver(layout, 100)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS,
                         interceptors=[tls.RoleInterceptor(tls.cluster_role_table())])
    servicer = KvTransferServicer(receiver)
    add_kv_transfer_servicer(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(pki["d0"]))
    server.start()
    try:
        with KvSender(tls=pki["p0"]) as sender:
            stats = push(sender, f"127.0.0.1:{port}", receiver, src, layout, "tls", "grpc")
            assert sender.staging.num_allocated == 0
    finally:
        server.stop(None)
    assert stats.num_bytes == len(SRC_IDS) * layout.block_bytes("raw") > 2 * (1 << 20)
    assert landed(receiver, src) and servicer.buffers.num_allocated == 0
    [(request_id, _, blocks)] = receiver.committed
    assert request_id == "tls" and blocks.sender_role == "prefill" and receiver.rejected == []


def record_push_digests(prefill) -> dict[str, list[bytes | None]]:
    """Wrap a prefill worker's KvSender.push: the block_digests of each push by request id, each checked then
    against its block's bytes (a passed digest is that of the block, or None)."""
    passed = {}
    real_push = prefill.worker.sender.push

    def push_spy(endpoint, **kw):
        now = block_digests_in_place(kw["kv_cache"], kw["src_block_ids"])
        assert all(d in (None, h) for d, h in zip(kw["block_digests"], now, strict=True))
        passed[kw["request_id"]] = kw["block_digests"]
        return real_push(endpoint, **kw)

    prefill.worker.sender.push = push_spy
    return passed


def test_a_1p1d_pair_over_grpc_sends_the_digests_its_prefill_took(monkeypatch):
    """The prefill worker's server builds its engine with kv_digests on for a grpc transport too (a private
    cache): every cold block's digest reaches the sender, equal to the block's bytes, and the tokens are the
    offline engine's."""
    monkeypatch.setattr(prefill_server, "build_engine",
                        lambda config, progress=False, **kw: LLMEngine(config, progress, tiny_loaded(), **kw))
    d = start_decode(DecodeWorkerConfig("d0", None, max_lease_ms=60_000, insecure_internal=True), ENGINE,
                     engine=tiny_engine())
    p = prefill_server.start_server(PrefillWorkerConfig("p0", None, transport="grpc",
                                                        decode_endpoints=(f"127.0.0.1:{d.port}",)), ENGINE)
    passed = record_push_digests(p)
    try:
        assert p.worker.loop.engine.runner.kv_segment is None and p.worker.loop.engine.runner.kv_digests
        pstub, dstub = stubs(p, d)
        tokens, pre, _ = disaggregated(pstub, dstub, "r1", PROMPT, GREEDY)
        assert tokens == run(tiny_engine(), [PROMPT], [GREEDY])[0]
        assert pre.transport == "grpc" and pre.transfer_bytes > 0
        assert passed["r1"] and None not in passed["r1"]
        assert wait_idle(dstub).used_blocks == 0 and wait_idle(pstub).used_blocks == 0
    finally:
        p.stop(0)
        d.stop(0)
