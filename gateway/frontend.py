"""The request path both public APIs share (the gRPC servicer in gateway.server, the OpenAI HTTP front in
gateway.http_front): admission, the orchestrator, metrics, and the calls a drain waits for.

    with frontend.call("http", "completions") as call:     # counted in flight; its status recorded on leaving
        req = await frontend.validate(parse_completion, body)  # on a thread: tokenizing never blocks the loop
        async with contextlib.aclosing(call.generate(req, deadline=None)) as chunks:
            async for chunk in chunks: ...

The status recorded is `error_code` of the exception leaving the `with` block (OK when none), or of
`call.error` when the front handled the error itself (an HTTP stream reports errors in-band). Leaving early
(client cancel, disconnect, error) closes `generate`, which aborts the request on its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from engine.tokenizer import Tokenizer
from gateway.metrics import GatewayMetrics
from gateway.orchestrator import Orchestrator
from gateway.request_types import OutputChunk, RequestTrace, error_code
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
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False


class Frontend:
    """The served model and the objects every public request goes through."""

    def __init__(self, model: ModelSpec, tokenizer: Tokenizer, orchestrator: Orchestrator,
                 metrics: GatewayMetrics) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.active = ActiveCalls()
        self._validation = ThreadPoolExecutor(NUM_VALIDATION_THREADS, thread_name_prefix="gateway-validate")

    async def validate(self, validate: Callable[..., T], body) -> T:
        """`validate(body, model, tokenizer, running_ids)` (gateway.validation / openai_protocol) on a thread."""
        return await asyncio.get_running_loop().run_in_executor(
            self._validation, functools.partial(validate, body, self.model, self.tokenizer, self.running_ids))

    def close(self) -> None:
        self._validation.shutdown(wait=False, cancel_futures=True)

    @property
    def running_ids(self) -> set[str]:
        """Request ids in flight (validation refuses a duplicate caller-chosen id)."""
        return self.orchestrator.running_ids

    def call(self, api: str, endpoint: str) -> Call:
        """One request of `api` ("grpc" or "http") to `endpoint`, arriving now."""
        return Call(self, api, endpoint)


class Call:
    """One public request from arrival to its last byte (a context manager; see the module doc)."""

    def __init__(self, frontend: Frontend, api: str, endpoint: str) -> None:
        self.arrival = time.monotonic()
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
        """Admit `req` (Overloaded at max_inflight) and run it; `deadline` is a time.monotonic() value."""
        with self._orchestrator.admit(req.request_id):
            async for chunk in self._orchestrator.generate(req, deadline=deadline, arrival=self.arrival,
                                                           trace=self.trace):
                self._recorder.chunk(chunk)
                yield chunk
