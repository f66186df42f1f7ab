"""API keys on the shared request path: the tenant's cache namespace reaches the orchestrator (hashing and the
workers), per-key limits become KeyLimited with the key's retry hint, each request is charged what it used and
released once; without keys nothing changes. Also the statuses and the gateway config's security checks."""
from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from engine.sampling_params import SamplingParams
from gateway.auth import ApiKeyStore, Unauthenticated, cache_namespace, parse_api_keys
from gateway.config import GatewayConfig
from gateway.frontend import Frontend
from gateway.http_front import error_of
from gateway.metrics import GatewayMetrics
from gateway.request_types import KeyLimited, OutputChunk, error_code
from gateway.server import status_of
from gateway.validation import GenerationRequest, ModelSpec

MODEL = ModelSpec(name="tiny", max_model_len=64, vocab_size=16, fingerprint="fp")
ACME = "acme-key-0123456789abcdef"
SOLO = "solo-key-0123456789abcdef"
THRIFTY = "thrifty-key-0123456789abcdef"
KEYS = f"{ACME} acme\n{SOLO} solo max_concurrent=1\n{THRIFTY} thrifty tokens_per_minute=10\n"


class FakeOrchestrator:
    """Records the requests it runs; each yields `num_tokens` one-token chunks, waiting on `gate` before the last."""

    def __init__(self, num_tokens: int = 3) -> None:
        self.num_tokens = num_tokens
        self.requests: list[GenerationRequest] = []
        self.running_ids: set[str] = set()
        self.gate: asyncio.Event | None = None

    @contextlib.contextmanager
    def admit(self, request_id: str):
        self.running_ids.add(request_id)
        try:
            yield
        finally:
            self.running_ids.discard(request_id)

    async def generate(self, req, *, deadline, arrival, trace):
        self.requests.append(req)
        for i in range(self.num_tokens):
            if i == self.num_tokens - 1 and self.gate is not None:
                await self.gate.wait()
            yield OutputChunk("x", (i + 1,))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(request_id: str = "r1", num_prompt_tokens: int = 4, cache_salt: str = "") -> GenerationRequest:
    return GenerationRequest(request_id, tuple(range(1, num_prompt_tokens + 1)), SamplingParams(max_tokens=8, seed=1),
                             cache_salt=cache_salt)


def frontend(keys: ApiKeyStore | None, orchestrator: FakeOrchestrator) -> Frontend:
    return Frontend(MODEL, None, orchestrator, GatewayMetrics(), keys)


async def run(f: Frontend, principal, req: GenerationRequest) -> list[OutputChunk]:
    with f.call("grpc", "generate", principal) as call:
        async with contextlib.aclosing(call.generate(req, None)) as chunks:
            return [chunk async for chunk in chunks]


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def keys(clock):
    return ApiKeyStore(parse_api_keys(KEYS), clock=clock)


def test_a_keys_tenant_namespaces_the_cache_salt_the_orchestrator_gets(keys):
    orch = FakeOrchestrator()
    f = frontend(keys, orch)
    principal = f.authenticate(f"Bearer {ACME}")
    assert principal.tenant == "acme"
    asyncio.run(run(f, principal, request("a", cache_salt="mine")))
    asyncio.run(run(f, principal, request("b")))
    assert [r.cache_salt for r in orch.requests] == [cache_namespace("acme", "mine"), cache_namespace("acme", "")]
    assert orch.requests[1].cache_salt != "" and keys.num_running(principal) == 0
    f.close()


def test_without_keys_requests_keep_their_own_salt_and_nobody_is_asked_for_one():
    orch = FakeOrchestrator()
    f = frontend(None, orch)
    assert f.authenticate(None) is None
    asyncio.run(run(f, None, request(cache_salt="mine")))
    assert [r.cache_salt for r in orch.requests] == ["mine"]
    f.close()


@pytest.mark.parametrize("header", [None, "", f"Basic {ACME}", "Bearer wrong-key-0123456789abc", ACME])
def test_a_missing_malformed_or_unknown_key_is_unauthenticated(keys, header):
    f = frontend(keys, FakeOrchestrator())
    with pytest.raises(Unauthenticated):
        f.authenticate(header)
    f.close()


def test_a_key_at_max_concurrent_is_key_limited_until_its_request_ends(keys):
    orch = FakeOrchestrator()
    f = frontend(keys, orch)
    solo = f.authenticate(f"Bearer {SOLO}")

    async def scenario():
        orch.gate = asyncio.Event()
        first = asyncio.ensure_future(run(f, solo, request("first")))
        while keys.num_running(solo) == 0:
            await asyncio.sleep(0)
        with pytest.raises(KeyLimited) as info:
            await run(f, solo, request("second"))
        assert info.value.retry_after_ms == 1000
        assert [r.request_id for r in orch.requests] == ["first"]      # refused before the orchestrator
        orch.gate.set()
        await first
        assert keys.num_running(solo) == 0
        orch.gate = None
        await run(f, solo, request("third"))

    asyncio.run(scenario())
    assert [r.request_id for r in orch.requests] == ["first", "third"]
    f.close()


def test_a_request_is_charged_its_prompt_and_completion_tokens(keys, clock):
    orch = FakeOrchestrator(num_tokens=3)
    f = frontend(keys, orch)
    thrifty = f.authenticate(f"Bearer {THRIFTY}")
    asyncio.run(run(f, thrifty, request("a", num_prompt_tokens=4)))     # bucket 10 -> 10 - 4 - 3 = 3
    asyncio.run(run(f, thrifty, request("b", num_prompt_tokens=4)))     # admitted at 3 -> 3 - 7 = -4
    with pytest.raises(KeyLimited) as info:
        asyncio.run(run(f, thrifty, request("c")))
    assert info.value.retry_after_ms == 30_000                         # (1 - (-4)) tokens at 10/60 per second
    clock.now += 30.0
    asyncio.run(run(f, thrifty, request("d")))
    assert [r.request_id for r in orch.requests] == ["a", "b", "d"]
    f.close()


def test_statuses_of_authentication_and_key_limits():
    assert error_code(Unauthenticated("unknown API key")) == "UNAUTHENTICATED"
    assert status_of(Unauthenticated("unknown API key"))[0] == grpc.StatusCode.UNAUTHENTICATED
    status, body, headers = error_of(Unauthenticated("unknown API key"))
    assert (status, body["error"]["code"], headers) == (401, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
    limited = KeyLimited("key abc is over 10 tokens per minute", retry_after_ms=2500)
    code, _, metadata = status_of(limited)
    assert (code, metadata) == (grpc.StatusCode.RESOURCE_EXHAUSTED, (("retry-after-ms", "2500"),))
    status, body, headers = error_of(limited)
    assert (status, body["error"]["type"], headers) == (429, "rate_limit_error", {"Retry-After": "3"})


# ------------------------------------------------------------------------------------------------ config
def config(**kwargs) -> GatewayConfig:
    return GatewayConfig(model="m", redis_url="redis://r", **kwargs)


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "10.0.0.5", "gateway.example.com"])
def test_a_non_loopback_host_needs_keys_or_allow_unauthenticated(host):
    with pytest.raises(ValueError, match="GatewayConfig.host"):
        config(host=host)
    assert config(host=host, api_key_file="/keys").host == host
    assert config(host=host, allow_unauthenticated=True).host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_hosts_need_no_keys(host):
    assert config(host=host).api_key_file is None


def test_tls_files_go_together_and_insecure_internal_excludes_them():
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        config(tls_cert="/c.pem")
    with pytest.raises(ValueError, match="go together"):
        config(cluster_ca="/ca.pem", cluster_cert="/g.pem")
    with pytest.raises(ValueError, match="insecure_internal"):
        config(cluster_ca="/ca.pem", cluster_cert="/g.pem", cluster_key="/g-key.pem", insecure_internal=True)
    files = config(cluster_ca="/ca.pem", cluster_cert="/g.pem", cluster_key="/g-key.pem").cluster_tls
    assert (str(files.ca_path), str(files.cert_path), str(files.key_path)) == ("/ca.pem", "/g.pem", "/g-key.pem")
    assert config().cluster_tls is None
