"""gRPC servicer of the decode worker: unpack, call DecodeWorker, pack. Status mapping: worker_runtime."""

from __future__ import annotations

from decode_worker.worker import DecodeWorker
from engine.llm_engine import StepOutput
from kvstore.shm import host_id
from pdserve.worker_runtime import request_from_pb, status_on_error
from protos.convert import finish_reason_to_pb, logprob_from_pb, logprob_to_pb
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc


def step_to_pb(out: StepOutput) -> worker_pb2.DecodeResponse:
    return worker_pb2.DecodeResponse(
        token_ids=out.new_token_ids, logprobs=[logprob_to_pb(lp) for lp in out.new_logprobs],
        finish_reason=finish_reason_to_pb(out.seq.finish_reason if out.finished else None),
        cached_tokens=out.seq.num_cached_tokens)


class DecodeWorkerServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, worker_id: str, endpoint: str, epoch: callable) -> None:
        self.worker = worker
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.epoch = epoch
        self.host_id = host_id()

    def Reserve(self, request, context):
        with status_on_error(context):
            res = self.worker.reserve(request_from_pb(request.request), request.lease_ms)
        return worker_pb2.ReserveResponse(
            target=worker_pb2.TransferTarget(endpoint=self.endpoint, handle=res.handle,
                                             num_cached_blocks=res.num_cached_blocks,
                                             block_ids=res.missing_block_ids, host_id=self.host_id),
            lease_expiry_unix_ms=res.lease_expiry_unix_ms)

    def Decode(self, request, context):
        first_logprob = logprob_from_pb(request.first_logprob) if request.HasField("first_logprob") else None
        first_token = None if request.prefill_locally else request.first_token_id
        with status_on_error(context):
            stream = self.worker.decode(request.request_id, request.handle, first_token, first_logprob)
        context.add_callback(stream.close)  # client cancel or deadline: abort, blocks freed
        with status_on_error(context):
            for out in stream:
                yield step_to_pb(out)

    def Abort(self, request, context):
        return worker_pb2.AbortResponse(found=self.worker.abort(request.request_id))

    def Stats(self, request, context):
        s = self.worker.stats()
        return worker_pb2.WorkerStats(
            worker_id=self.worker_id, role="decode", epoch=self.epoch(), num_blocks=s["num_blocks"],
            free_blocks=s["free_blocks"], used_blocks=s["used_blocks"], running=s["running"], waiting=s["waiting"],
            reserved=s["reserved"], transfer_errors=s["transfer_errors"], preemptions=s["preemptions"])
