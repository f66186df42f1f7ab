"""The gateway's client of the workers' gRPC services (worker.proto): the one module of the gateway's request
path that sees grpc and protobuf. Calls take and return plain dataclasses and raise domain errors, so the
orchestrator's policies never branch on a status code and can be tested with an in-memory fake (the records and
errors live in gateway.worker_types, which imports no grpc).

    status of a worker RPC        raised here               what it means for the request
    INVALID_ARGUMENT              InvalidRequestError       the worker refused the request ("field: message")
    RESOURCE_EXHAUSTED            WorkerBusy                no room now; nothing was done; try another / later
    DEADLINE_EXCEEDED             WorkerTimedOut            no answer in time; the worker may have done it
    UNAVAILABLE                   WorkerUnreachable         connection refused or broken: the worker is gone
    anything else                 WorkerCallFailed          the call failed; the worker may hold state for it

`ChannelPool` keeps one channel per (worker endpoint, role), with keepalive (a hung worker's connection is
closed after KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS without an answer to a ping) and quick reconnects, and
reports each channel's connectivity as a `ChannelState` (gateway.discovery derives worker health from it).

Given the gateway's cluster TlsFiles, every channel is mutual TLS (protos.tls.channel_credentials) and checks
that the server's certificate was issued for the role the call is for (protos.tls.channel_options(role)):
Reserve, Decode and a decode Abort reach only a decode worker's certificate, Prefill and a prefill Abort only a
prefill worker's. A listener without one (another CA, another role, plaintext) fails the handshake before any
request byte is sent: its calls fail UNAVAILABLE (WorkerUnreachable) and its channel shows TRANSIENT_FAILURE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import grpc

from engine.errors import InvalidRequestError
from protos.tls import TlsFiles, channel_credentials, channel_options
from gateway.worker_types import (ChannelState, DecodeMessage, PrefillResult, TransferTarget, WorkerBusy,
                                  WorkerCallFailed, WorkerJob, WorkerTimedOut, WorkerUnreachable)
from protos.convert import (choice_tokens_from_pb, choice_tokens_to_pb, finish_reason_from_pb, logprob_from_pb,
                            logprob_to_pb, prompt_logprob_from_pb, sampling_to_pb)
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

KEEPALIVE_TIME_MS = 20_000
"""Ping a worker connection after this long without data from it (only while calls are open)."""
KEEPALIVE_TIMEOUT_MS = 10_000
"""A ping unanswered this long closes the connection: its calls fail with UNAVAILABLE (WorkerUnreachable)."""
CHANNEL_OPTIONS = [
    # Reconnect quickly to a restarted worker instead of grpc's default back-off of up to 2 minutes.
    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
]


def _domain_error(err: grpc.aio.AioRpcError, what: str) -> Exception:
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field_name, sep, message = details.partition(": ")
        return InvalidRequestError(field_name, message) if sep else InvalidRequestError("request", details)
    message = f"{what}: {code.name}: {details}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return WorkerBusy(message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return WorkerTimedOut(message)
    if code == grpc.StatusCode.UNAVAILABLE:
        return WorkerUnreachable(message)
    return WorkerCallFailed(message)


_STATES = {grpc.ChannelConnectivity.IDLE: ChannelState.IDLE,
           grpc.ChannelConnectivity.CONNECTING: ChannelState.CONNECTING,
           grpc.ChannelConnectivity.READY: ChannelState.READY,
           grpc.ChannelConnectivity.TRANSIENT_FAILURE: ChannelState.TRANSIENT_FAILURE,
           grpc.ChannelConnectivity.SHUTDOWN: ChannelState.SHUTDOWN}


def _job_to_pb(job: WorkerJob) -> worker_pb2.WorkerRequest:
    return worker_pb2.WorkerRequest(request_id=job.request_id, prompt_token_ids=job.prompt_token_ids,
                                    sampling=sampling_to_pb(job.sampling), cache_salt=job.cache_salt,
                                    seed=job.sampling.seed or 0)


def _target_to_pb(target: TransferTarget) -> worker_pb2.TransferTarget:
    return worker_pb2.TransferTarget(endpoint=target.endpoint, handle=target.handle,
                                     num_cached_blocks=target.num_cached_blocks, block_ids=target.block_ids,
                                     host_id=target.host_id)


def _target_from_pb(pb: worker_pb2.TransferTarget) -> TransferTarget:
    return TransferTarget(pb.endpoint, pb.handle, pb.num_cached_blocks, tuple(pb.block_ids), pb.host_id)


# ------------------------------------------------------------------------------------------------------ client
class ChannelPool:
    """One grpc.aio channel per (worker endpoint, role), shared by every request (channels multiplex calls), and
    the worker RPCs over them. `tls`: the gateway's cluster certificate (mutual TLS, server role checked; see the
    module doc); None: plaintext. `timeout` arguments are seconds (None: no deadline)."""

    def __init__(self, tls: TlsFiles | None = None) -> None:
        self._credentials = channel_credentials(tls) if tls is not None else None
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}

    def _channel(self, endpoint: str, role: str) -> grpc.aio.Channel:
        channel = self._channels.get((endpoint, role))
        if channel is None:
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(endpoint, self._credentials,
                                                  options=CHANNEL_OPTIONS + channel_options(role))
            self._channels[(endpoint, role)] = channel
        return channel

    def state(self, endpoint: str, role: str = "decode") -> ChannelState:
        """The connectivity of the channel to the `role` worker at `endpoint`; an idle channel starts connecting
        (so a dead worker, or one without a certificate of its role, shows up as TRANSIENT_FAILURE without a
        request having to fail first)."""
        return _STATES[self._channel(endpoint, role).get_state(try_to_connect=True)]

    async def reserve(self, endpoint: str, job: WorkerJob, lease_ms: int, timeout: float | None) -> TransferTarget:
        stub = worker_pb2_grpc.DecodeWorkerStub(self._channel(endpoint, "decode"))
        try:
            response = await stub.Reserve(worker_pb2.ReserveRequest(request=_job_to_pb(job), lease_ms=lease_ms),
                                          timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise _domain_error(err, f"Reserve on {endpoint}") from err
        return dataclasses.replace(_target_from_pb(response.target), lease_ms=response.lease_ms)

    async def renew(self, endpoint: str, request_id: str, handle: str, lease_ms: int, timeout: float | None) -> int:
        stub = worker_pb2_grpc.DecodeWorkerStub(self._channel(endpoint, "decode"))
        try:
            response = await stub.Renew(worker_pb2.RenewRequest(request_id=request_id, handle=handle,
                                                                lease_ms=lease_ms), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise _domain_error(err, f"Renew on {endpoint}") from err
        return response.lease_ms

    async def prefill(self, endpoint: str, job: WorkerJob, target: TransferTarget,
                      timeout: float | None) -> PrefillResult:
        stub = worker_pb2_grpc.PrefillWorkerStub(self._channel(endpoint, "prefill"))
        try:
            r = await stub.Prefill(worker_pb2.PrefillRequest(request=_job_to_pb(job), target=_target_to_pb(target)),
                                   timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise _domain_error(err, f"Prefill on {endpoint}") from err
        first_logprob = logprob_from_pb(r.first_logprob) if r.HasField("first_logprob") else None
        return PrefillResult(r.first_token_id, first_logprob, r.cached_tokens, r.computed_tokens, r.transfer_bytes,
                             r.transfer_ms, r.transport, r.prefill_ms,
                             tuple(choice_tokens_from_pb(r.choice_first_tokens)),
                             tuple(prompt_logprob_from_pb(lp) for lp in r.prompt_logprobs), r.reshard_bytes,
                             r.reshard_slices)

    async def decode(self, endpoint: str, request_id: str, handle: str, first: PrefillResult | None,
                     timeout: float | None) -> AsyncIterator[DecodeMessage]:
        """The decode stream of a reservation: after a remote prefill, `first` is its result; None makes the
        decode worker prefill locally. Closing the iterator cancels the call."""
        request = worker_pb2.DecodeRequest(request_id=request_id, handle=handle, prefill_locally=first is None)
        if first is not None:
            request.first_token_id = first.first_token_id
            if first.first_logprob is not None:
                request.first_logprob.CopyFrom(logprob_to_pb(first.first_logprob))
            request.choice_first_tokens.extend(choice_tokens_to_pb(list(first.choice_first_tokens)))
        call = worker_pb2_grpc.DecodeWorkerStub(self._channel(endpoint, "decode")).Decode(request, timeout=timeout)
        try:
            while True:
                try:
                    msg = await call.read()
                except grpc.aio.AioRpcError as err:
                    raise _domain_error(err, f"Decode on {endpoint}") from err
                if msg is grpc.aio.EOF:
                    return
                yield DecodeMessage(tuple(msg.token_ids), tuple(logprob_from_pb(lp) for lp in msg.logprobs),
                                    finish_reason_from_pb(msg.finish_reason), msg.choice_index,
                                    tuple(prompt_logprob_from_pb(lp) for lp in msg.prompt_logprobs))
        finally:
            call.cancel()                            # no-op when the stream already ended

    async def abort(self, endpoint: str, role: str, request_id: str, timeout: float | None) -> bool:
        """Abort `request_id` on the `role` ("prefill" or "decode") worker; True when it held something."""
        channel = self._channel(endpoint, role)
        stub = worker_pb2_grpc.DecodeWorkerStub(channel) if role == "decode" else \
            worker_pb2_grpc.PrefillWorkerStub(channel)
        try:
            response = await stub.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise _domain_error(err, f"Abort on {endpoint}") from err
        return response.found

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
