"""gRPC plumbing every pdserve service process shares: the server (health, reflection, message limits,
graceful stop), the one mapping of engine errors to status codes, the worker's registration in the prefix
index fed from its engine loop, and waiting for SIGTERM.

Status mapping (`status_on_error`): InvalidRequestError -> INVALID_ARGUMENT, OverloadedError ->
RESOURCE_EXHAUSTED, PreconditionError -> FAILED_PRECONDITION, LoopStopped -> UNAVAILABLE, RequestAborted ->
CANCELLED, RequestFailedError (one request failed inside the engine) -> INTERNAL, anything else -> INTERNAL
naming the exception type.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.engine_loop import EngineLoop, LoopStopped
from engine.errors import (InvalidRequestError, OverloadedError, PreconditionError, RequestAborted,
                           RequestFailedError)
from engine.llm_engine import LLMEngine
from kvstore.index import PrefixIndex, WorkerInfo
from kvstore.index_publisher import IndexPublisher
from kvstore.shm import host_id
from kvstore.transfer_service import GRPC_OPTIONS


_STATUS = [(InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT), (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
           (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION), (LoopStopped, grpc.StatusCode.UNAVAILABLE),
           (RequestAborted, grpc.StatusCode.CANCELLED), (RequestFailedError, grpc.StatusCode.INTERNAL)]


@contextlib.contextmanager
def status_on_error(context: grpc.ServicerContext) -> Iterator[None]:
    """The one mapping of worker exceptions to gRPC status codes; anything else is INTERNAL."""
    try:
        yield
    except Exception as exc:
        for exc_type, code in _STATUS:
            if isinstance(exc, exc_type):
                context.abort(code, str(exc))
        context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def _single_threaded_torch() -> None:
    """Run this thread's torch ops on one CPU thread. For threads beside the engine loop (gRPC handlers that
    scatter received KV, the transfer producer that gathers it): their copies are memory-bound, and an OpenMP
    team of their own would compete with the loop thread for its cores and, once it exists, leave more OpenMP
    threads than CPUs, which slows every matmul of the loop (engine.engine_loop's module docstring)."""
    torch.set_num_threads(1)


class WorkerServer:
    """A grpc.server with the health and reflection services, bound to host:port (0 picks a free port)."""

    def __init__(self, host: str, port: int, max_workers: int = 64) -> None:
        # No SO_REUSEPORT: a port already in use must fail the start, not be shared with another server.
        executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc",
                                              initializer=_single_threaded_torch)
        self.server = grpc.server(executor, options=[*GRPC_OPTIONS, ("grpc.so_reuseport", 0)])
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")

    def add(self, add_fn: Callable, servicer, service_name: str) -> None:
        """Register `servicer` with its generated `add_*_to_server` function under its full service name."""
        add_fn(servicer, self.server)
        self._service_names.append(service_name)

    def start(self) -> None:
        reflection.enable_server_reflection(self._service_names, self.server)
        self.server.start()
        self.set_serving(True)

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._service_names]:
            self.health.set(name, status)

    def stop(self, grace_s: float) -> None:
        """NOT_SERVING first (balancers stop sending), then let in-flight RPCs finish for up to grace_s."""
        self.set_serving(False)
        self.server.stop(grace_s).wait()


def wait_for_termination(on_stop: Callable[[], None]) -> None:
    """Block until SIGTERM or SIGINT, then run `on_stop` (main thread only)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
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

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self, grace_s: float = 5.0) -> None:
        """Leave the index, finish in-flight RPCs for up to grace_s, then stop the engine loop."""
        self.registration.stop()
        self.server.stop(grace_s)
        self.loop.stop()
