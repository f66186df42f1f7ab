"""gRPC servicer of the decode worker: unpack, call DecodeWorker, pack. Status mapping: protos.service_runtime."""

from __future__ import annotations

from collections.abc import Callable

from decode_worker.worker import DecodeWorker
from kvstore.shm import host_id
from protos.convert import (TransferTargetData, WorkerStatsData, choice_tokens_from_pb, logprob_from_pb,
                            request_from_pb, step_to_pb, target_to_pb, worker_stats_to_pb)
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from protos.service_runtime import caller_of, status_on_error


class DecodeWorkerServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, worker_id: str, endpoint: str, epoch: Callable[[], int]) -> None:
        self.worker = worker
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.epoch = epoch
        self.host_id = host_id()

    def Reserve(self, request, context):
        with status_on_error(context):
            res = self.worker.reserve(request_from_pb(request.request), request.lease_ms, caller_of(context))
        target = TransferTargetData(self.endpoint, res.handle, res.num_cached_blocks, res.missing_block_ids,
                                    self.host_id)
        return worker_pb2.ReserveResponse(target=target_to_pb(target), lease_expiry_unix_ms=res.lease_expiry_unix_ms,
                                          lease_ms=res.lease_ms)

    def Renew(self, request, context):
        with status_on_error(context):
            res = self.worker.renew(request.request_id, request.handle, request.lease_ms, caller_of(context))
        return worker_pb2.RenewResponse(lease_expiry_unix_ms=res.lease_expiry_unix_ms, lease_ms=res.lease_ms)

    def Decode(self, request, context):
        first_logprob = logprob_from_pb(request.first_logprob) if request.HasField("first_logprob") else None
        first_token = None if request.prefill_locally else request.first_token_id
        with status_on_error(context):
            stream = self.worker.decode(request.request_id, request.handle, first_token, first_logprob,
                                        choice_tokens_from_pb(request.choice_first_tokens))
        context.add_callback(stream.close)  # client cancel or deadline: abort, blocks freed
        with status_on_error(context):
            for out in stream:
                yield step_to_pb(out)

    def Abort(self, request, context):
        return worker_pb2.AbortResponse(found=self.worker.abort(request.request_id))

    def Stats(self, request, context):
        with status_on_error(context):
            stats = WorkerStatsData(self.worker_id, "decode", self.epoch(), self.worker.stats(),
                                    self.worker.num_transfer_errors)
        return worker_stats_to_pb(stats)
