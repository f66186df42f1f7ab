"""Decode worker process: engine loop + DecodeWorker and KvTransfer services on one gRPC port + registration.

`serve(config, engine_config)` runs until SIGTERM/SIGINT, then drains (WorkerHandle.stop): NOT_SERVING,
Reserve refused with UNAVAILABLE and the prefix index left at once, running streams get drain_timeout_s to
finish, what is left ends with UNAVAILABLE (the gateway retries elsewhere or tells its client so). Optional
ports: health only (--health-port), Prometheus metrics (--metrics-port, protos.worker_metrics).
`start_server` returns a running handle for tests and embedding.
"""

from __future__ import annotations

import logging

from decode_worker.config import DecodeWorkerConfig
from decode_worker.service import DecodeWorkerServicer
from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop, build_engine
from engine.llm_engine import LLMEngine
from kvstore.transfer_service import KvTransferServicer, add_kv_transfer_servicer
from protos.pdserve.v1 import kv_transfer_pb2, worker_pb2, worker_pb2_grpc
from protos.gc_tuning import freeze_startup_heap
from protos.service_runtime import (Registration, WorkerHandle, WorkerServer, log_internal_security,
                                    share_cpus, wait_for_termination)
from protos.worker_metrics import WorkerMetrics, model_name, serve_metrics

log = logging.getLogger(__name__)


def start_server(config: DecodeWorkerConfig, engine_config: EngineConfig,
                 engine: LLMEngine | None = None) -> WorkerHandle:
    engine = engine or build_engine(engine_config, progress=False)
    loop = EngineLoop(engine)
    log_internal_security(log, "decode worker", config.tls_files, config.insecure_internal)
    worker = DecodeWorker(loop, config.max_lease_ms, trust_plaintext_kv=config.insecure_internal,
                          verify_kv=config.verify_kv,
                          max_reserved_fraction_per_caller=config.max_reserved_fraction_per_caller)
    server = WorkerServer(config.host, config.port, tls=config.tls_files, health_port=config.health_port)
    metrics = WorkerMetrics(engine, model_name(engine_config.model), "decode")
    metrics.attach(loop)
    server.gate.observers.append(metrics.on_rpc_end)
    endpoint = f"{config.advertise_host or config.host}:{server.port}"
    registration = Registration(config.redis_url, config.worker_id, "decode", endpoint, engine, config.worker_ttl_s)
    loop.add_housekeeping(registration.on_housekeeping)
    epoch = (lambda: registration.publisher.epoch or 0) if registration.publisher else (lambda: 0)
    server.add(worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
               DecodeWorkerServicer(worker, config.worker_id, endpoint, epoch),
               worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name, refused_when_draining=["Reserve"])
    kv_transfer = KvTransferServicer(metrics.metered_receiver(worker))
    # unmap pooled segments a prefill worker has let go of, even when no shm transfer comes to do it
    loop.add_housekeeping(lambda _engine: kv_transfer.segments.prune())
    server.add(add_kv_transfer_servicer, kv_transfer,
               kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"].full_name)
    closers = share_cpus(loop, metrics, config, log)
    loop.start()
    server.start()
    registration.start()
    metrics_server = serve_metrics(metrics.registry, config.host, config.metrics_port)
    log.info("decode worker %s serving on %s", config.worker_id, endpoint)
    return WorkerHandle(server, loop, worker, registration, metrics_server, closers=closers)


def serve(config: DecodeWorkerConfig, engine_config: EngineConfig) -> None:
    engine = build_engine(engine_config, progress=False)
    freeze_startup_heap()  # before it is reachable: the freeze's collection delays no request
    handle = start_server(config, engine_config, engine)
    wait_for_termination(lambda: handle.stop(grace_s=config.drain_timeout_s))
