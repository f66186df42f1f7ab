"""Prefill worker process: engine loop + PrefillWorker service on one gRPC port + registration.

`serve(config, engine_config)` runs until SIGTERM/SIGINT (NOT_SERVING, leave the index, finish in-flight
prefills, stop). `start_server` returns a running handle for tests and embedding.
"""

from __future__ import annotations

import logging

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop, build_engine
from engine.llm_engine import LLMEngine
from kvstore.shm import remove_orphaned_segments
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.service import PrefillWorkerServicer
from prefill_worker.worker import PrefillWorker
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from protos.service_runtime import Registration, WorkerHandle, WorkerServer, wait_for_termination

log = logging.getLogger(__name__)

STOP_GRACE_S = 15.0
"""On SIGTERM, how long in-flight requests may take to finish (below `pdserve up`'s 20 s stop timeout)."""


def start_server(config: PrefillWorkerConfig, engine_config: EngineConfig,
                 engine: LLMEngine | None = None) -> WorkerHandle:
    orphans = remove_orphaned_segments()
    if orphans:
        log.warning("removed %d shared-memory segment(s) left by dead senders: %s", len(orphans), ", ".join(orphans))
    engine = engine or build_engine(engine_config, progress=False)
    loop = EngineLoop(engine)
    worker = PrefillWorker(loop, config)
    server = WorkerServer(config.host, config.port)
    endpoint = f"{config.advertise_host or config.host}:{server.port}"
    registration = Registration(config.redis_url, config.worker_id, "prefill", endpoint, engine, config.worker_ttl_s)
    loop.add_housekeeping(registration.on_housekeeping)
    epoch = (lambda: registration.publisher.epoch or 0) if registration.publisher else (lambda: 0)
    server.add(worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
               PrefillWorkerServicer(worker, config.worker_id, epoch),
               worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name)
    loop.start()
    server.start()
    registration.start()
    log.info("prefill worker %s serving on %s", config.worker_id, endpoint)
    return WorkerHandle(server, loop, worker, registration)


def serve(config: PrefillWorkerConfig, engine_config: EngineConfig) -> None:
    handle = start_server(config, engine_config)
    wait_for_termination(lambda: handle.stop(grace_s=STOP_GRACE_S))
