"""Worker-side security against real worker processes, real mutual TLS (a cluster PKI from protos.tls) and a real
redis-server: who may call which internal RPC, where a prefill worker may push, which shared-memory segments a
Push may name, lease and per-caller reservation caps, and the prefix-cache poisoning attack (DESIGN section 10).

Workers: p0 (prefill), d0 (decode), d1 and d2 (decode with --verify-kv sample and full), all on TLS ports. The test process plays
the gateway (certificate gw0), a second gateway (gw1), an attacker holding a prefill certificate (p-evil), a
probe, and an outsider with no certificate or another CA's.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import threading
import time
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import start_server as start_decode
from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvstore.embedded_redis import EmbeddedRedis
from kvstore.index import PrefixIndex, WorkerInfo
from kvstore.shm import SHM_DIR, OutgoingSegment, host_id
from kvstore.transfer_manifest import KvLayoutSpec, TransferManifest
from kvstore.transfer_service import GRPC_OPTIONS, KvTransferServicer, ReceivedBlocks
from kvstore.kv_sender import KvSender, TransferFailed
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.server import start_server as start_prefill
from protos import tls
from protos.convert import manifest_to_pb, request_from_pb, sampling_to_pb
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.cluster import BLOCK_SIZE, KV_CACHE_MEMORY, MAX_MODEL_LEN, RPC_TIMEOUT_S, Cluster
from tests.unit.engine.tiny_model import tiny_engine

IDENTITIES = [("gateway", "gw0"), ("gateway", "gw1"), ("prefill", "p0"), ("prefill", "p-evil"), ("decode", "d0"),
              ("decode", "d1"), ("decode", "d2"), ("probe", "probe0")]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
MAX_LEASE_MS = 60_000
BENCH_CLUSTER = Path(__file__).resolve().parents[2] / "bench" / "bench_cluster.py"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return tls.write_cluster_pki(tmp_path_factory.mktemp("pki"), IDENTITIES)


@pytest.fixture(scope="module")
def foreign_pki(tmp_path_factory):
    """Another CA issuing the same names: its certificates prove nothing here."""
    return tls.write_cluster_pki(tmp_path_factory.mktemp("foreign"), IDENTITIES)


def tls_kwargs(files: tls.TlsFiles) -> dict:
    return dict(cluster_ca=str(files.ca_path), cluster_cert=str(files.cert_path), cluster_key=str(files.key_path))


@pytest.fixture(scope="module")
def cluster(default_model_path, pki):
    with EmbeddedRedis() as redis:
        c = Cluster(default_model_path, redis)
        try:
            c.start_worker("prefill", "p0", transport="auto", **tls_kwargs(pki["p0"]))
            c.start_worker("decode", "d0", max_lease_ms=MAX_LEASE_MS, **tls_kwargs(pki["d0"]))
            c.start_worker("decode", "d1", verify_kv="sample", **tls_kwargs(pki["d1"]))
            c.start_worker("decode", "d2", verify_kv="full", **tls_kwargs(pki["d2"]))
            # In-process: the tokenizer and the KV layout the workers use.
            c.llm = LLM(model=str(default_model_path), progress=False, kv_cache_memory=KV_CACHE_MEMORY,
                        num_threads=1, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
            c.wait_registered("p0", "d0", "d1", "d2")
            yield c
        finally:
            c.close()


@pytest.fixture(scope="module")
def layout(cluster) -> KvLayoutSpec:
    engine = cluster.llm.engine
    return KvLayoutSpec.from_cache(engine.runner.kv_cache, engine.fingerprint)


def channel(cluster, worker_id: str, files: tls.TlsFiles) -> grpc.Channel:
    role = "prefill" if worker_id.startswith("p") else "decode"
    return grpc.secure_channel(cluster.endpoint(worker_id), tls.channel_credentials(files),
                               options=[*GRPC_OPTIONS, *tls.channel_options(role)])


def decode_stub(cluster, worker_id, files):
    return worker_pb2_grpc.DecodeWorkerStub(channel(cluster, worker_id, files))


def prefill_stub(cluster, files):
    return worker_pb2_grpc.PrefillWorkerStub(channel(cluster, "p0", files))


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details() or ""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def worker_request(rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> worker_pb2.WorkerRequest:
    return worker_pb2.WorkerRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_pb(params), seed=1)


def reserve(stub, rid, prompt, lease_ms=30_000):
    return stub.Reserve(worker_pb2.ReserveRequest(request=worker_request(rid, prompt), lease_ms=lease_ms),
                        timeout=30)


def chat_prompt(cluster, question: str) -> list[int]:
    tokenizer = cluster.llm.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                          add_generation_prompt=True))


def ask(cluster, pki, decode_worker: str, question: str) -> tuple[str, worker_pb2.ReserveResponse]:
    """The gateway's disaggregated path by hand (gw0's certificate): Reserve on D, Prefill on p0, Decode on D."""
    prompt, rid = chat_prompt(cluster, question), new_id("honest")
    d, p = decode_stub(cluster, decode_worker, pki["gw0"]), prefill_stub(cluster, pki["gw0"])
    res = reserve(d, rid, prompt)
    pre = p.Prefill(worker_pb2.PrefillRequest(request=worker_request(rid, prompt), target=res.target),
                    timeout=RPC_TIMEOUT_S)
    tokens = [pre.first_token_id] + [t for m in d.Decode(worker_pb2.DecodeRequest(
        request_id=rid, handle=res.target.handle, first_token_id=pre.first_token_id), timeout=RPC_TIMEOUT_S)
        for t in m.token_ids]
    return cluster.llm.tokenizer.decode(tokens), res


def stats(cluster, pki, worker_id):
    stub_type = worker_pb2_grpc.PrefillWorkerStub if worker_id.startswith("p") else worker_pb2_grpc.DecodeWorkerStub
    with channel(cluster, worker_id, pki["probe0"]) as ch:
        return stub_type(ch).Stats(worker_pb2.StatsRequest(), timeout=10)


def assert_nothing_held(cluster, pki):
    """Poll (bounded) until no worker holds a block, a sequence or a reservation; then assert it."""
    deadline = time.monotonic() + 30
    while True:
        s = {w: stats(cluster, pki, w) for w in ("p0", "d0", "d1", "d2")}
        busy = {w: x for w, x in s.items() if x.used_blocks or x.running or x.waiting or x.reserved}
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not busy, f"blocks leaked: {busy}"


def assert_released(cluster, pki, worker_id, rid, handle):
    """The reservation is gone: Decode on it is FAILED_PRECONDITION."""
    d = decode_stub(cluster, worker_id, pki["gw0"])
    code, _ = code_of(lambda: list(d.Decode(worker_pb2.DecodeRequest(request_id=rid, handle=handle,
                                                                     first_token_id=1), timeout=30)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION


# --------------------------------------------------------------------------------------------- who may call what
def every_internal_call(ch: grpc.Channel, role: str) -> list:
    calls = [lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)]
    if role == "decode":
        d, kv = worker_pb2_grpc.DecodeWorkerStub(ch), kv_transfer_pb2_grpc.KvTransferStub(ch)
        calls += [lambda: d.Reserve(worker_pb2.ReserveRequest(request=worker_request("x", [1, 2, 3])), timeout=10),
                  lambda: list(d.Decode(worker_pb2.DecodeRequest(request_id="x", handle="h"), timeout=10)),
                  lambda: d.Abort(worker_pb2.AbortRequest(request_id="x"), timeout=10),
                  lambda: d.Stats(worker_pb2.StatsRequest(), timeout=10),
                  lambda: kv.Push(iter([kv_transfer_pb2.KvChunk(data=b"x")]), timeout=10)]
    else:
        p = worker_pb2_grpc.PrefillWorkerStub(ch)
        calls += [lambda: p.Prefill(worker_pb2.PrefillRequest(request=worker_request("x", [1, 2, 3])), timeout=10),
                  lambda: p.Abort(worker_pb2.AbortRequest(request_id="x"), timeout=10),
                  lambda: p.Stats(worker_pb2.StatsRequest(), timeout=10)]
    return calls


@pytest.mark.parametrize("worker_id", ["p0", "d0"])
def test_every_internal_rpc_fails_without_a_cluster_client_certificate(cluster, pki, foreign_pki, worker_id):
    role = "prefill" if worker_id == "p0" else "decode"
    endpoint = cluster.endpoint(worker_id)
    ca_pem = pki["gw0"].ca_path.read_bytes()
    channels = {
        "plaintext": grpc.insecure_channel(endpoint),
        "server-verified TLS, no client certificate": grpc.secure_channel(
            endpoint, grpc.ssl_channel_credentials(root_certificates=ca_pem), options=tls.channel_options(role)),
        "a gateway certificate of another CA": grpc.secure_channel(
            endpoint, grpc.ssl_channel_credentials(root_certificates=ca_pem,
                                                   private_key=foreign_pki["gw0"].key_path.read_bytes(),
                                                   certificate_chain=foreign_pki["gw0"].cert_path.read_bytes()),
            options=tls.channel_options(role)),
    }
    for name, ch in channels.items():
        with ch:
            for call in every_internal_call(ch, role):
                code, _ = code_of(call)
                assert code == grpc.StatusCode.UNAVAILABLE, name
    with channel(cluster, worker_id, pki["probe0"]) as ch:   # the same server answers a cluster member
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_each_role_may_call_only_its_own_rpcs(cluster, pki):
    # A gateway certificate cannot push KV.
    with channel(cluster, "d0", pki["gw0"]) as ch:
        code, details = code_of(lambda: kv_transfer_pb2_grpc.KvTransferStub(ch).Push(
            iter([kv_transfer_pb2.KvChunk(data=b"x")]), timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "gateway" in details
    # A prefill certificate cannot reserve, decode or abort, nor ask another prefill worker to prefill.
    d = decode_stub(cluster, "d0", pki["p-evil"])
    for call in (lambda: reserve(d, "x", [1, 2, 3]),
                 lambda: d.Renew(worker_pb2.RenewRequest(request_id="x", handle="h", lease_ms=1000), timeout=10),
                 lambda: d.Abort(worker_pb2.AbortRequest(request_id="x"), timeout=10),
                 lambda: list(d.Decode(worker_pb2.DecodeRequest(request_id="x", handle="h"), timeout=10)),
                 lambda: prefill_stub(cluster, pki["p-evil"]).Prefill(
                     worker_pb2.PrefillRequest(request=worker_request("x", [1, 2, 3])), timeout=10)):
        code, details = code_of(call)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "prefill" in details
    # A probe reads Stats and health, and nothing else.
    probe = decode_stub(cluster, "d0", pki["probe0"])
    assert probe.Stats(worker_pb2.StatsRequest(), timeout=10).worker_id == "d0"
    assert code_of(lambda: reserve(probe, "x", [1, 2, 3]))[0] == grpc.StatusCode.PERMISSION_DENIED
    # The gateway may; a reservation's lease is renewed only by the gateway that made it.
    gateway = decode_stub(cluster, "d0", pki["gw0"])
    assert not gateway.Abort(worker_pb2.AbortRequest(request_id="nobody"), timeout=10).found
    handle = reserve(gateway, "mine", [1, 2, 3]).target.handle
    other = decode_stub(cluster, "d0", pki["gw1"])
    assert code_of(lambda: other.Renew(worker_pb2.RenewRequest(request_id="mine", handle=handle, lease_ms=1000),
                                       timeout=10))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert gateway.Renew(worker_pb2.RenewRequest(request_id="mine", handle=handle, lease_ms=1000),
                         timeout=10).lease_ms == 1000
    assert gateway.Abort(worker_pb2.AbortRequest(request_id="mine"), timeout=10).found


# --------------------------------------------------------------------------------------------- destinations
class CountingListener:
    """A TCP listener that accepts and counts connections and the bytes they send."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.bytes = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn):
        with conn:
            while data := conn.recv(65536):
                self.bytes += len(data)

    def close(self):
        self.sock.close()


class RecordingReceiver:
    """A KvTransfer receiver that records every manifest that reaches it (and accepts nothing)."""

    def __init__(self):
        self.manifests = []

    def check(self, manifest):
        self.manifests.append(manifest)
        raise AssertionError("no KV should ever arrive here")


def test_bench_cluster_calls_the_workers_as_the_gateway_does(cluster, pki):
    """bench/bench_cluster.py runs Reserve / Prefill / Decode itself (its "workers direct" rows): against mutual-TLS
    workers, as every cluster starts by default, it must dial with the gateway's certificate (it once dialled
    plaintext, which such workers refuse) and then gets the offline engine's greedy tokens."""
    spec = importlib.util.spec_from_file_location("bench_cluster", BENCH_CLUSTER)
    bench_cluster = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_cluster)
    workers = {"prefill-0": cluster.endpoint("p0"), "decode-0": cluster.endpoint("d0")}
    prompt = chat_prompt(cluster, "Name a colour.")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    direct = bench_cluster.DirectWorkers(workers, pki["gw0"])
    pieces: list[list[int]] = []
    try:
        direct.generate(new_id("bench"), prompt, params, "bench", pieces.append)
    finally:
        direct.close()
    assert [t for piece in pieces for t in piece] == cluster.llm.generate([prompt], params)[0].outputs[0].token_ids
    plaintext = bench_cluster.DirectWorkers(workers, None)
    try:
        assert code_of(lambda: plaintext.generate(new_id("bench"), prompt, params, "bench"))[0] == \
            grpc.StatusCode.UNAVAILABLE
    finally:
        plaintext.close()
    assert_nothing_held(cluster, pki)


def test_prefill_to_an_arbitrary_listener_is_refused_and_the_listener_gets_nothing(cluster, pki):
    listener = CountingListener()
    try:
        p = prefill_stub(cluster, pki["gw0"])
        prompt = chat_prompt(cluster, "What is the capital of Germany?")
        target = worker_pb2.TransferTarget(endpoint=listener.endpoint, handle="h", num_cached_blocks=0,
                                           block_ids=list(range(-(-len(prompt) // BLOCK_SIZE))))
        for target_host in (host_id(), "elsewhere"):              # shm, then grpc
            target.host_id = target_host
            code, details = code_of(lambda: p.Prefill(worker_pb2.PrefillRequest(
                request=worker_request(new_id("x"), prompt), target=target), timeout=RPC_TIMEOUT_S))
            assert code == grpc.StatusCode.PERMISSION_DENIED and details.startswith("target.endpoint")
        assert (listener.connections, listener.bytes) == (0, 0)
        assert stats(cluster, pki, "p0").used_blocks == 0            # nothing was computed
    finally:
        listener.close()


def test_a_forged_decode_record_reaches_no_kv_without_a_decode_certificate(cluster, pki):
    """Someone writes a decode worker record for their own listener into the index. The index check passes,
    but the listener's certificate (our CA's, a gateway's) is not a decode worker's: no handshake, no KV."""
    receiver = RecordingReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(KvTransferServicer(receiver), server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(pki["gw1"]))
    server.start()
    index = PrefixIndex(cluster.redis.url)
    fake = WorkerInfo("d-fake", "decode", grpc_endpoint=f"127.0.0.1:{port}", block_size=BLOCK_SIZE,
                      fingerprint=cluster.llm.engine.fingerprint)
    epoch = index.register(fake)
    try:
        p = prefill_stub(cluster, pki["gw0"])
        prompt = chat_prompt(cluster, "What is the capital of Germany?")
        target = worker_pb2.TransferTarget(endpoint=fake.grpc_endpoint, handle="h", num_cached_blocks=0,
                                           block_ids=list(range(-(-len(prompt) // BLOCK_SIZE))), host_id="")
        deadline = time.monotonic() + 10
        while True:  # until p0's cached view of the index has the forged record
            code, details = code_of(lambda: p.Prefill(worker_pb2.PrefillRequest(
                request=worker_request(new_id("x"), prompt), target=target), timeout=RPC_TIMEOUT_S))
            if code != grpc.StatusCode.PERMISSION_DENIED or time.monotonic() > deadline:
                break
            index.heartbeat("d-fake", epoch, 0, 0, 0)
            time.sleep(0.3)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "KV transfer" in details, details
        assert receiver.manifests == []
    finally:
        index.deregister("d-fake", epoch)
        index.close()
        server.stop(0)
    assert_nothing_held(cluster, pki)


# --------------------------------------------------------------------------------------------- shared memory
def shm_push(cluster, pki, layout, rid, res, shm_name):
    manifest = TransferManifest(rid, res.target.handle, layout, tuple(res.target.block_ids),
                                tuple(bytes(16) for _ in res.target.block_ids), "raw", "shm", shm_name,
                                len(res.target.block_ids) * layout.block_bytes("raw"))
    with channel(cluster, "d0", pki["p-evil"]) as ch:
        return code_of(lambda: kv_transfer_pb2_grpc.KvTransferStub(ch).Push(
            iter([kv_transfer_pb2.KvChunk(manifest=manifest_to_pb(manifest))]), timeout=30))


def test_a_push_naming_a_foreign_segment_or_a_path_is_refused_and_reads_nothing(cluster, pki, layout):
    victim = SHM_DIR / f"victim-{uuid.uuid4().hex[:8]}"
    fd = os.open(victim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"secret" * 100_000)
    os.close(fd)
    d = decode_stub(cluster, "d0", pki["gw0"])
    prompt = list(range(1000, 1040))
    try:
        with OutgoingSegment(1 << 20, request_id="another-request", handle="another-handle") as other:
            for name, why in [(victim.name, "invalid segment name"), (f"../../{victim.name}", "invalid segment name"),
                              ("../../../etc/passwd", "invalid segment name"),
                              (other.name, "made for another reservation")]:
                rid = new_id("shm")
                res = reserve(d, rid, prompt)
                code, details = shm_push(cluster, pki, layout, rid, res, name)
                assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("shm_name:"), details
                assert why in details
                assert_released(cluster, pki, "d0", rid, res.target.handle)
            assert (SHM_DIR / other.name).exists()                 # refused segments are not taken (unlinked)
        assert victim.read_bytes() == b"secret" * 100_000
    finally:
        victim.unlink()
    assert_nothing_held(cluster, pki)


# --------------------------------------------------------------------------------------------- caps
def test_a_huge_lease_gets_the_workers_cap(cluster, pki):
    d = decode_stub(cluster, "d0", pki["gw0"])
    rid = new_id("lease")
    before_ms = time.time() * 1000
    res = reserve(d, rid, list(range(1000, 1040)), lease_ms=2**32 - 1)
    try:
        granted_ms = res.lease_expiry_unix_ms - before_ms
        assert MAX_LEASE_MS - 10_000 < granted_ms <= MAX_LEASE_MS + 10_000
    finally:
        assert d.Abort(worker_pb2.AbortRequest(request_id=rid), timeout=10).found
    assert_nothing_held(cluster, pki)


def test_one_caller_cannot_hold_more_than_its_share_of_uncommitted_reservations(cluster, pki):
    num_blocks = stats(cluster, pki, "d0").num_blocks
    share = int(0.5 * num_blocks)                          # the default max_reserved_fraction_per_caller
    per = share // 3 + 1                                   # two fit in the share, three do not
    prompt = list(range(2000, 2000 + per * BLOCK_SIZE - 1))  # exactly `per` blocks
    assert 3 * per + per <= num_blocks                     # the pool itself has room for all of them
    gw0, gw1 = decode_stub(cluster, "d0", pki["gw0"]), decode_stub(cluster, "d0", pki["gw1"])
    rids = [new_id("share") for _ in range(4)]
    try:
        first = reserve(gw0, rids[0], prompt)
        reserve(gw0, rids[1], prompt)
        with pytest.raises(grpc.RpcError) as info:
            reserve(gw0, rids[2], prompt)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "gw0" in info.value.details()
        hints = dict(info.value.trailing_metadata() or ())
        assert 0 < int(hints["retry-after-ms"]) <= 1000
        reserve(gw1, rids[3], prompt)                      # another caller is not affected
        # Once its KV is committed a reservation no longer counts against the caller.
        prefill_stub(cluster, pki["gw0"]).Prefill(
            worker_pb2.PrefillRequest(request=worker_request(rids[0], prompt), target=first.target),
            timeout=RPC_TIMEOUT_S)
        reserve(gw0, rids[2], prompt)
    finally:
        for rid in rids:
            gw0.Abort(worker_pb2.AbortRequest(request_id=rid), timeout=10)
    assert_nothing_held(cluster, pki)


# --------------------------------------------------------------------------------------------- poisoning
def random_kv(layout: KvLayoutSpec, num_blocks: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim,
                       generator=g)  # [L, 2, n, block_size, Hkv, D]


def poison(cluster, pki, layout, decode_worker: str, pusher: str, question: str):
    """Reserve (as a gateway) the chat prompt of `question` on `decode_worker`, push random KV for it with
    `pusher`'s certificate, then try to decode on it. Returns the push's failure (or None) and the Decode's."""
    prompt, rid = chat_prompt(cluster, question), new_id("poison")
    d = decode_stub(cluster, decode_worker, pki["gw1"])
    res = reserve(d, rid, prompt)
    blocks = list(res.target.block_ids)
    with KvSender(tls=pki[pusher]) as sender:
        try:
            sender.push(res.target.endpoint, request_id=rid, handle=res.target.handle, layout=layout,
                        kv_cache=random_kv(layout, len(blocks)), src_block_ids=range(len(blocks)),
                        dst_block_ids=blocks, transport="grpc")
            push_failure = None
        except TransferFailed as exc:
            push_failure = exc
    decode = code_of(lambda: list(d.Decode(worker_pb2.DecodeRequest(request_id=rid, handle=res.target.handle,
                                                                    first_token_id=1), timeout=30)))
    d.Abort(worker_pb2.AbortRequest(request_id=rid), timeout=10)
    return push_failure, decode


def test_prefix_cache_poisoning_fails_closed_and_the_honest_answer_stays_right(cluster, pki, layout):
    question = "What is the capital of Germany?"
    # An attacker with a gateway certificate (it may reserve) but no prefill certificate cannot push.
    push_failure, decode = poison(cluster, pki, layout, "d0", "gw1", question)
    assert push_failure is not None and push_failure.code == grpc.StatusCode.PERMISSION_DENIED
    assert decode[0] == grpc.StatusCode.FAILED_PRECONDITION          # nothing committed: no decoding on it
    # With a valid prefill certificate, --verify-kv recomputes (d1: layer 0 of some blocks, d2: the whole
    # prompt) and rejects the KV.
    for decode_worker in ("d1", "d2"):
        push_failure, decode = poison(cluster, pki, layout, decode_worker, "p-evil", question)
        assert push_failure is not None and push_failure.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "layer 0" in push_failure.details and "block_digests[" in push_failure.details
        assert decode[0] == grpc.StatusCode.FAILED_PRECONDITION
        assert stats(cluster, pki, decode_worker).transfer_errors == 1
    # Honest users still get the right answer on every decode worker, the second time from D's prefix cache
    # (the honest KV came from p0, authenticated as a prefill worker, and passed d1's and d2's checks).
    for decode_worker in ("d0", "d1", "d2"):
        for attempt in range(2):
            text, res = ask(cluster, pki, decode_worker, question)
            assert "Berlin" in text, (decode_worker, text)
        assert res.target.num_cached_blocks > 0
    assert_nothing_held(cluster, pki)


# --------------------------------------------------------------------------------------------- trust (in-process)
def test_plaintext_kv_is_kept_out_of_the_prefix_cache_unless_the_worker_trusts_plaintext():
    """DecodeWorker.commit: KV whose sender no certificate proves (sender_role None) enters the prefix cache
    only when the worker trusts plaintext (insecure internal); a TLS-proven prefill worker's always does."""
    prompt = list(range(3, 40))
    for trust_plaintext, sender_role, cached in [(False, None, False), (True, None, True), (False, "prefill", True)]:
        loop = EngineLoop(tiny_engine(num_kv_blocks=64)).start()
        try:
            worker = DecodeWorker(loop, 60_000, trust_plaintext_kv=trust_plaintext)
            res = worker.reserve(request_from_pb(worker_request("a", prompt, SamplingParams(max_tokens=2))), 30_000)
            manifest = TransferManifest("a", res.handle, worker.layout, tuple(res.missing_block_ids), (), "raw",
                                        "grpc", "", 0)
            target = worker.check(manifest)
            worker.commit("a", res.handle, ReceivedBlocks(target.block_ids, 0, "raw", "grpc", sender_role))
            list(worker.decode("a", res.handle, first_token_id=5))
            again = worker.reserve(request_from_pb(worker_request("b", prompt)), 30_000)
            assert (again.num_cached_blocks > 0) == cached, (trust_plaintext, sender_role)
            worker.abort("b")
        finally:
            loop.stop()


@pytest.mark.parametrize("insecure_internal", [False, True])
def test_a_plaintext_decode_worker_caches_received_kv_only_with_insecure_internal(insecure_internal):
    """Real workers over plaintext: after a disaggregated request the decode worker holds the prompt's
    prefix for the next Reserve only when it runs with insecure_internal (the operator's explicit trust)."""
    engine_config = EngineConfig(model="tiny-random", num_kv_blocks=256, block_size=4, dtype="float32")
    d = start_decode(DecodeWorkerConfig("d0", None, insecure_internal=insecure_internal), engine_config,
                     engine=tiny_engine())
    p = start_prefill(PrefillWorkerConfig("p0", None, decode_endpoints=(f"127.0.0.1:{d.port}",)), engine_config,
                      engine=tiny_engine())
    prompt, params = list(range(3, 40)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    try:
        dstub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(f"127.0.0.1:{d.port}"))
        pstub = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(f"127.0.0.1:{p.port}"))
        res = reserve(dstub, "first", prompt)
        pre = pstub.Prefill(worker_pb2.PrefillRequest(request=worker_request("first", prompt, params),
                                                      target=res.target), timeout=60)
        list(dstub.Decode(worker_pb2.DecodeRequest(request_id="first", handle=res.target.handle,
                                                   first_token_id=pre.first_token_id), timeout=60))
        again = reserve(dstub, "second", prompt)
        assert (again.target.num_cached_blocks > 0) == insecure_internal
        dstub.Abort(worker_pb2.AbortRequest(request_id="second"), timeout=10)
    finally:
        p.stop(0)
        d.stop(0)
