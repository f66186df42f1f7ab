"""Decode worker process: engine loop + DecodeWorker and KvTransfer services on one gRPC port + registration.

`serve(config, engine_config)` runs until SIGTERM/SIGINT: it then reports NOT_SERVING, leaves the prefix
index, lets in-flight streams finish (grace period) and stops. `start_server` returns a running handle
for tests and embedding.
"""

from __future__ import annotations

import logging

from decode_worker.config import DecodeWorkerConfig
from decode_worker.service import DecodeWorkerServicer
from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop, build_engine
from engine.llm_engine import LLMEngine
from kvstore.transfer_service import KvTransferServicer
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc
from protos.service_runtime import Registration, WorkerHandle, WorkerServer, wait_for_termination

log = logging.getLogger(__name__)

STOP_GRACE_S = 15.0
"""On SIGTERM, how long in-flight requests may take to finish (below `pdserve up`'s 20 s stop timeout)."""


def start_server(config: DecodeWorkerConfig, engine_config: EngineConfig,
                 engine: LLMEngine | None = None) -> WorkerHandle:
    engine = engine or build_engine(engine_config, progress=False)
    loop = EngineLoop(engine)
    worker = DecodeWorker(loop, config.max_lease_ms)
    server = WorkerServer(config.host, config.port)
    endpoint = f"{config.advertise_host or config.host}:{server.port}"
    registration = Registration(config.redis_url, config.worker_id, "decode", endpoint, engine, config.worker_ttl_s)
    loop.add_housekeeping(registration.on_housekeeping)
    epoch = (lambda: registration.publisher.epoch or 0) if registration.publisher else (lambda: 0)
    server.add(worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
               DecodeWorkerServicer(worker, config.worker_id, endpoint, epoch),
               worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name)
    server.add(kv_transfer_pb2_grpc.add_KvTransferServicer_to_server, KvTransferServicer(worker),
               kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"].full_name)
    loop.start()
    server.start()
    registration.start()
    log.info("decode worker %s serving on %s", config.worker_id, endpoint)
    return WorkerHandle(server, loop, worker, registration)


def serve(config: DecodeWorkerConfig, engine_config: EngineConfig) -> None:
    handle = start_server(config, engine_config)
    wait_for_termination(lambda: handle.stop(grace_s=STOP_GRACE_S))
