"""The gateway's security against real processes: a `pdserve gateway` process with API keys, TLS on its public
ports and mutual TLS toward real prefill and decode workers (a cluster PKI from protos.tls), a real redis-server.

    keys          no key, a wrong key, a right one, on gRPC and HTTP; health stays open; SIGHUP reloads the key
                  file (an invalid file keeps the old keys)
    limits        a key with max_concurrent=1 gets RESOURCE_EXHAUSTED / 429 on a second concurrent stream; a key
                  over its tokens_per_minute gets it with the retry hint
    tenants       the same prompt under two tenants' keys: no cache hit for the second; same tenant: a hit
    clients       the Python client over TLS; the official `openai` client over HTTPS with a CA bundle
    records       worker records in Redis that point to listeners without a certificate of their role (another
                  CA, a prefill certificate posing as a decode worker, plaintext): never sent a request, marked
                  down, the request served by the real workers
    start         a non-loopback bind without keys, and a gateway with neither cluster certificates nor
                  --insecure-internal, refuse to start
"""
from __future__ import annotations

import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.embedded_redis import EmbeddedRedis, free_ports
from kvstore.index import PrefixIndex
from pdserve.client import Client, PdserveError
from protos import tls
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from tests.integration.cluster import (BLOCK_SIZE, MAX_MODEL_LEN, REPO, RPC_TIMEOUT_S, START_TIMEOUT_S, Cluster,
                                       Reference, assert_idle)

KEYS = {"acme-1": "acme-key-one-0123456789abcdef", "acme-2": "acme-key-two-0123456789abcdef",
        "globex": "globex-key-0123456789abcdef", "solo": "solo-key-0123456789abcdef",
        "thrifty": "thrifty-key-0123456789abcdef"}
KEY_FILE = f"""# test keys
{KEYS["acme-1"]} acme
{KEYS["acme-2"]} acme
{KEYS["globex"]} globex
{KEYS["solo"]} solo max_concurrent=1
{KEYS["thrifty"]} thrifty tokens_per_minute=20
"""
WRONG_KEY = "not-a-configured-key-0123456789"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of Germany is"
WAIT_S = 60.0



def wait_until(predicate, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return tls.write_cluster_pki(tmp_path_factory.mktemp("pki"), [
        ("prefill", "p0"), ("decode", "d0"), ("gateway", "gateway"), ("probe", "probe"), ("prefill", "p-evil")])


@pytest.fixture(scope="module")
def public_pki(tmp_path_factory):
    """The gateway's public certificate, from a CA of its own (clients trust it with --ca-cert)."""
    return tls.write_cluster_pki(tmp_path_factory.mktemp("public"), [("gateway", "public")])["public"]


@pytest.fixture(scope="module")
def foreign_pki(tmp_path_factory):
    """Another CA issuing a decode certificate: it proves nothing to this cluster."""
    return tls.write_cluster_pki(tmp_path_factory.mktemp("foreign"), [("decode", "d0")])["d0"]


@pytest.fixture(scope="module")
def cluster(default_model_path, pki):
    with EmbeddedRedis() as redis:
        c = Cluster(default_model_path, redis, pki)
        try:
            c.start_worker("prefill", "p0")
            c.start_worker("decode", "d0")
            c.reference = Reference(default_model_path)
            c.wait_registered("p0", "d0")
            yield c
        finally:
            c.close()


class GatewayProcess:
    """`pdserve gateway` as a child process; its log is kept in `log_path`."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pdserve", *argv], cwd=REPO, stdout=log,
                                         stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def gateway(cluster, pki, public_pki, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gateway")
    key_file = run_dir / "keys"
    key_file.write_text(KEY_FILE)
    port, http_port = free_ports(2)
    g = pki["gateway"]
    gw = GatewayProcess([
        "gateway", "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port),
        "--redis-url", cluster.redis.url, "--model", str(cluster.model_path), "--block-size", str(BLOCK_SIZE),
        "--max-model-len", str(MAX_MODEL_LEN), "--local-prefill-threshold", "0",
        "--api-key-file", str(key_file), "--tls-cert", str(public_pki.cert_path),
        "--tls-key", str(public_pki.key_path), "--cluster-ca", str(g.ca_path), "--cluster-cert", str(g.cert_path),
        "--cluster-key", str(g.key_path)], run_dir / "gateway.log")
    gw.target, gw.url, gw.key_file, gw.ca = f"127.0.0.1:{port}", f"https://127.0.0.1:{http_port}", key_file, \
        str(public_pki.ca_path)
    try:
        with grpc.secure_channel(gw.target, tls.public_channel_credentials(gw.ca)) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def serving():
                assert gw.proc.poll() is None, f"gateway exited:\n{gw.log()}"
                try:
                    return health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    return False

            wait_until(serving, "the gateway to serve", START_TIMEOUT_S)
        yield gw
    finally:
        gw.stop()


def client(gateway, name: str | None = None, api_key: str | None = None) -> Client:
    return Client(gateway.target, timeout=RPC_TIMEOUT_S, api_key=KEYS[name] if name else api_key, ca_cert=gateway.ca)


def http(gateway, name: str | None = None, api_key: str | None = None) -> httpx.Client:
    key = KEYS[name] if name else api_key
    return httpx.Client(base_url=gateway.url, verify=ssl.create_default_context(cafile=gateway.ca), timeout=RPC_TIMEOUT_S,
                        headers={"Authorization": f"Bearer {key}"} if key else {})


def completion(http_client: httpx.Client, prompt: str = PROMPT, max_tokens: int = 8) -> httpx.Response:
    return http_client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


# ------------------------------------------------------------------------------------------------ API keys
def test_grpc_without_a_known_key_is_unauthenticated(gateway):
    for api_key in (None, WRONG_KEY):
        with client(gateway, api_key=api_key) as c:
            with pytest.raises(PdserveError) as info:
                c.complete(PROMPT, max_tokens=4)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(PdserveError) as info:
                c.list_models()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with grpc.secure_channel(gateway.target, tls.public_channel_credentials(gateway.ca)) as channel:
        with pytest.raises(grpc.RpcError) as info:       # a malformed header is no key either
            generation_pb2_grpc.GenerationStub(channel).ListModels(
                generation_pb2.ListModelsRequest(), metadata=(("authorization", KEYS["acme-1"]),), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING   # probes carry no key


def test_grpc_with_a_key_over_tls_gives_the_reference_answer(gateway, cluster):
    with client(gateway, "acme-1") as c:
        assert c.list_models()[0].max_model_len == MAX_MODEL_LEN
        result = c.complete(PROMPT, max_tokens=8, temperature=0)
        assert list(result.token_ids) == cluster.reference(PROMPT, max_tokens=8)[1]
        assert "Paris" in c.complete_chat(FRANCE, max_tokens=16, temperature=0).text


def test_plaintext_clients_cannot_use_the_tls_port(gateway):
    with Client(gateway.target, timeout=10, api_key=KEYS["acme-1"]) as c:
        with pytest.raises(PdserveError) as info:
            c.list_models()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_http_without_a_known_key_is_401_and_health_stays_open(gateway):
    for api_key in (None, WRONG_KEY):
        with http(gateway, api_key=api_key) as h:
            for response in (completion(h), h.get("/v1/models"), h.get("/metrics"),
                             h.post("/v1/chat/completions", json={"messages": FRANCE}),
                             h.get("/v1/models/default"), h.get("/version"),
                             h.post("/tokenize", json={"prompt": PROMPT}), h.post("/detokenize", json={"tokens": [1]})):
                assert response.status_code == 401
                assert response.headers["WWW-Authenticate"] == "Bearer"
                error = response.json()["error"]
                assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert h.get("/health").status_code == 200
    with http(gateway) as h:
        h.headers["Authorization"] = "Basic " + KEYS["acme-1"]       # another scheme is no key either
        assert completion(h).status_code == 401


def test_http_with_a_key(gateway, cluster):
    with http(gateway, "globex") as h:
        response = completion(h)
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == cluster.reference(PROMPT, max_tokens=8)[0]
        assert h.get("/v1/models").status_code == 200
        name = h.get("/v1/models").json()["data"][0]["id"]
        assert h.get(f"/v1/models/{name}").json()["id"] == name
        assert h.get("/version").status_code == 200
        assert h.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"] == \
            cluster.reference.llm.tokenizer.encode(PROMPT)
        def refused() -> dict[str, float]:
            text = h.get("/metrics").text
            return {api: _sample(text, f'pdserve_unauthenticated_requests_total{{api="{api}"}}')
                    for api in ("grpc", "http")}

        before = refused()
        with http(gateway, api_key=WRONG_KEY) as wrong:
            assert completion(wrong).status_code == 401
        with client(gateway, api_key=WRONG_KEY) as wrong, pytest.raises(PdserveError):
            wrong.list_models()
        assert refused() == {api: count + 1 for api, count in before.items()}


def _sample(exposition: str, name: str) -> float:
    return next((float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines() if line.startswith(name + " ")),
                0.0)


def test_openai_client_over_https_with_a_ca_bundle(gateway):
    with httpx.Client(verify=gateway.ca) as http_client:
        api = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEYS["acme-2"], http_client=http_client)
        model = api.models.list().data[0].id
        answer = api.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=16)
        assert "Paris" in answer.choices[0].message.content
        wrong = openai.OpenAI(base_url=gateway.url + "/v1", api_key=WRONG_KEY, http_client=http_client,
                              max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=model, messages=FRANCE, max_tokens=4)


def test_sighup_reloads_the_key_file_and_keeps_the_old_keys_on_a_bad_one(gateway):
    new_key = "rotated-in-key-0123456789abcdef"

    def accepted(api_key: str) -> bool:
        with client(gateway, api_key=api_key) as c:
            try:
                c.list_models()
                return True
            except PdserveError as exc:
                assert exc.code == grpc.StatusCode.UNAUTHENTICATED
                return False

    def reload(text: str, log_line: str) -> None:
        count = gateway.log().count(log_line)
        gateway.key_file.write_text(text)
        gateway.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: gateway.log().count(log_line) > count, f"{log_line!r} in the gateway's log")

    try:
        assert not accepted(new_key)
        reload(KEY_FILE + f"{new_key} rotated\n", "API keys reloaded")
        assert accepted(new_key) and accepted(KEYS["acme-1"])
        with http(gateway, api_key=new_key) as h:
            assert completion(h, max_tokens=2).status_code == 200

        reload(KEY_FILE + f"{new_key} rotated\nshort\n", "API keys not reloaded")   # invalid: line 8
        assert f"{gateway.key_file}:8" in gateway.log() and new_key not in gateway.log()
        assert accepted(new_key)                         # the old set stays

        reload(KEY_FILE.replace(f"{KEYS['globex']} globex\n", ""), "API keys reloaded")
        assert not accepted(new_key) and not accepted(KEYS["globex"]) and accepted(KEYS["acme-1"])
    finally:
        gateway.key_file.write_text(KEY_FILE)
        gateway.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: accepted(KEYS["globex"]), "the original keys back")


# ------------------------------------------------------------------------------------------------ limits
def test_a_key_at_max_concurrent_gets_resource_exhausted_with_the_retry_hint(gateway, cluster):
    with grpc.secure_channel(gateway.target, tls.public_channel_credentials(gateway.ca)) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        solo = (("authorization", f"Bearer {KEYS['solo']}"),)
        first = stub.Generate(greedy_request(400), metadata=solo, timeout=RPC_TIMEOUT_S)
        next(first)                                      # streaming: the key's one slot is taken
        try:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(greedy_request(4), metadata=solo, timeout=RPC_TIMEOUT_S))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_concurrent" in info.value.details()
            assert int(dict(info.value.trailing_metadata())["retry-after-ms"]) > 0
            with http(gateway, "solo") as h:
                response = completion(h)
                assert response.status_code == 429 and int(response.headers["Retry-After"]) >= 1
                assert response.json()["error"]["type"] == "rate_limit_error"
            with client(gateway, "acme-1") as other:     # other keys are not limited by it
                assert other.complete(PROMPT, max_tokens=2).usage.completion_tokens == 2
        finally:
            first.cancel()
    with client(gateway, "solo") as c:                   # the slot is released with the cancelled stream

        def admitted():
            try:
                return c.complete(PROMPT, max_tokens=2).usage.completion_tokens == 2
            except PdserveError as exc:
                assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False

        wait_until(admitted, "the solo key's slot to be released")
    assert_idle(cluster.wait_idle())


def greedy_request(max_tokens: int) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(text=PROMPT)
    request.sampling.max_tokens = max_tokens
    request.sampling.temperature = 0
    request.sampling.ignore_eos = True
    return request


def test_a_key_over_its_tokens_per_minute_gets_the_retry_hint(gateway):
    with client(gateway, "thrifty") as c:
        first = c.complete(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)   # admitted: the bucket was full
        assert first.usage.prompt_tokens + first.usage.completion_tokens > 20
        with pytest.raises(PdserveError) as info:
            c.complete(PROMPT, max_tokens=2)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tokens per minute" in info.value.message
    with http(gateway, "thrifty") as h:
        response = completion(h)
        # The bucket refills 20 tokens a minute: it is short of a token for more than a second.
        assert response.status_code == 429 and int(response.headers["Retry-After"]) > 1


# ------------------------------------------------------------------------------------------------ tenants
def test_tenants_never_share_cached_prefixes(gateway, cluster):
    prompt = f"Tenant isolation {uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog; " * 8
    cached = {}
    for name in ("acme-1", "globex", "acme-2"):
        with client(gateway, name) as c:
            result = c.complete(prompt, max_tokens=2, temperature=0)
            cached[name] = result.usage.cached_tokens
            assert result.usage.prompt_tokens > 4 * BLOCK_SIZE
    assert cached["acme-1"] == 0                          # cold
    assert cached["globex"] == 0                          # another tenant: no hit on acme's blocks
    assert cached["acme-2"] >= 4 * BLOCK_SIZE             # the same tenant (another key) shares them


# ------------------------------------------------------------------------------------------------ forged records
class _Recorder(grpc.GenericRpcHandler):
    """Records every RPC that reaches the server (none is implemented)."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    def service(self, handler_call_details):
        self.methods.append(handler_call_details.method)
        return None


class Impostor:
    """A gRPC server (TLS with `credentials`, plaintext without) recording every RPC that reaches it, behind a TCP
    relay that counts connections: proof that the gateway dialled it."""

    def __init__(self, credentials: grpc.ServerCredentials | None) -> None:
        self.recorder = _Recorder()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[self.recorder])
        address = "127.0.0.1:0"
        self.backend_port = self.server.add_secure_port(address, credentials) if credentials is not None else \
            self.server.add_insecure_port(address)
        self.server.start()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.num_connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.num_connections += 1
            try:
                backend = socket.create_connection(("127.0.0.1", self.backend_port))
            except OSError:       # the server is stopped: the dialler sees its connection closed
                conn.close()
                continue
            for src, dst in ((conn, backend), (backend, conn)):
                threading.Thread(target=_pipe, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        self.server.stop(0)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_worker_records_without_a_certificate_of_their_role_get_no_request(gateway, cluster, pki, foreign_pki):
    """Anyone who can write to Redis registers "workers" that look best to the router (free blocks, names that
    win ties): one with another CA's decode certificate, one with this cluster's prefill certificate posing as a
    decode worker, one plaintext posing as a prefill worker."""
    impostors = {"d-a-foreign": ("decode", Impostor(tls.server_credentials(foreign_pki))),
                 "d-b-prefill-cert": ("decode", Impostor(tls.server_credentials(pki["p-evil"]))),
                 "a-plaintext": ("prefill", Impostor(None))}
    index = PrefixIndex(cluster.redis.url, worker_ttl_s=600.0)
    real = {w.worker_id: w for w in index.list_workers()}
    try:
        for worker_id, (role, impostor) in impostors.items():
            model = real["d0" if role == "decode" else "p0"]
            index.register(type(model)(**{**model.__dict__, "worker_id": worker_id, "grpc_endpoint": impostor.endpoint,
                                          "epoch": 0, "free_blocks": 10 * model.capacity_blocks,
                                          "capacity_blocks": 10 * model.capacity_blocks}))
        prompts = [f"Forged record {i}: {PROMPT}" for i in range(3)]
        with client(gateway, "acme-1") as c:
            for prompt in prompts:
                result = c.complete(prompt, max_tokens=8, temperature=0)
                assert list(result.token_ids) == cluster.reference(prompt, max_tokens=8)[1]
        with http(gateway) as h:                         # marked down: /health counts only the real decode worker
            wait_until(lambda: h.get("/health").json()["decode_workers"] == 1, "the impostors to be down")
        for worker_id, (role, impostor) in impostors.items():
            assert impostor.num_connections > 0, f"{worker_id} was never dialled"
            assert impostor.recorder.methods == [], f"{worker_id} received {impostor.recorder.methods}"
        assert_idle(cluster.wait_idle())
    finally:
        for worker_id, (role, impostor) in impostors.items():
            index.deregister(worker_id, index_epoch(index, worker_id))
            impostor.close()
        index.close()


def index_epoch(index: PrefixIndex, worker_id: str) -> int:
    return next((w.epoch for w in index.list_workers() or [] if w.worker_id == worker_id), 0)


# ------------------------------------------------------------------------------------------------ refusing to start
def run_gateway_command(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", "gateway", "--redis-url", "redis://127.0.0.1:1/0",
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_non_loopback_bind_without_keys_refuses_to_start():
    result = run_gateway_command("--host", "0.0.0.0", "--insecure-internal")
    assert result.returncode == 2
    assert "--host" in result.stderr and "api_key_file" in result.stderr
    assert "allow_unauthenticated" in result.stderr


def test_a_gateway_without_cluster_certificates_or_insecure_internal_refuses_to_start():
    result = run_gateway_command()
    assert result.returncode == 2
    assert "--cluster-ca" in result.stderr and "--insecure-internal" in result.stderr
