"""The request path both public APIs share (the gRPC servicer in gateway.server, the OpenAI HTTP front in
gateway.http_front): admission, the orchestrator, metrics, and the calls a drain waits for.

    with frontend.call("http", "completions") as call:     # counted in flight; its status recorded on leaving
        req = await frontend.validate(parse_completion, body)  # on a thread: tokenizing never blocks the loop
        await frontend.compile_structured(req.sampling.structured_output)   # its grammar, on the compile thread
        async with contextlib.aclosing(call.generate(req, deadline=None)) as chunks:
            async for chunk in chunks: ...

The status recorded is `error_code` of the exception leaving the `with` block (OK when none), or of
`call.error` when the front handled the error itself (an HTTP stream reports errors in-band). Leaving early
(client cancel, disconnect, error) closes `generate`, which aborts the request on its workers.

API keys (when the gateway has an ApiKeyStore): each front authenticates the caller (`authenticate`: the
Authorization value -> Principal, Unauthenticated otherwise) and passes the Principal to `call`. `generate`
then holds one admission of the key for the request's whole life (RateLimited -> KeyLimited, RESOURCE_EXHAUSTED
with the key's retry hint), charges it the prompt tokens at once and each completion token as it streams, and
runs the request under the cache salt `cache_namespace(tenant, client salt)`: that salt is hashed for routing
and sent to the workers, so tenants never share, hit or probe each other's cached blocks. Without keys the
request's own salt is used, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from engine.grammar import GrammarCompiler
from engine.structured import StructuredOutputSpec
from engine.tokenizer import Tokenizer
from gateway.auth import Admission, ApiKeyStore, Principal, RateLimited, cache_namespace
from gateway.metrics import GatewayMetrics
from gateway.orchestrator import Orchestrator
from gateway.request_types import KeyLimited, OutputChunk, RequestTrace, error_code
from gateway.validation import GenerationRequest, ModelSpec

T = TypeVar("T")
NUM_VALIDATION_THREADS = 4
"""Threads that validate, render chat templates and tokenize (off the event loop, so a long prompt never delays
another request's first byte; prompts that cannot fit are refused before tokenizing, see gateway.validation)."""

class ActiveCalls:
    """Public requests whose response has not been sent yet. The drain waits for these (health Watch streams
    never end by themselves, so grpc's own grace period cannot tell them apart)."""

    def __init__(self) -> None:
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def track(self, context) -> None:
        """Count a gRPC call until its status is sent (`context.add_done_callback`)."""
        self._enter()
        context.add_done_callback(lambda _context: self._exit())

    @contextlib.contextmanager
    def hold(self):
        """Count a request for the duration of the block."""
        self._enter()
        try:
            yield
        finally:
            self._exit()

    def _enter(self) -> None:
        self._count += 1
        self._idle.clear()

    def _exit(self) -> None:
        self._count -= 1
        if self._count == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every tracked call finished within timeout_s."""
        if self._idle.is_set():
            return True
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False


class Frontend:
    """The served model and the objects every public request goes through."""

    def __init__(self, model: ModelSpec, tokenizer: Tokenizer, orchestrator: Orchestrator,
                 metrics: GatewayMetrics, api_keys: ApiKeyStore | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.api_keys = api_keys
        """The configured keys; None: every caller is served, without a tenant."""
        self.active = ActiveCalls()
        self._validation = ThreadPoolExecutor(NUM_VALIDATION_THREADS, thread_name_prefix="gateway-validate")
        self.grammars = GrammarCompiler(tokenizer, model.vocab_size)
        """Compiles structured-output specs before dispatch, so a bad one is refused here, naming its field."""

    async def validate(self, validate: Callable[..., T], body) -> T:
        """`validate(body, model, tokenizer, running_ids)` (gateway.validation / openai_protocol) on a thread."""
        return await asyncio.get_running_loop().run_in_executor(
            self._validation, functools.partial(validate, body, self.model, self.tokenizer, self.running_ids))

    async def compile_structured(self, spec: StructuredOutputSpec | None) -> None:
        """Compile `spec` (cached) on the grammar compiler's thread, never the event loop. Raises
        InvalidRequestError naming `structured_output.<kind>` when it does not compile; the caller renames it."""
        if spec is not None:
            await asyncio.wrap_future(self.grammars.submit(spec))

    def close(self) -> None:
        self._validation.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()

    @property
    def running_ids(self) -> set[str]:
        """Request ids in flight (validation refuses a duplicate caller-chosen id)."""
        return self.orchestrator.running_ids

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The caller named by an Authorization value ("Bearer <key>"); None when no keys are configured.
        Raises gateway.auth.Unauthenticated for a missing, malformed or unknown key."""
        if self.api_keys is None:
            return None
        return self.api_keys.authenticate(authorization)

    def call(self, api: str, endpoint: str, principal: Principal | None = None) -> Call:
        """One request of `api` ("grpc" or "http") to `endpoint`, arriving now, by `principal` (see `authenticate`)."""
        return Call(self, api, endpoint, principal)


class Call:
    """One public request from arrival to its last byte (a context manager; see the module doc)."""

    def __init__(self, frontend: Frontend, api: str, endpoint: str, principal: Principal | None = None) -> None:
        self.arrival = time.monotonic()
        self.principal = principal
        self._api_keys = frontend.api_keys if principal is not None else None
        self.trace = RequestTrace()
        self.error: BaseException | None = None
        """An error the front reported to the client itself; it decides the recorded status."""
        self._orchestrator = frontend.orchestrator
        self._recorder = frontend.metrics.request(api, endpoint, self.arrival, self.trace)

    def __enter__(self) -> Call:
        self._recorder.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._recorder.end(error_code(exc if exc is not None else self.error))
        return False

    async def generate(self, req: GenerationRequest, deadline: float | None) -> AsyncIterator[OutputChunk]:
        """Admit `req` (KeyLimited at a per-key limit, Overloaded at max_inflight) and run it, in its tenant's
        cache namespace; `deadline` is a time.monotonic() value."""
        with self._key_admission(req) as admission, self._orchestrator.admit(req.request_id):
            if self.principal is not None:
                req = dataclasses.replace(req, cache_salt=cache_namespace(self.principal.tenant, req.cache_salt))
            async for chunk in self._orchestrator.generate(req, deadline=deadline, arrival=self.arrival,
                                                           trace=self.trace):
                self._recorder.chunk(chunk)
                if admission is not None and chunk.token_ids:
                    admission.charge(len(chunk.token_ids))
                yield chunk

    @contextlib.contextmanager
    def _key_admission(self, req: GenerationRequest):
        """One admission of the caller's key for the block (None without keys), charged the prompt tokens."""
        if self._api_keys is None:
            yield None
            return
        try:
            admission: Admission = self._api_keys.admit(self.principal)
        except RateLimited as exc:
            raise KeyLimited(str(exc), retry_after_ms=max(1, math.ceil(exc.retry_after_s * 1000))) from None
        with admission:
            admission.charge(req.num_prompt_tokens)
            yield admission
