"""The gateway's servers: pdserve.v1.Generation, grpc.health.v1 and reflection on grpc.aio, and the
OpenAI-compatible HTTP front (gateway.http_front, unless http_port is -1) on the same event loop; graceful drain.
Optional plaintext health-only and /metrics ports (gateway.ops_ports) share its health statuses and metrics.

    serve(config)          blocking; SIGTERM/SIGINT drains: gRPC health NOT_SERVING and HTTP /health 503, new
                           RPCs and connections refused, in-flight requests of both APIs get up to drain_timeout_s
                           to finish (then they are cancelled and their workers aborted)
    start_server(config)   the same servers on a background event loop (one per process, shared by every
                           gateway started so), for tests and embedding -> GatewayHandle

Both APIs share one request path (gateway.frontend: admission, orchestrator, metrics). gRPC status codes are
decided in one place, `status_of` (from request_types.error_code; applied to every Generation RPC by
`ErrorMappingInterceptor`):

    InvalidRequestError          INVALID_ARGUMENT    "field: message"
    unparsable request message   INVALID_ARGUMENT    "GenerateRequest: is not a valid protobuf message (...)"
    Overloaded / OverloadedError RESOURCE_EXHAUSTED  message says when to retry; trailing "retry-after-ms"
    NoWorkerAvailable            UNAVAILABLE         (retryable)
    WorkerFailed                 UNAVAILABLE         (retryable)
    DeadlineExceeded             DEADLINE_EXCEEDED
    client cancel                CANCELLED           (recorded in the metrics only)
    Unauthenticated              UNAUTHENTICATED     no, a malformed or an unknown API key
    KeyLimited                   RESOURCE_EXHAUSTED  a per-key limit; trailing "retry-after-ms" from the key's state
    anything else                INTERNAL            (logged with its traceback)

Security (GatewayConfig): with api_key_file, `AuthInterceptor` refuses every RPC without a known key
(`authorization: Bearer <key>` metadata) UNAUTHENTICATED, except grpc.health.v1; SIGHUP re-reads the file (an
invalid one is logged and the old keys stay). With tls_cert/tls_key the public port and the HTTP API are TLS.
With cluster_ca/cluster_cert/cluster_key every worker connection is mutual TLS and accepts only a server
certificate of the role the worker record claims (gateway.worker_client), so a record written into Redis by
anyone else gets no connection (its calls fail UNAVAILABLE: it is marked down, the request goes elsewhere).

Workers are discovered through the prefix index (gateway.discovery.WorkerDirectory); while Redis is unreachable
the last known worker list is used with no prefix information (routing by load only). grpc.health.v1 ("" and
the Generation service) is SERVING while a usable decode worker is up (WorkerDirectory.watch: within about a
second of the last one failing, and back when one is reachable); "liveness" is SERVING until the drain. Messages larger than max_request_bytes are
refused by grpc (RESOURCE_EXHAUSTED). Each response stream's trailing
metadata names the workers that served it (pdserve-decode-worker, pdserve-prefill-workers,
pdserve-local-prefill).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.errors import InvalidRequestError
from engine.loader import load_model
from engine.model_fetch import resolve_model_path
from engine.fingerprint import quantized_fingerprint
from engine.tokenizer import Tokenizer
from gateway.auth import ApiKeyFileError, ApiKeyStore, Unauthenticated
from gateway.config import GatewayConfig
from gateway.frontend import Frontend
from gateway.generation_pb import chunk_to_pb, validate_chat, validate_generate
from gateway.http_front import HttpFront
from gateway.metrics import GatewayMetrics
from gateway.ops_ports import OpsPorts
from gateway.discovery import WorkerDirectory
from gateway.orchestrator import Orchestrator, OrchestratorLimits
from gateway.request_types import RETRY_AFTER_MS, error_code
from gateway.routing import RoutingPolicy
from gateway.tool_parsers import Content, collect, detect_parser
from gateway.validation import ModelSpec, max_bytes_per_token
from gateway.worker_client import ChannelPool
from kvstore.hashing import root_hash
from kvstore.index import PrefixIndex
from protos.gc_tuning import freeze_startup_heap
from protos.tls import https_ssl_context, public_server_credentials
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

_SERVICE_DESCRIPTOR = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
_SERVICE = _SERVICE_DESCRIPTOR.full_name
LIVENESS_SERVICE = "liveness"
"""grpc.health.v1 service name that is SERVING while the process runs and is not draining, whatever the workers
(a liveness probe must not restart gateways because the decode pool is down)."""


# ------------------------------------------------------------------------------------------------ status mapping
def status_of(exc: Exception) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """(status code, details, extra trailing metadata) for an exception raised while serving a request."""
    code = error_code(exc)
    if code == "RESOURCE_EXHAUSTED":
        retry_ms = getattr(exc, "retry_after_ms", RETRY_AFTER_MS)
        return (grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry after {retry_ms} ms",
                (("retry-after-ms", str(retry_ms)),))
    if code == "INTERNAL":
        log.error("internal error", exc_info=exc)
        return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", ()
    return grpc.StatusCode[code], str(exc), ()


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code, details, metadata = status_of(exc)
    await context.abort(code, details, tuple(context.trailing_metadata() or ()) + metadata)


class _Unparsable:
    """A request message protobuf could not parse (answered INVALID_ARGUMENT naming the message)."""

    def __init__(self, message_name: str, error: Exception) -> None:
        self.message_name = message_name
        self.error = error


def _tolerant(deserializer, message_name: str):
    """`deserializer` returning an _Unparsable instead of raising (grpc would answer INTERNAL)."""
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:
            return _Unparsable(message_name, exc)

    return deserialize


async def _refuse_unparsable(request, context) -> None:
    if isinstance(request, _Unparsable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{request.message_name}: is not a valid protobuf message "
                            f"({type(request.error).__name__}: {request.error})")


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions escaping a Generation handler into their status (`status_of`), and request messages that
    do not parse (bad UTF-8 in a string field, truncated bytes) into INVALID_ARGUMENT naming the message."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(f"/{_SERVICE}/"):
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        message_name = _SERVICE_DESCRIPTOR.methods_by_name[method].input_type.name \
            if method in _SERVICE_DESCRIPTOR.methods_by_name else "request"
        deserializer = _tolerant(handler.request_deserializer, message_name)
        if handler.unary_stream is not None:
            behavior = handler.unary_stream

            async def unary_stream(request, context):
                await _refuse_unparsable(request, context)
                try:
                    async for response in behavior(request, context):
                        yield response
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort(context, exc)

            return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, handler.response_serializer)
        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary_unary(request, context):
                await _refuse_unparsable(request, context)
                try:
                    return await behavior(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort(context, exc)

            return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, handler.response_serializer)
        return handler


def _authorization(metadata) -> str | None:
    return next((value for key, value in metadata or () if key == "authorization"), None)


def _deny(handler, message: str):
    """A handler of `handler`'s kind that answers UNAUTHENTICATED without running it."""
    async def deny_unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as a streaming handler must be

    args = (handler.request_deserializer, handler.response_serializer)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(deny_unary, *args)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny_stream, *args)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(deny_unary, *args)
    return grpc.stream_stream_rpc_method_handler(deny_stream, *args)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """API keys on every RPC but grpc.health.v1 (probes carry no key): UNAUTHENTICATED before the handler runs.
    The Generation servicer authenticates again for the caller's tenant and limits (Frontend.authenticate)."""

    def __init__(self, api_keys: ApiKeyStore, metrics: GatewayMetrics) -> None:
        self._api_keys = api_keys
        self._metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(f"/{health.SERVICE_NAME}/"):
            return handler
        try:
            self._api_keys.authenticate(_authorization(handler_call_details.invocation_metadata))
        except Unauthenticated as exc:
            self._metrics.unauthenticated.labels("grpc").inc()
            return _deny(handler, str(exc))
        return handler


# ------------------------------------------------------------------------------------------------ servicer
class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Thin: validate, run through the shared request path, pack. Errors are mapped by ErrorMappingInterceptor."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def Generate(self, request, context):
        async for response in self._serve("generate", validate_generate, request, context):
            yield response

    async def Chat(self, request, context):
        async for response in self._serve("chat", validate_chat, request, context):
            yield response

    async def _serve(self, endpoint: str, validate, request, context):
        f = self.frontend
        f.active.track(context)
        principal = f.authenticate(_authorization(context.invocation_metadata()))
        with f.call("grpc", endpoint, principal) as call:
            req = await f.validate(validate, request)
            try:
                await f.compile_structured(req.sampling.structured_output)
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"sampling.{exc.field}", str(exc).partition(": ")[2]) from None
            async for response in self._run(call, req, context):
                yield response

    async def ListModels(self, request, context):
        model = self.frontend.model
        return generation_pb2.ListModelsResponse(models=[generation_pb2.ModelInfo(
            name=model.name, max_model_len=model.max_model_len, fingerprint=model.fingerprint)])

    async def _run(self, call, req, context):
        remaining = context.time_remaining()
        deadline = call.arrival + remaining if remaining is not None else None
        try:
            parsers, events = {}, {}                  # per choice (n > 1): its tool call parser and events
            async with contextlib.aclosing(call.generate(req, deadline)) as chunks:
                async for chunk in chunks:
                    if req.tool_parser is None:
                        yield chunk_to_pb(req.request_id, chunk)
                        continue
                    parser = parsers.setdefault(chunk.choice_index, req.tool_parser.new())
                    last = chunk.finish_reason is not None
                    new = parser.feed(chunk.text) + (parser.finish() if last else [])
                    events.setdefault(chunk.choice_index, []).extend(new)
                    text = "".join(e.text for e in new if isinstance(e, Content))
                    yield chunk_to_pb(req.request_id, dataclasses.replace(chunk, text=text),
                                      collect(events[chunk.choice_index])[1] if last else ())
        finally:
            context.set_trailing_metadata(call.trace.metadata())


# ------------------------------------------------------------------------------------------------ server
def load_model_spec(config: GatewayConfig) -> tuple[ModelSpec, Tokenizer]:
    """Read the model's config, tokenizer and fingerprint (no weights)."""
    path = Path(resolve_model_path(config.model, progress=False))
    loaded = load_model(path, with_weights=False, progress=False)
    max_len = loaded.config.max_position_embeddings
    if config.max_model_len is not None:
        max_len = min(max_len, config.max_model_len)
    name = config.served_model_name or path.stem
    spec = ModelSpec(name=name, max_model_len=max_len, vocab_size=loaded.config.vocab_size,
                     fingerprint=quantized_fingerprint(loaded.fingerprint, config.quantization),
                     aliases=frozenset({config.model, str(path)}),
                     max_bytes_per_token=max_bytes_per_token(loaded.tokenizer),
                     tool_call_parser=config.tool_call_parser if config.tool_call_parser != "auto" else
                     detect_parser(loaded.tokenizer.chat_template))
    return spec, loaded.tokenizer


@dataclass
class _Parts:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    frontend: Frontend
    orchestrator: Orchestrator
    directory: WorkerDirectory
    port: int
    http: HttpFront | None
    http_port: int | None
    health_watch: asyncio.Task | None = None
    ops: OpsPorts | None = None


def load_api_keys(config: GatewayConfig) -> ApiKeyStore | None:
    """The key store of config.api_key_file (ApiKeyFileError names the file and line), or None without one."""
    if config.api_key_file is None:
        return None
    store = ApiKeyStore.from_file(config.api_key_file)
    log.info("API keys: %d from %s", store.num_keys, config.api_key_file)
    return store


def reload_api_keys(api_keys: ApiKeyStore | None) -> None:
    """SIGHUP: re-read the key file; an invalid or unreadable one is logged and the current keys stay."""
    if api_keys is None:
        log.warning("SIGHUP: no --api-key-file to reload")
        return
    try:
        num_keys = api_keys.reload()
    except ApiKeyFileError as exc:
        log.error("API keys not reloaded, keeping the %d current ones: %s", api_keys.num_keys, exc)
        return
    log.info("API keys reloaded: %d from %s", num_keys, api_keys.path)


def _log_security(config: GatewayConfig, api_keys: ApiKeyStore | None) -> None:
    if config.cluster_tls is None:
        log.warning("PLAINTEXT toward the workers (%s): no authentication, anyone who can write worker records "
                    "into Redis may receive prompts; give --cluster-ca/--cluster-cert/--cluster-key",
                    "--insecure-internal" if config.insecure_internal else "no cluster certificate")
    if api_keys is None:
        log.warning("no API keys: every caller that reaches %s may use the gateway", config.host)
    if config.tls_cert is None:
        log.warning("public gRPC and HTTP ports are plaintext (no --tls-cert/--tls-key)")


async def _start(config: GatewayConfig, model: ModelSpec, tokenizer: Tokenizer) -> _Parts:
    api_keys = load_api_keys(config)
    _log_security(config, api_keys)
    policy = RoutingPolicy(block_size=config.block_size, fingerprint=model.fingerprint,
                           local_prefill_threshold=config.local_prefill_threshold,
                           idle_offload_min_tokens=config.idle_offload_min_tokens,
                           max_prefill_load=config.max_prefill_load, mode=config.routing)
    channels = ChannelPool(config.cluster_tls)
    directory = WorkerDirectory(PrefixIndex(config.redis_url), policy, channels)
    limits = OrchestratorLimits(lease_ms=config.lease_ms, prefill_attempts=config.prefill_attempts,
                                max_inflight=config.max_inflight, max_queued=config.max_queued,
                                queue_timeout_s=config.queue_timeout_s, token_timeout_s=config.token_timeout_s)
    orchestrator = Orchestrator(policy, root_hash(model.fingerprint), tokenizer, directory.match, channels, limits,
                                on_unreachable=directory.report_unreachable, down=directory.down_endpoints)
    metrics = GatewayMetrics()
    metrics.track_queue(lambda: orchestrator.num_queued)
    frontend = Frontend(model, tokenizer, orchestrator, metrics, api_keys)
    interceptors = ([AuthInterceptor(api_keys, metrics)] if api_keys is not None else []) + \
        [ErrorMappingInterceptor()]
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.max_receive_message_length", config.max_request_bytes)])
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(frontend), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    http = HttpFront(frontend, directory, config.max_request_bytes) if config.http_port >= 0 else None
    ops = OpsPorts()
    try:
        address = f"{config.host}:{config.port}"
        port = server.add_secure_port(address, public_server_credentials(config.tls_cert, config.tls_key)) \
            if config.tls_cert is not None else server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind {config.host}:{config.port}")
        await server.start()
        await ops.start(config.host, config.health_port, health_servicer, config.metrics_port,
                        lambda: _render_metrics(metrics, directory))
        ssl_context = https_ssl_context(config.tls_cert, config.tls_key) if config.tls_cert is not None else None
        http_port = await http.start(config.host, config.http_port, ssl_context) if http is not None else None
    except BaseException:
        await ops.close()
        await server.stop(0)
        await orchestrator.close()
        directory.close()
        raise
    async def set_health(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", _SERVICE):
            await health_servicer.set(name, status)

    await health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    await directory.refresh()
    await set_health(directory.serving)
    health_watch = asyncio.get_running_loop().create_task(directory.watch(set_health))
    scheme = "TLS" if config.tls_cert is not None else "plaintext"
    log.info("gateway serving %s on %s:%d (gRPC, %s)%s (max_model_len %d)", model.name, config.host, port, scheme,
             f" and {config.host}:{http_port} (OpenAI HTTP, {scheme})" if http is not None else "",
             model.max_model_len)
    return _Parts(server, health_servicer, frontend, orchestrator, directory, port, http, http_port, health_watch,
                  ops)


async def _render_metrics(metrics: GatewayMetrics, directory: WorkerDirectory) -> bytes:
    metrics.set_workers(await directory.list_workers())
    return metrics.exposition()


async def _drain(parts: _Parts, grace_s: float) -> None:
    """NOT_SERVING, refuse new RPCs and HTTP connections, let in-flight requests of both APIs finish for up to
    grace_s, then cancel what is left (health watches, overdue requests: their workers are aborted) and release
    everything."""
    if parts.health_watch is not None:
        parts.health_watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await parts.health_watch
    await parts.health.enter_graceful_shutdown()
    if parts.http is not None:
        await parts.http.stop_accepting()
    # The server's one shutdown: it refuses new RPCs from now on and cancels what is still open after grace_s.
    # Never a second, concurrent stop(): grpc.aio's shutdown is not safe against itself (a second call can
    # cancel calls on a core server the first one has just destroyed: a segfault in Server.stop).
    stopping = asyncio.create_task(parts.server.stop(grace_s))
    if not await parts.frontend.active.wait_idle(grace_s):
        log.warning("drain: %d requests still running after %.1fs; cancelling them",
                    len(parts.orchestrator.running_ids), grace_s)
    await stopping
    if parts.http is not None:
        await parts.http.close()
    await parts.orchestrator.close()
    parts.directory.close()
    parts.frontend.close()
    if parts.ops is not None:
        await parts.ops.close()


def serve(config: GatewayConfig) -> None:
    """Run the gateway until SIGTERM or SIGINT, then drain (see module doc)."""
    model, tokenizer = load_model_spec(config)
    freeze_startup_heap()  # before it is reachable: the freeze's collection delays no request

    async def main() -> None:
        parts = await _start(config, model, tokenizer)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, reload_api_keys, parts.frontend.api_keys)
        await stop.wait()
        log.info("draining: %d requests in flight, up to %.1fs", len(parts.orchestrator.running_ids),
                 config.drain_timeout_s)
        await _drain(parts, config.drain_timeout_s)

    asyncio.run(main())


class GatewayHandle:
    """A gateway running on the process's background gateway loop (`start_server`)."""

    def __init__(self, parts: _Parts, loop: asyncio.AbstractEventLoop, drain_timeout_s: float) -> None:
        self._parts = parts
        self._loop = loop
        self._stopped = False
        self._stop_lock = threading.Lock()
        self._drain_timeout_s = drain_timeout_s
        self.port = parts.port
        self.http_port = parts.http_port
        """Port of the OpenAI-compatible HTTP API; None when it is off."""
        self.health_port = parts.ops.health_port if parts.ops is not None else None
        self.metrics_port = parts.ops.metrics_port if parts.ops is not None else None

    @property
    def num_inflight(self) -> int:
        """Requests admitted and not finished."""
        return len(self._parts.orchestrator.running_ids)

    def reload_api_keys(self) -> None:
        """What SIGHUP does in `serve`: re-read the API key file (keeping the old keys when it is invalid)."""
        reload_api_keys(self._parts.frontend.api_keys)

    def get_inflight(self, worker_id: str) -> int:
        """This gateway's requests on a worker right now (see Orchestrator.get_inflight)."""
        return self._parts.orchestrator.get_inflight(worker_id)

    def stop(self, grace_s: float | None = None) -> None:
        """Drain (as on SIGTERM) for up to grace_s (default: drain_timeout_s) and release everything. Idempotent."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        grace = self._drain_timeout_s if grace_s is None else grace_s
        asyncio.run_coroutine_threadsafe(_drain(self._parts, grace), self._loop).result()


def start_server(config: GatewayConfig, model: tuple[ModelSpec, Tokenizer] | None = None) -> GatewayHandle:
    """Start the gateway on a background thread; returns once it is bound (`handle.port`).

    `model` skips reading the checkpoint again when the caller already has (ModelSpec, Tokenizer)."""
    model_spec, tokenizer = model or load_model_spec(config)
    loop = background_loop()
    parts = asyncio.run_coroutine_threadsafe(_start(config, model_spec, tokenizer), loop).result()
    return GatewayHandle(parts, loop, config.drain_timeout_s)


_background_lock = threading.Lock()
_background: asyncio.AbstractEventLoop | None = None


def background_loop() -> asyncio.AbstractEventLoop:
    """The one event loop, on a daemon thread started on first use, that every `start_server` gateway of this
    process runs on. grpc.aio binds each server and channel to the loop that made it and is meant for one loop
    per process: aio objects on several loops (gateways on their own loops, clients in `asyncio.run`) have
    crashed grpc's core at shutdown (a segfault in Server.stop). grpc.aio clients that share a process with
    such gateways run their coroutines here too (`asyncio.run_coroutine_threadsafe(coro, background_loop())`)."""
    global _background
    with _background_lock:
        if _background is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="gateway-loop", daemon=True).start()
            _background = loop
        return _background
