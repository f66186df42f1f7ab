"""gRPC servicer of the prefill worker: unpack, call PrefillWorker, pack. Status mapping: protos.service_runtime."""

from __future__ import annotations

from collections.abc import Callable

from prefill_worker.worker import PrefillWorker
from protos.convert import (WorkerStatsData, choice_tokens_to_pb, logprob_to_pb, prompt_logprob_to_pb,
                            request_from_pb, target_from_pb, worker_stats_to_pb)
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from protos.service_runtime import status_on_error

MAX_PREFILL_S = 600.0
"""Longest a prefill (queueing, compute and KV push) may take when the caller set no deadline."""


class PrefillWorkerServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, worker_id: str, epoch: Callable[[], int]) -> None:
        self.worker = worker
        self.worker_id = worker_id
        self.epoch = epoch

    def Prefill(self, request, context):
        req = request_from_pb(request.request)
        context.add_callback(lambda: self.worker.abort(req.request_id) if not context.is_active() else None)
        remaining = min(context.time_remaining() or MAX_PREFILL_S, MAX_PREFILL_S)  # no deadline: a huge value
        with status_on_error(context):
            r = self.worker.prefill(req, target_from_pb(request.target), remaining)
        response = worker_pb2.PrefillResponse(
            first_token_id=r.first_token_id, cached_tokens=r.cached_tokens, computed_tokens=r.computed_tokens,
            transfer_bytes=r.transfer_bytes, transfer_ms=r.transfer_ms, transport=r.transport,
            prefill_ms=r.prefill_ms, choice_first_tokens=choice_tokens_to_pb(r.choice_first_tokens),
            prompt_logprobs=[prompt_logprob_to_pb(lp) for lp in r.prompt_logprobs or ()],
            reshard_bytes=r.reshard_bytes, reshard_slices=r.reshard_slices)
        if r.first_logprob is not None:
            response.first_logprob.CopyFrom(logprob_to_pb(r.first_logprob))
        return response

    def Abort(self, request, context):
        return worker_pb2.AbortResponse(found=self.worker.abort(request.request_id))

    def Stats(self, request, context):
        with status_on_error(context):
            stats = WorkerStatsData(self.worker_id, "prefill", self.epoch(), self.worker.stats(),
                                    self.worker.num_transfer_failures)
        return worker_stats_to_pb(stats)
