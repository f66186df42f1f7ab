"""The gateway's OpenAI-compatible HTTP API (aiohttp), served on the event loop of its gRPC server:

    POST /v1/completions        completions; "stream": true answers with server-sent events (data: {...}, then
                                data: [DONE])
    POST /v1/chat/completions   chat completions (messages through the model's chat template); streams as above
    GET  /v1/models             the served model
    GET  /v1/models/{id}        the served model by its name or an alias (404 model_not_found otherwise)
    POST /tokenize, /detokenize vLLM's shapes (gateway.tokenize_api)
    GET  /version               {"version": pdserve's version}
    GET  /health                200 while serving with a usable decode worker; 503 when draining or without one
    GET  /metrics               Prometheus text format (gateway.metrics)

With API keys (Frontend.api_keys) every path but /health needs `Authorization: Bearer <key>`, /metrics
included (Prometheus scrapes the gateway's separate --metrics-port, which has no key); served over HTTPS when
`start` gets an SSLContext.

Requests take the path gRPC requests take (gateway.frontend; bodies parsed by gateway.openai_protocol). Errors
have OpenAI's shape {"error": {"message", "type", "param", "code"}}; `code` is the status name in lower case:

    400  invalid_request_error   a bad parameter (`param` names it); malformed JSON (`param` null)
    401  invalid_request_error   no, a malformed or an unknown API key (code "invalid_api_key");
                                 WWW-Authenticate: Bearer
    404  invalid_request_error   `model` is not served here (code "model_not_found"); an unknown path
    413  invalid_request_error   the body is larger than max_request_bytes
    415  invalid_request_error   a POST body whose Content-Type is not application/json (a web page can send
                                 text/plain or form bodies cross-origin without a preflight)
    429  rate_limit_error        the gateway or every decode worker is full (after the gateway's queue), or
                                 the API key is at a limit; Retry-After header (seconds)
    503  service_unavailable     no live decode worker serves the model, one failed or hung mid-request, or
                                 the gateway is draining
    504  timeout_error           the X-Request-Timeout header's deadline (seconds from arrival) passed
    500  internal_error          a bug: logged with its traceback; the client gets one line

A stream answers 200 once its first token is ready, so errors before it still get their own status; an error
after that is sent in-band as a last event {"error": ...}, then data: [DONE]. A client that disconnects
cancels its handler (aiohttp's handler_cancellation), and with it the request on both workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import logging
import math
import ssl
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from engine.errors import InvalidRequestError
from gateway import tokenize_api
from gateway.auth import Unauthenticated
from gateway.frontend import Call, Frontend
from gateway.openai_protocol import OpenAIRequest, parse_chat, parse_completion
from gateway.openai_response import ResponseBuilder
from gateway.structured_request import rename_error
from gateway.discovery import WorkerDirectory
from gateway.request_types import RETRY_AFTER_MS, ClientGone, OutputChunk, ShuttingDown, Usage, error_code
from gateway.validation import ModelNotFound

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 1.0
"""On close: how long handlers still running get before they are cancelled (the drain already waited)."""
TIMEOUT_HEADER = "X-Request-Timeout"
"""Optional request header: the request's deadline in seconds from its arrival (gRPC's deadline)."""

HTTP_STATUS = {"OK": 200, "INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "RESOURCE_EXHAUSTED": 429,
               "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "CANCELLED": 499, "INTERNAL": 500}
"""request_types.error_code -> HTTP status (499, client closed the connection, is never sent)."""
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_dumps = functools.partial(json.dumps, ensure_ascii=False, separators=(",", ":"))


@functools.cache
def _version() -> str:
    """The installed distribution's version (the serving packages never import the CLI package `pdserve`)."""
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def error_object(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "internal_error"), "param": param,
                      "code": code}}


def error_of(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """(HTTP status, OpenAI error object, extra headers) for an exception that ended a request."""
    code = error_code(exc)
    status, param, headers = HTTP_STATUS[code], None, {}
    message = str(exc)
    if isinstance(exc, BodyRefused):
        return exc.status, error_object(message, exc.status, None, exc.code), headers
    if isinstance(exc, Unauthenticated):
        return 401, error_object(message, 401, None, "invalid_api_key"), {"WWW-Authenticate": "Bearer"}
    if isinstance(exc, InvalidRequestError):
        param = None if exc.field == "body" else exc.field
        if isinstance(exc, ModelNotFound):
            return 404, error_object(message, 404, param, "model_not_found"), headers
    elif code == "RESOURCE_EXHAUSTED":
        retry_ms = getattr(exc, "retry_after_ms", RETRY_AFTER_MS)
        headers["Retry-After"] = str(max(1, math.ceil(retry_ms / 1000)))
        message = f"{exc}; retry after {retry_ms} ms"
    elif code == "INTERNAL":
        log.error("internal error", exc_info=exc)
        message = f"internal error: {type(exc).__name__}: {exc}"
    return status, error_object(message, status, param, code.lower()), headers


def _json(body: dict, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(body, status=status, headers=headers, dumps=_dumps)


def _error_response(exc: BaseException) -> web.Response:
    status, body, headers = error_of(exc)
    return _json(body, status, headers)


def _event(obj: dict) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


async def run_prompts(call: Call, parsed: OpenAIRequest, deadline: float | None) -> AsyncIterator[OutputChunk]:
    """The chunks of every prompt of `parsed` (a batched /v1/completions runs each prompt as a request of its
    own, concurrently), as one stream: choice j of prompt i is index i * n + j, and only the very last chunk
    carries usage (summed over the prompts) and timings (the last prompt's). The first error ends it all;
    closing it closes every prompt's request (aborting what its workers still hold)."""
    reqs = parsed.requests
    if len(reqs) == 1:
        async with contextlib.aclosing(call.generate(reqs[0], deadline)) as chunks:
            async for chunk in chunks:
                yield chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, req) -> None:
        try:
            async with contextlib.aclosing(call.generate(req, deadline)) as chunks:
                async for chunk in chunks:
                    await queue.put((i, chunk))
        except Exception as exc:       # handed to the consumer, which ends the whole request
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, req)) for i, req in enumerate(reqs)]
    try:
        usages: list[Usage] = []
        while len(usages) < len(reqs):
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            chunk = dataclasses.replace(item, choice_index=i * reqs[i].sampling.n + item.choice_index)
            if item.usage is not None:
                usages.append(item.usage)
                total = Usage(*(sum(getattr(u, f) for u in usages)
                                for f in ("prompt_tokens", "completion_tokens", "cached_tokens")))
                last = len(usages) == len(reqs)
                chunk = dataclasses.replace(chunk, usage=total if last else None,
                                            timings=item.timings if last else None)
            yield chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class BodyRefused(InvalidRequestError):
    """A body refused before it is parsed: too large (413) or not JSON by its Content-Type (415)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__("body", message)
        self.status = status
        self.code = code


async def _read_json(request: web.Request, max_bytes: int):
    if request.content_type != "application/json":
        raise BodyRefused(415, "unsupported_media_type",
                          f"Content-Type must be application/json, got {request.content_type!r}")
    if request.content_length is not None and request.content_length > max_bytes:
        raise BodyRefused(413, "request_entity_too_large", f"is larger than {max_bytes} bytes")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyRefused(413, "request_entity_too_large", f"is larger than {max_bytes} bytes") from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        # ValueError covers malformed JSON, bad UTF-8 and integers past Python's 4300-digit conversion limit;
        # RecursionError arrays or objects nested too deep to parse.
        raise InvalidRequestError("body", f"is not valid JSON: {exc}") from None


def _deadline(request: web.Request, arrival: float) -> float | None:
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidRequestError(TIMEOUT_HEADER, f"must be a positive number of seconds, got {value!r}")
    return arrival + seconds


class HttpFront:
    """The aiohttp application and its listening socket; the gateway's server starts, drains and closes it."""

    def __init__(self, frontend: Frontend, directory: WorkerDirectory, max_request_bytes: int = 4 << 20) -> None:
        """`directory`: live workers and their health (/health, the worker gauges); `max_request_bytes`: the
        largest body (GatewayConfig.max_request_bytes)."""
        self._frontend = frontend
        self._directory = directory
        self._max_request_bytes = max_request_bytes
        self._created = int(time.time())
        self.draining = False
        app = web.Application(client_max_size=max_request_bytes, middlewares=[self._errors, self._authenticate])
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat_completions),
                        web.get("/v1/models", self.models), web.get("/v1/models/{model_id:.+}", self.model),
                        web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
                        web.get("/version", self.version), web.get("/health", self.health),
                        web.get("/metrics", self.metrics)])
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=FLUSH_TIMEOUT_S)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on host:port (0 picks a free port), HTTPS with `ssl_context`; returns the port."""
        await self._runner.setup()
        try:
            site = web.TCPSite(self._runner, host.strip("[]") or None, port, ssl_context=ssl_context)
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            raise
        return self._runner.addresses[0][1]

    async def stop_accepting(self) -> None:
        """Start draining: close the listening socket; /health and new requests on open connections get 503."""
        self.draining = True
        for site in list(self._runner.sites):
            await site.stop()

    async def close(self) -> None:
        """Close every connection, cancelling handlers still running after FLUSH_TIMEOUT_S."""
        self.draining = True
        await self._runner.cleanup()

    # -------------------------------------------------------------------------------------------- handlers
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions", parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat_completions", parse_chat)

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._model_object()]})

    async def model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id == "" or not self._frontend.model.accepts(model_id):
            return _error_response(ModelNotFound("model", f"{model_id!r} is not served here; the served model is "
                                                          f"{self._frontend.model.name!r}"))
        return _json(self._model_object())

    def _model_object(self) -> dict:
        model = self._frontend.model
        return {"id": model.name, "object": "model", "created": self._created, "owned_by": "pdserve",
                "max_model_len": model.max_model_len}

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_call(request, tokenize_api.tokenize)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_call(request, tokenize_api.detokenize)

    async def _tokenizer_call(self, request: web.Request, handle: Callable[..., dict]) -> web.Response:
        try:
            return _json(await self._frontend.validate(handle, await _read_json(request, self._max_request_bytes)))
        except InvalidRequestError as exc:
            return _error_response(exc)

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": _version()})

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return _json({"status": "draining"}, 503)
        workers = [w for w in await self._directory.list_workers() if self._directory.is_usable(w)]
        num_decode = len(await self._directory.live_decode_workers())
        body = {"status": "ok" if num_decode else "no live decode worker serves this model",
                "decode_workers": num_decode, "prefill_workers": sum(w.role == "prefill" for w in workers)}
        return _json(body, 200 if num_decode else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        metrics = self._frontend.metrics
        metrics.set_workers(await self._directory.list_workers())
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -------------------------------------------------------------------------------------------- generation
    async def _generate(self, request: web.Request, endpoint: str,
                        parse: Callable[..., OpenAIRequest]) -> web.StreamResponse:
        f = self._frontend
        try:
            principal = f.authenticate(request.headers.get("Authorization"))   # checked by _authenticate too
            with f.active.hold(), f.call("http", endpoint, principal) as call:
                if self.draining:
                    raise ShuttingDown("the gateway is shutting down; retry on another one")
                parsed = await f.validate(parse, await _read_json(request, self._max_request_bytes))
                try:
                    await f.compile_structured(parsed.request.sampling.structured_output)
                except InvalidRequestError as exc:
                    raise rename_error(exc, parsed.structured_param) from None
                deadline = _deadline(request, call.arrival)
                if parsed.stream:
                    return await self._stream(request, call, parsed, deadline)
                async with contextlib.aclosing(run_prompts(call, parsed, deadline)) as chunks:
                    collected = [chunk async for chunk in chunks]
                body = ResponseBuilder(parsed, f.tokenizer).response(collected)
                return _json(body)
        except Exception as exc:         # not CancelledError: a client that is gone gets no answer
            return _error_response(exc)

    async def _stream(self, request: web.Request, call: Call, parsed: OpenAIRequest,
                      deadline: float | None) -> web.StreamResponse:
        builder = ResponseBuilder(parsed, self._frontend.tokenizer)
        async with contextlib.aclosing(run_prompts(call, parsed, deadline)) as chunks:
            chunk = await anext(chunks)          # raises before any byte is sent: the error gets its status
            response = web.StreamResponse(headers=_SSE_HEADERS)
            await response.prepare(request)
            try:
                while True:
                    for obj in builder.stream_objects(chunk):
                        await response.write(_event(obj))
                    if chunk.usage is not None:      # the request's last chunk
                        break
                    chunk = await anext(chunks)
                if parsed.include_usage and chunk.usage is not None:
                    await response.write(_event(builder.usage_chunk(chunk.usage)))
            except ConnectionResetError as exc:  # the client left between two writes
                call.error = ClientGone(str(exc))
                return response
            except Exception as exc:
                call.error = exc
                with contextlib.suppress(ConnectionResetError):
                    await response.write(_event(error_of(exc)[1]))
            with contextlib.suppress(ConnectionResetError):
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
        return response

    @web.middleware
    async def _authenticate(self, request: web.Request, handler) -> web.StreamResponse:
        """With API keys, every path but /health needs one (401 otherwise)."""
        if request.path != "/health":
            try:
                self._frontend.authenticate(request.headers.get("Authorization"))
            except Unauthenticated as exc:
                self._frontend.metrics.unauthenticated.labels("http").inc()
                return _error_response(exc)
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Routing errors (unknown path, wrong method) and anything unexpected, in OpenAI's error shape."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = f"{exc.reason}: {request.method} {request.path}"
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return _json(error_object(message, exc.status, code=exc.reason.lower().replace(" ", "_")), exc.status,
                         allow)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("internal error serving %s %s", request.method, request.path, exc_info=exc)
            return _json(error_object(f"internal error: {type(exc).__name__}", 500), 500)
