"""Prefill worker process: engine loop + PrefillWorker service on one gRPC port + registration.

`serve(config, engine_config)` runs until SIGTERM/SIGINT, then drains (WorkerHandle.stop): NOT_SERVING, new
Prefill calls refused with UNAVAILABLE and the index left at once (the gateway stops routing here), in-flight
prefills get drain_timeout_s to finish, then it stops. Optional ports: health only (--health-port),
Prometheus metrics (--metrics-port, protos.worker_metrics). `start_server` returns a running handle for tests
and embedding.
"""

from __future__ import annotations

import logging
import os

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop, build_engine
from engine.llm_engine import LLMEngine
from kvstore.shm import remove_orphaned_segments
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.destinations import DecodeDestinations
from prefill_worker.service import PrefillWorkerServicer
from prefill_worker.worker import PrefillWorker
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from protos.gc_tuning import freeze_startup_heap
from protos.service_runtime import (Registration, WorkerHandle, WorkerServer, log_internal_security,
                                    share_cpus, wait_for_termination)
from protos.worker_metrics import WorkerMetrics, model_name, serve_metrics

log = logging.getLogger(__name__)


def build_prefill_engine(config: PrefillWorkerConfig, engine_config: EngineConfig) -> LLMEngine:
    """The prefill worker's engine, once the shared-memory segments of dead senders are gone: a KV cache the decode
    worker copies from in place, when the KV may go over shm (kvstore.shm_cache), and the digests of the blocks
    taken as prefill writes them (engine.kv_digests), which every push sends."""
    orphans = remove_orphaned_segments()
    if orphans:
        log.warning("removed %d shared-memory segment(s) left by dead senders: %s", len(orphans), ", ".join(orphans))
    return build_engine(engine_config, progress=False, kv_cache_in_shm=config.transport != "grpc", kv_digests=True)


def start_server(config: PrefillWorkerConfig, engine_config: EngineConfig,
                 engine: LLMEngine | None = None) -> WorkerHandle:
    engine = engine or build_prefill_engine(config, engine_config)
    loop = EngineLoop(engine)
    log_internal_security(log, "prefill worker", config.tls_files, config.insecure_internal)
    server = WorkerServer(config.host, config.port, tls=config.tls_files, health_port=config.health_port)
    metrics = WorkerMetrics(engine, model_name(engine_config.model), "prefill")
    metrics.attach(loop)
    server.gate.observers.append(metrics.on_rpc_end)
    endpoint = f"{config.advertise_host or config.host}:{server.port}"
    registration = Registration(config.redis_url, config.worker_id, "prefill", endpoint, engine, config.worker_ttl_s)
    loop.add_housekeeping(registration.on_housekeeping)
    worker = PrefillWorker(loop, config, DecodeDestinations.for_config(config))
    epoch = (lambda: registration.publisher.epoch or 0) if registration.publisher else (lambda: 0)
    server.add(worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
               PrefillWorkerServicer(worker, config.worker_id, epoch),
               worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name, refused_when_draining=["Prefill"])
    closers = (worker.close, *share_cpus(loop, metrics, config, log))
    loop.start()
    server.start()
    registration.start()
    metrics_server = serve_metrics(metrics.registry, config.host, config.metrics_port)
    log.info("prefill worker %s serving on %s", config.worker_id, endpoint)
    return WorkerHandle(server, loop, worker, registration, metrics_server, closers=closers)


def serve(config: PrefillWorkerConfig, engine_config: EngineConfig) -> None:
    engine = build_prefill_engine(config, engine_config)
    freeze_startup_heap()  # before it is reachable: the freeze's collection delays no request
    handle = start_server(config, engine_config, engine)
    wait_for_termination(lambda: handle.stop(grace_s=config.drain_timeout_s))
