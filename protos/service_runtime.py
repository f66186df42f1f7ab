"""gRPC plumbing every pdserve service process shares: the server (health, reflection, message limits,
graceful stop), the one mapping of engine errors to status codes, the worker's registration in the prefix
index fed from its engine loop, and waiting for SIGTERM.

Status mapping (`status_on_error`): InvalidRequestError -> INVALID_ARGUMENT, OverloadedError ->
RESOURCE_EXHAUSTED (with a trailing "retry-after-ms" when it carries a hint), PreconditionError ->
FAILED_PRECONDITION, LoopStopped -> UNAVAILABLE, RequestAborted -> CANCELLED, RequestFailedError (one request
failed inside the engine) -> INTERNAL, PermissionDeniedError -> PERMISSION_DENIED, anything else -> INTERNAL naming the exception type.

Internal security: a WorkerServer given the worker's TlsFiles serves mutual TLS and enforces the cluster role
table (protos.tls); `caller_of` names the caller per-caller limits count against.

Operations and scale-down: `health_port` adds a plaintext HealthOnlyServer (grpc.health.v1 alone, the main
server's HealthServicer, so the same statuses) for probes. Every RPC passes an RpcGate: it reports each RPC's
end to observers (protos.worker_metrics) and, once draining, answers the methods that take new work
(Reserve, Prefill) UNAVAILABLE. WorkerHandle.stop is the drain: NOT_SERVING and the gate closed, deregister,
wait (up to the drain timeout) until the engine holds no request, stop the loop (what is left gets LoopStopped:
UNAVAILABLE), stop the servers.

CPU lending (`share_cpus`): a pinned worker holds a busy lock while its engine has work and may step on its
partner's CPUs while the partner's lock is free (engine.cpu_share; `pdserve up --pin-workers --lend-idle-cpus`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.cpu_share import CpuShare
from engine.engine_loop import EngineLoop, LoopStopped, set_thread_torch_threads
from engine.errors import (InvalidRequestError, OverloadedError, PermissionDeniedError, PreconditionError,
                           RequestAborted, RequestFailedError)
from engine.llm_engine import LLMEngine
from kvstore.index import PrefixIndex, WorkerInfo
from kvstore.index_publisher import IndexPublisher
from kvstore.shm import host_id
from kvstore.transfer_service import GRPC_OPTIONS
from protos.tls import RoleInterceptor, TlsFiles, cluster_role_table, peer_identity, reloading_server_credentials
from protos.worker_metrics import MetricsServer


_log = logging.getLogger(__name__)

_STATUS = [(InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT), (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
           (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION), (LoopStopped, grpc.StatusCode.UNAVAILABLE),
           (RequestAborted, grpc.StatusCode.CANCELLED), (RequestFailedError, grpc.StatusCode.INTERNAL),
           (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED)]


@contextlib.contextmanager
def status_on_error(context: grpc.ServicerContext) -> Iterator[None]:
    """The one mapping of worker exceptions to gRPC status codes; anything else is INTERNAL."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, OverloadedError) and exc.retry_after_ms is not None:
            context.set_trailing_metadata((("retry-after-ms", str(exc.retry_after_ms)),))
        for exc_type, code in _STATUS:
            if isinstance(exc, exc_type):
                context.abort(code, str(exc))
        context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def caller_of(context: grpc.ServicerContext) -> str:
    """Who is calling, for per-caller limits: the peer certificate's identity name over mutual TLS, else the
    peer's address without its port (every connection from one host counts as one caller)."""
    identity = peer_identity(context.auth_context())
    if identity is not None:
        return identity.name
    kind, _, address = context.peer().partition(":")  # "ipv4:127.0.0.1:5678", "ipv6:[::1]:5678", "unix:/path"
    if kind in ("ipv4", "ipv6"):
        address = address.rpartition(":")[0]
    return f"{kind}:{address}"


def _single_threaded_torch() -> None:
    """Run this thread's torch ops on one CPU thread. For threads beside the engine loop (gRPC handlers that
    scatter received KV, the transfer producer that gathers it): their copies are memory-bound, and an OpenMP
    team of their own would compete with the loop thread for its cores and, once it exists, leave more OpenMP
    threads than CPUs, which slows every matmul of the loop (engine.engine_loop's module docstring)."""
    set_thread_torch_threads(1)


def _refuse_draining(request, context) -> None:
    context.abort(grpc.StatusCode.UNAVAILABLE, "this worker is draining; use another one")


class RpcGate(grpc.ServerInterceptor):
    """Every RPC of a worker's main server passes here. Once `close()`d (the worker drains), the methods
    registered as refused (Reserve, Prefill) answer UNAVAILABLE at once, so the gateway picks another worker;
    everything else (Decode and Push of work already taken, Abort, Stats) goes on. Observers get each RPC's
    end: `observer(method, code, response or None)` (full method name; streaming responses are not passed)."""

    def __init__(self) -> None:
        self.refused: set[str] = set()
        self.observers: list[Callable[[str, grpc.StatusCode, object], None]] = []
        self._closed = threading.Event()

    def close(self) -> None:
        self._closed.set()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith("/grpc."):     # health and reflection
            return handler
        if self._closed.is_set() and method in self.refused:
            kind = "unary_unary" if handler.unary_unary is not None else "stream_unary"
            handler = handler._replace(**{kind: _refuse_draining})
        return self._observed(handler, method)

    def _report(self, method: str, code: grpc.StatusCode, response) -> None:
        for observer in self.observers:
            try:
                observer(method, code, response)
            except Exception:                # an observer never fails the RPC it watches
                _log.exception("RPC observer %r failed", observer)

    def _observed(self, handler, method: str):
        if not self.observers:
            return handler
        for kind in ("unary_unary", "stream_unary"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                def unary(request, context, behavior=behavior):
                    try:
                        response = behavior(request, context)
                    except BaseException:
                        self._report(method, context.code() or grpc.StatusCode.UNKNOWN, None)
                        raise
                    self._report(method, context.code() or grpc.StatusCode.OK, response)
                    return response
                return handler._replace(**{kind: unary})
        for kind in ("unary_stream", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                def streaming(request, context, behavior=behavior):
                    code = grpc.StatusCode.OK
                    try:
                        yield from behavior(request, context)
                    except GeneratorExit:            # the client went away (cancel, deadline)
                        code = grpc.StatusCode.CANCELLED
                        raise
                    except BaseException:
                        code = context.code() or grpc.StatusCode.UNKNOWN
                        raise
                    finally:
                        self._report(method, context.code() or code, None)
                return handler._replace(**{kind: streaming})
        return handler


class HealthOnlyServer:
    """Plaintext grpc.health.v1 and nothing else on host:port (0 picks a free port), answering from the main
    server's HealthServicer, so both report the same status (overall and per service). For the kubelet's
    native gRPC probes and compose healthchecks while the main port requires mutual TLS."""

    def __init__(self, servicer: health.HealthServicer, host: str, port: int, max_workers: int = 8) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="health"),
                                  options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")

    def start(self) -> None:
        self.server.start()

    def stop(self, grace_s: float = 1.0) -> None:
        self.server.stop(grace_s).wait()


class WorkerServer:
    """A grpc.server with the health and reflection services, bound to host:port (0 picks a free port).

    With `tls` (the worker's cluster certificate, key and CA) the port is mutual TLS
    (protos.tls.reloading_server_credentials: rotated files are picked up at the next handshake) and every RPC
    passes protos.tls.RoleInterceptor with the cluster role table (DESIGN section 10). Without, it is
    plaintext: any caller that reaches the port may call anything.

    `health_port` (None: none) adds a HealthOnlyServer on the same host. Every RPC passes `gate` (RpcGate):
    `start_draining` closes it and turns health NOT_SERVING."""

    def __init__(self, host: str, port: int, max_workers: int = 64, tls: TlsFiles | None = None,
                 health_port: int | None = None) -> None:
        # No SO_REUSEPORT: a port already in use must fail the start, not be shared with another server.
        executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc",
                                              initializer=_single_threaded_torch)
        interceptors = [RoleInterceptor(cluster_role_table())] if tls is not None else []
        self.gate = RpcGate()
        interceptors.append(self.gate)
        self.server = grpc.server(executor, options=[*GRPC_OPTIONS, ("grpc.so_reuseport", 0)],
                                  interceptors=interceptors)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self.tls = tls
        if tls is not None:
            self.port = self.server.add_secure_port(f"{host}:{port}", reloading_server_credentials(tls))
        else:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self.health_server = HealthOnlyServer(self.health, host, health_port) if health_port is not None else None

    @property
    def health_port(self) -> int | None:
        return self.health_server.port if self.health_server is not None else None

    def add(self, add_fn: Callable, servicer, service_name: str, refused_when_draining: Iterable[str] = ()) -> None:
        """Register `servicer` with its generated `add_*_to_server` function under its full service name;
        `refused_when_draining`: its methods that take new work (answered UNAVAILABLE once draining)."""
        add_fn(servicer, self.server)
        self._service_names.append(service_name)
        self.gate.refused.update(f"/{service_name}/{method}" for method in refused_when_draining)

    def start(self) -> None:
        reflection.enable_server_reflection(self._service_names, self.server)
        self.server.start()
        if self.health_server is not None:
            self.health_server.start()
        self.set_serving(True)

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._service_names]:
            self.health.set(name, status)

    def start_draining(self) -> None:
        """NOT_SERVING (probes and balancers stop sending) and new work refused; running work goes on."""
        self.set_serving(False)
        self.gate.close()

    def stop(self, grace_s: float) -> None:
        """NOT_SERVING first (balancers stop sending), then let in-flight RPCs finish for up to grace_s; the
        health-only port goes last."""
        self.set_serving(False)
        self.server.stop(grace_s).wait()
        if self.health_server is not None:
            self.health_server.stop()


def log_internal_security(log: logging.Logger, what: str, tls: TlsFiles | None, insecure_internal: bool) -> None:
    """Say at start how the cluster-internal port is protected; plaintext is loud."""
    if tls is not None:
        log.info("%s: mutual TLS inside the cluster (CA %s, certificate %s)", what, tls.ca_path, tls.cert_path)
    elif insecure_internal:
        log.warning("%s: INSECURE INTERNAL (--insecure-internal): plaintext gRPC without authentication; anyone "
                    "who reaches this port may call every internal RPC, and KV anyone pushes is cached", what)
    else:
        log.warning("%s: no cluster certificate configured: plaintext gRPC without authentication; received KV "
                    "is kept out of the prefix cache (--insecure-internal trusts it)", what)


SIGNAL_POLL_S = 0.2
"""How often the main thread wakes to run signal handlers (wait_for_termination)."""


def share_cpus(loop: EngineLoop, metrics, config, log: logging.Logger) -> tuple[Callable[[], None], ...]:
    """Lend this worker's CPUs while its engine is idle (`config.busy_lock`) and step on its partner's while that
    one is idle (`config.borrow_cpus`, `config.borrow_lock`): engine.cpu_share on `loop`'s activity hook, the
    borrowed steps counted by `metrics` (protos.worker_metrics). Returns the closers for WorkerHandle."""
    if not config.busy_lock and not config.borrow_cpus:
        return ()
    share = CpuShare(config.busy_lock, sorted(os.sched_getaffinity(0)), config.borrow_cpus, config.borrow_lock)
    loop.set_activity_hook(share.activity)
    if share.steps is not None:
        metrics.count_steps_by_cpus(share.steps)
        log.info("stepping on CPUs %s too while the worker holding %s is idle",
                 ",".join(map(str, config.borrow_cpus)), config.borrow_lock)
    return (share.close,)


def wait_for_termination(on_stop: Callable[[], None]) -> None:
    """Block until SIGTERM or SIGINT, then run `on_stop` (main thread only)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Never an untimed wait: the kernel may deliver the signal to any thread (engine, gRPC, torch), and CPython
    # runs the handler only when the main thread next executes bytecode; a main thread asleep in an untimed
    # wait would never do so and the worker would ignore SIGTERM, heartbeating on.
    while not stop.wait(SIGNAL_POLL_S):
        pass
    on_stop()


class Registration:
    """Keeps a worker's record and cached blocks in the prefix index, fed from the engine loop.

    `on_housekeeping(engine)` runs on the engine loop thread: it drains the pool's KV events (always, so they
    never pile up) and hands them, with the load, to an IndexPublisher thread that talks to Redis. Without a
    redis_url the worker runs unregistered and the events are dropped.
    """

    def __init__(self, redis_url: str | None, worker_id: str, role: str, endpoint: str, engine: LLMEngine,
                 ttl_s: float) -> None:
        stats = engine.stats()
        self.worker = WorkerInfo(worker_id, role, grpc_endpoint=endpoint, host_id=host_id(),
                                 block_size=engine.config.block_size, fingerprint=engine.fingerprint,
                                 max_model_len=engine.max_model_len, capacity_blocks=stats.num_blocks,
                                 free_blocks=stats.free_blocks)
        self.publisher = None
        if redis_url:
            self.publisher = IndexPublisher(PrefixIndex(redis_url, worker_ttl_s=ttl_s), self.worker,
                                            initial_hashes=engine.kv.pool.get_cached_hashes())

    def start(self) -> None:
        if self.publisher is not None:
            self.publisher.start()

    def on_housekeeping(self, engine: LLMEngine) -> None:
        events = engine.kv.pool.take_events()
        if self.publisher is not None:
            if events:
                self.publisher.submit(events)
            stats = engine.stats()
            self.publisher.set_load(stats.free_blocks, stats.running, stats.waiting)

    def stop(self) -> None:
        """Leave the index (deregister) so the gateway stops routing here."""
        if self.publisher is not None:
            self.publisher.stop(deregister=True)


@dataclass
class WorkerHandle:
    """A running worker: its gRPC server, engine loop, role object (PrefillWorker / DecodeWorker) and registration."""

    server: WorkerServer
    loop: EngineLoop
    worker: object
    registration: Registration
    metrics_server: MetricsServer | None = None
    closers: tuple[Callable[[], None], ...] = ()
    """Run last in stop(), once nothing can use what they close (e.g. the prefill worker's shm segments)."""

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server is not None else None

    def stop(self, grace_s: float = 5.0) -> None:
        """Drain, then stop (SIGTERM, scale-down): NOT_SERVING and new work (Reserve, Prefill) refused with
        UNAVAILABLE at once, then leave the index; requests already taken get up to grace_s to finish (Decode
        and Push of reservations made before still come in); then the engine loop stops, which ends what is
        left with UNAVAILABLE (LoopStopped: retryable, the gateway says so to its client), and the servers go."""
        self.server.start_draining()
        self.registration.stop()
        self._wait_idle(grace_s)
        self.loop.stop()
        self.server.stop(STREAM_END_GRACE_S)
        if self.metrics_server is not None:
            self.metrics_server.close()
        for close in self.closers:
            close()

    def _wait_idle(self, timeout_s: float) -> None:
        """Until the engine holds no request (running, waiting, reserved or held), for up to timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                s = self.loop.call(LLMEngine.stats, timeout=max(deadline - time.monotonic(), 0.01))
            except Exception:     # the loop is gone or too busy to answer in time: nothing to wait for
                return
            if not (s.running or s.waiting or s.reserved or s.held) or time.monotonic() >= deadline:
                return
            time.sleep(DRAIN_POLL_S)


STREAM_END_GRACE_S = 2.0
"""After the drain: how long RPCs ended by the stopping loop get to send their status."""
DRAIN_POLL_S = 0.1
