"""Prefill and decode workers over real gRPC sockets (tiny random Llama, so no checkpoint is loaded):
the disaggregated path gives the single-engine tokens over both KV transports (penalties included), a
request whose sampling raises fails alone, and every failure path returns the workers' blocks to idle."""

import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import start_server as start_decode
from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.errors import PreconditionError
from engine.faults import SAMPLING_FAULTS
from engine.sampling_params import SamplingParams
from kvstore.transfer_manifest import TransferManifest, TransferRejected
from kvstore.transfer_service import GRPC_OPTIONS, KvTransferServicer, ReceivedBlocks, ReceiveTarget
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.server import start_server as start_prefill
from protos.convert import request_from_pb, sampling_to_pb
from protos.pdserve.v1 import common_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.unit.engine.tiny_model import run, tiny_engine

ENGINE = EngineConfig(model="tiny-random", num_kv_blocks=256, block_size=4, dtype="float32")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 40))


def start_pair(transport="auto", faults=0):
    d = start_decode(DecodeWorkerConfig("d0", None, max_lease_ms=60_000, insecure_internal=True), ENGINE,
                     engine=tiny_engine())
    p = start_prefill(PrefillWorkerConfig("p0", None, transport=transport, fault_corrupt_transfers=faults,
                                          decode_endpoints=(f"127.0.0.1:{d.port}",)), ENGINE, engine=tiny_engine())
    return p, d


def stubs(p, d):
    pc, dc = grpc.insecure_channel(f"127.0.0.1:{p.port}"), grpc.insecure_channel(f"127.0.0.1:{d.port}")
    return worker_pb2_grpc.PrefillWorkerStub(pc), worker_pb2_grpc.DecodeWorkerStub(dc)


def worker_request(rid, prompt=PROMPT, params=GREEDY, seed=5):
    return worker_pb2.WorkerRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_pb(params),
                                    seed=seed)


def disaggregated(pstub, dstub, rid, prompt=PROMPT, params=GREEDY):
    res = dstub.Reserve(worker_pb2.ReserveRequest(request=worker_request(rid, prompt, params), lease_ms=30_000))
    pre = pstub.Prefill(worker_pb2.PrefillRequest(request=worker_request(rid, prompt, params), target=res.target))
    tokens = [pre.first_token_id]
    for msg in dstub.Decode(worker_pb2.DecodeRequest(request_id=rid, handle=res.target.handle,
                                                     first_token_id=pre.first_token_id)):
        tokens.extend(msg.token_ids)
    return tokens, pre, msg


def wait_idle(stub, timeout_s=10.0):
    """Poll Stats until nothing holds a block (bounded; returns the last Stats)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stub.Stats(worker_pb2.StatsRequest())
        if stats.used_blocks == 0 and stats.running == 0 and stats.reserved == 0 or time.monotonic() > deadline:
            return stats


@pytest.fixture
def pair():
    p, d = start_pair()
    yield (p, d, *stubs(p, d))
    p.stop(0)
    d.stop(0)


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_disaggregated_tokens_equal_single_engine(transport):
    p, d = start_pair(transport)
    try:
        pstub, dstub = stubs(p, d)
        params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
        expected = run(tiny_engine(), [PROMPT], [params])[0]
        tokens, pre, last = disaggregated(pstub, dstub, "r1", params=params)
        assert tokens == expected
        assert pre.transport == transport and pre.transfer_bytes > 0
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert wait_idle(dstub).used_blocks == 0 and wait_idle(pstub).used_blocks == 0
    finally:
        p.stop(0)
        d.stop(0)


def test_delta_transfer_sends_only_blocks_the_decode_worker_lacks(pair):
    _, _, pstub, dstub = pair
    _, first, _ = disaggregated(pstub, dstub, "a", PROMPT + [50, 51])
    _, second, _ = disaggregated(pstub, dstub, "b", PROMPT + [60, 61, 62])
    assert second.cached_tokens == 36                 # the prefill worker's own prefix cache
    assert second.transfer_bytes < first.transfer_bytes / 4   # decode worker held 9 of 10 blocks
    assert run(tiny_engine(), [PROMPT + [60, 61, 62]], [GREEDY])[0] == disaggregated(
        pstub, dstub, "c", PROMPT + [60, 61, 62])[0]


def test_local_prefill_on_the_decode_worker(pair):
    _, _, _, dstub = pair
    res = dstub.Reserve(worker_pb2.ReserveRequest(request=worker_request("loc"), lease_ms=30_000))
    tokens = [t for m in dstub.Decode(worker_pb2.DecodeRequest(request_id="loc", handle=res.target.handle,
                                                               prefill_locally=True)) for t in m.token_ids]
    assert tokens == run(tiny_engine(), [PROMPT], [GREEDY])[0]


def test_corrupted_chunk_is_rejected_and_counted_and_nothing_leaks():
    p, d = start_pair("grpc", faults=1)
    try:
        pstub, dstub = stubs(p, d)
        res = dstub.Reserve(worker_pb2.ReserveRequest(request=worker_request("bad"), lease_ms=30_000))
        with pytest.raises(grpc.RpcError) as e:
            pstub.Prefill(worker_pb2.PrefillRequest(request=worker_request("bad"), target=res.target))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "digest" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:   # the reservation was released with the rejected transfer
            list(dstub.Decode(worker_pb2.DecodeRequest(request_id="bad", handle=res.target.handle, first_token_id=1)))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert wait_idle(dstub).transfer_errors == 1
        assert wait_idle(dstub).used_blocks == 0 and wait_idle(pstub).used_blocks == 0
        tokens, _, _ = disaggregated(pstub, dstub, "good")      # only the first transfer was corrupted
        assert tokens == run(tiny_engine(), [PROMPT], [GREEDY])[0]
    finally:
        p.stop(0)
        d.stop(0)


def test_cancel_mid_stream_and_deadline_release_blocks(pair):
    _, _, pstub, dstub = pair
    long = SamplingParams(max_tokens=950, temperature=0.0, ignore_eos=True)   # far longer than the deadline
    res = dstub.Reserve(worker_pb2.ReserveRequest(request=worker_request("c1", params=long), lease_ms=30_000))
    call = dstub.Decode(worker_pb2.DecodeRequest(request_id="c1", handle=res.target.handle, prefill_locally=True))
    next(call)
    call.cancel()
    res = dstub.Reserve(worker_pb2.ReserveRequest(request=worker_request("c2", params=long), lease_ms=30_000))
    with pytest.raises(grpc.RpcError) as e:
        for _ in dstub.Decode(worker_pb2.DecodeRequest(request_id="c2", handle=res.target.handle,
                                                       prefill_locally=True), timeout=0.3):
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_idle(dstub).used_blocks == 0


def test_expired_lease_releases_the_reservation():
    d = start_decode(DecodeWorkerConfig("d1", None, max_lease_ms=50), ENGINE, engine=tiny_engine())
    try:
        dstub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(f"127.0.0.1:{d.port}"))
        dstub.Reserve(worker_pb2.ReserveRequest(request=worker_request("slow"), lease_ms=10_000))
        stats = wait_idle(dstub)
        assert stats.reserved == 0 and stats.used_blocks == 0
    finally:
        d.stop(0)


def test_renew_extends_a_reservation_for_its_caller_until_it_decodes(pair):
    _, _, pstub, dstub = pair
    res = dstub.Reserve(worker_pb2.ReserveRequest(request=worker_request("rn"), lease_ms=30_000))
    assert res.lease_ms == 30_000
    renewed = dstub.Renew(worker_pb2.RenewRequest(request_id="rn", handle=res.target.handle, lease_ms=90_000))
    assert renewed.lease_ms == 60_000 and renewed.lease_expiry_unix_ms > res.lease_expiry_unix_ms  # capped
    for rid, handle in [("rn", "not-the-handle"), ("nobody", res.target.handle)]:
        with pytest.raises(grpc.RpcError) as e:
            dstub.Renew(worker_pb2.RenewRequest(request_id=rid, handle=handle, lease_ms=1000))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    pre = pstub.Prefill(worker_pb2.PrefillRequest(request=worker_request("rn"), target=res.target))
    tokens = [pre.first_token_id] + [t for m in dstub.Decode(worker_pb2.DecodeRequest(
        request_id="rn", handle=res.target.handle, first_token_id=pre.first_token_id)) for t in m.token_ids]
    assert tokens == run(tiny_engine(), [PROMPT], [GREEDY])[0]
    with pytest.raises(grpc.RpcError) as e:                      # decoding (here: done) is not renewable
        dstub.Renew(worker_pb2.RenewRequest(request_id="rn", handle=res.target.handle, lease_ms=1000))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert wait_idle(dstub).used_blocks == 0


def test_concurrent_requests_all_complete(pair):
    _, _, pstub, dstub = pair
    prompts = [[7 + i, 8, 9] + PROMPT[: 10 + i] for i in range(12)]
    results = {}

    def one(i):
        results[i] = disaggregated(pstub, dstub, f"cc{i}", prompts[i])[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(12)] == run(tiny_engine(), prompts, [GREEDY] * 12)


def test_bad_request_is_invalid_argument_and_reserves_nothing(pair):
    _, _, _, dstub = pair
    with pytest.raises(grpc.RpcError) as e:
        dstub.Reserve(worker_pb2.ReserveRequest(request=worker_request("x", prompt=[]), lease_ms=1000))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.value.details()
    assert wait_idle(dstub).used_blocks == 0


PENALIZED = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.4),
             SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True, frequency_penalty=1.1),
             SamplingParams(max_tokens=10, temperature=0.7, seed=5, ignore_eos=True, presence_penalty=1.5,
                            repetition_penalty=1.1)]


def test_penalties_over_grpc_give_the_single_engine_tokens(pair):
    """Every penalty, prefilled on P and decoded on D (in one decode batch), equals one engine's output."""
    _, _, pstub, dstub = pair
    prompts = [PROMPT, PROMPT[5:] + [3, 3, 3], [9, 9, 8, 8, 7] + PROMPT[:12]]
    results = {}

    def one(i):
        results[i] = disaggregated(pstub, dstub, f"pen{i}", prompts[i], PENALIZED[i])[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results.get(i) for i in range(3)] == [run(tiny_engine(), [p], [params])[0]
                                                  for p, params in zip(prompts, PENALIZED)]
    assert wait_idle(dstub).used_blocks == 0 and wait_idle(pstub).used_blocks == 0


def test_a_request_whose_sampling_raises_fails_alone_on_the_decode_worker(pair):
    """Three requests decode in one batch; the sampling of one raises (engine.faults): that stream ends with
    INTERNAL naming the fault, the others finish with their single-engine tokens, and no block leaks."""
    _, _, pstub, dstub = pair
    prompts = [PROMPT, PROMPT[3:], PROMPT[7:]]
    starts = []
    for i, prompt in enumerate(prompts):          # prefill all three first: the fault is armed for decode only
        rid = f"f{i}"
        res = dstub.Reserve(worker_pb2.ReserveRequest(request=worker_request(rid, prompt, PENALIZED[i]),
                                                      lease_ms=30_000))
        pre = pstub.Prefill(worker_pb2.PrefillRequest(request=worker_request(rid, prompt, PENALIZED[i]),
                                                      target=res.target))
        starts.append((rid, res.target.handle, pre.first_token_id))
    results, errors = {}, {}

    def decode(rid, handle, first):
        tokens = [first]
        try:
            for msg in dstub.Decode(worker_pb2.DecodeRequest(request_id=rid, handle=handle, first_token_id=first)):
                tokens.extend(msg.token_ids)
            results[rid] = tokens
        except grpc.RpcError as exc:
            errors[rid] = exc

    with SAMPLING_FAULTS.armed("f1"):
        threads = [threading.Thread(target=decode, args=s) for s in starts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert set(errors) == {"f1"} and errors["f1"].code() == grpc.StatusCode.INTERNAL
    assert "injected sampling fault" in errors["f1"].details()
    assert [results["f0"], results["f2"]] == [run(tiny_engine(), [prompts[i]], [PENALIZED[i]])[0] for i in (0, 2)]
    assert wait_idle(dstub).used_blocks == 0 and wait_idle(pstub).used_blocks == 0


def test_a_request_whose_prefill_sampling_raises_fails_alone_and_leaks_nothing(pair):
    _, _, pstub, dstub = pair
    res = dstub.Reserve(worker_pb2.ReserveRequest(request=worker_request("pf"), lease_ms=30_000))
    with SAMPLING_FAULTS.armed("pf"), pytest.raises(grpc.RpcError) as e:
        pstub.Prefill(worker_pb2.PrefillRequest(request=worker_request("pf"), target=res.target))
    assert e.value.code() == grpc.StatusCode.INTERNAL and "injected sampling fault" in e.value.details()
    assert dstub.Abort(worker_pb2.AbortRequest(request_id="pf")).found
    assert wait_idle(pstub).used_blocks == 0 and wait_idle(dstub).used_blocks == 0
    assert disaggregated(pstub, dstub, "after")[0] == run(tiny_engine(), [PROMPT], [GREEDY])[0]


def test_abort_while_the_kv_arrives_is_released_by_the_transfer_after_its_last_write():
    """DecodeWorker's KvReceiver calls in the order a KvTransfer thread makes them, with an Abort landing
    between check (pin) and commit: the blocks stay reserved while written, commit is refused, reject
    releases them once, and Decode finds no reservation."""
    loop = EngineLoop(tiny_engine(num_kv_blocks=32)).start()
    try:
        worker = DecodeWorker(loop, max_lease_ms=60_000)
        res = worker.reserve(request_from_pb(worker_request("ab")), 30_000)
        assert list(res.block_ids) == list(range(10))               # 37 prompt tokens in blocks of 4
        manifest = TransferManifest("ab", res.handle, worker.layout, tuple(res.missing_block_ids), (), "raw",
                                    "grpc", "", 0)
        target = worker.check(manifest)
        assert target.block_ids == tuple(range(10))
        assert worker.abort("ab")                                  # found: marked, not released
        assert loop.call(lambda e: e.kv.pool.get_num_used_blocks()) == 10
        with pytest.raises(TransferRejected, match="aborted"):
            worker.commit("ab", res.handle, ReceivedBlocks(target.block_ids, 0, "raw", "grpc"))
        worker.reject("ab", res.handle, "aborted")
        assert loop.call(lambda e: e.kv.pool.get_num_used_blocks()) == 0
        assert worker.num_transfer_errors == 0                      # an abort is not a transfer error
        with pytest.raises(PreconditionError):
            worker.decode("ab", res.handle, first_token_id=5)
        assert not worker.abort("ab")
    finally:
        loop.stop()


def test_a_commit_starts_the_lease_afresh_and_renew_is_for_the_caller_that_reserved():
    """KV whose transfer began just before the lease's end commits after it: the commit renews the lease, so
    the housekeeping that runs before its Decode arrives does not release it."""
    loop = EngineLoop(tiny_engine(num_kv_blocks=32)).start()
    try:
        worker = DecodeWorker(loop, max_lease_ms=60_000)
        res = worker.reserve(request_from_pb(worker_request("late")), 50, caller="gw-a")
        with pytest.raises(PreconditionError):
            worker.renew("late", res.handle, 30_000, caller="gw-b")
        manifest = TransferManifest("late", res.handle, worker.layout, tuple(res.missing_block_ids), (), "raw",
                                    "grpc", "", 0)
        target = worker.check(manifest)
        time.sleep(0.1)                                            # the 50 ms lease ends while receiving
        assert res.lease_deadline < time.monotonic()
        worker.commit("late", res.handle, ReceivedBlocks(target.block_ids, 0, "raw", "grpc"))
        assert res.lease_deadline > time.monotonic()
        loop.call(worker._expire_leases)                           # the housekeeping the loop runs each step
        worker.decode("late", res.handle, first_token_id=5).close()  # found: it was not released
        give_up = time.monotonic() + 10
        while loop.call(lambda e: e.kv.pool.get_num_used_blocks()) and time.monotonic() < give_up:
            time.sleep(0.01)
        assert loop.call(lambda e: e.kv.pool.get_num_used_blocks()) == 0
    finally:
        loop.stop()


def test_auto_transport_is_shm_on_the_same_host_and_grpc_for_another(pair):
    _, _, pstub, dstub = pair
    expected = run(tiny_engine(), [PROMPT], [GREEDY])[0]
    for rid, other_host, transport in [("same", False, "shm"), ("other", True, "grpc")]:
        res = dstub.Reserve(worker_pb2.ReserveRequest(request=worker_request(rid), lease_ms=30_000))
        if other_host:
            res.target.host_id = "linux:another-boot:1"
        pre = pstub.Prefill(worker_pb2.PrefillRequest(request=worker_request(rid), target=res.target))
        assert pre.transport == transport
        tokens = [pre.first_token_id] + [t for m in dstub.Decode(worker_pb2.DecodeRequest(
            request_id=rid, handle=res.target.handle, first_token_id=pre.first_token_id)) for t in m.token_ids]
        assert tokens == expected


class StallingReceiver:
    """A KvTransfer receiver that holds each transfer at `check` until `go` is set (so a push is in flight
    for as long as the test needs), then accepts it."""

    def __init__(self, layout, kv_cache):
        self.layout, self.kv_cache = layout, kv_cache
        self.entered, self.go = threading.Event(), threading.Event()

    def check(self, manifest):
        self.entered.set()
        self.go.wait(60)
        return ReceiveTarget(self.layout, manifest.block_ids, self.kv_cache)

    def commit(self, request_id, handle, blocks):
        pass

    def reject(self, request_id, handle, reason):
        pass


def test_abort_during_the_push_keeps_the_blocks_until_the_push_ends_then_releases_them():
    """Prefill's push is held mid-flight by the receiver; an Abort then finds the request but its blocks stay
    pinned (the push still reads them); when the push ends the Prefill is CANCELLED and every block is free."""
    receiver = StallingReceiver(None, None)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(KvTransferServicer(receiver), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    p = start_prefill(PrefillWorkerConfig("p0", None, transport="grpc", decode_endpoints=(f"127.0.0.1:{port}",)),
                      ENGINE, engine=tiny_engine())
    layout = p.worker.layout
    receiver.layout = layout
    receiver.kv_cache = torch.zeros(layout.num_layers, 2, 16, layout.block_size, layout.num_kv_heads,
                                    layout.head_dim)
    try:
        pstub = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(f"127.0.0.1:{p.port}"))
        target = worker_pb2.TransferTarget(endpoint=f"127.0.0.1:{port}", handle="h", num_cached_blocks=0,
                                           block_ids=list(range(10)), host_id="elsewhere")
        errors = []

        def prefill():
            try:
                pstub.Prefill(worker_pb2.PrefillRequest(request=worker_request("mid"), target=target))
            except grpc.RpcError as exc:
                errors.append(exc)

        thread = threading.Thread(target=prefill)
        thread.start()
        assert receiver.entered.wait(60)                       # the push is in flight: its pin is held
        assert pstub.Abort(worker_pb2.AbortRequest(request_id="mid")).found
        assert pstub.Stats(worker_pb2.StatsRequest()).used_blocks == 10   # not released under the push
        receiver.go.set()
        thread.join(60)
        assert [e.code() for e in errors] == [grpc.StatusCode.CANCELLED]
        assert "during its KV push" in errors[0].details()
        assert wait_idle(pstub).used_blocks == 0
    finally:
        receiver.go.set()
        server.stop(0)
        p.stop(0)
