"""The gateway's worker client as the request path sees it: its interface (`WorkerClient`), what it returns and
what it raises (plain dataclasses and exceptions; no grpc, no protobuf), so the orchestrator and discovery stay
free of the transport. The gRPC implementation is gateway.worker_client.ChannelPool."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, PromptLogprob, TokenLogprob


# ------------------------------------------------------------------------------------------------------ errors
class WorkerError(Exception):
    """A worker RPC failed (the subclasses say how)."""


class WorkerBusy(WorkerError):
    """RESOURCE_EXHAUSTED: the worker has no room now and did nothing."""


class WorkerTimedOut(WorkerError):
    """DEADLINE_EXCEEDED: no answer in time (the worker is alive but slow, or hung)."""


class WorkerUnreachable(WorkerError):
    """UNAVAILABLE: the worker could not be reached, or its connection broke."""


class WorkerCallFailed(WorkerError):
    """Any other failure; the worker may hold state for the request."""


# ------------------------------------------------------------------------------------------------------ records
@dataclass(frozen=True)
class WorkerJob:
    """What both workers are told about a request (worker.proto WorkerRequest)."""

    request_id: str
    """The worker-side id (the request's id, or "<id>.retry<n>")."""
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    """Seed set; stop strings stay in the gateway."""
    cache_salt: str = ""


@dataclass(frozen=True)
class TransferTarget:
    """Where a prefill worker pushes the KV of a reservation (worker.proto TransferTarget)."""

    endpoint: str
    handle: str
    num_cached_blocks: int
    """Leading prompt blocks the decode worker already holds (it needs only the rest)."""
    block_ids: tuple[int, ...] = ()
    host_id: str = ""
    lease_ms: int = 0
    """The lease the decode worker granted at Reserve (0: not reported); the gateway renews within it. Not sent
    to the prefill worker."""


@dataclass(frozen=True)
class PrefillResult:
    """A prefill worker's answer: the first token, and what the prefill and the KV push cost."""

    first_token_id: int
    first_logprob: TokenLogprob | None
    cached_tokens: int
    computed_tokens: int
    transfer_bytes: int
    transfer_ms: float
    transport: str
    prefill_ms: float
    choice_first_tokens: tuple[tuple[int, TokenLogprob | None], ...] = ()
    """First tokens of choices 1..n-1 (n > 1), from the same prompt logits."""
    prompt_logprobs: tuple[PromptLogprob, ...] = ()
    """Prompt tokens 1..n-1, when the request asked for prompt logprobs."""
    reshard_bytes: int = 0
    """KV bytes the push's re-sharding plan handed the decode worker's ranks (kvstore.reshard_plan)."""
    reshard_slices: int = 0
    """The plan's (prefill rank, decode rank) slices."""


@dataclass(frozen=True)
class DecodeMessage:
    """One message of a decode stream, of one choice; the last one of each choice has a finish_reason."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    choice_index: int = 0
    prompt_logprobs: tuple[PromptLogprob, ...] = ()
    """A locally prefilled request's prompt logprobs, on the message with its first token."""


class ChannelState(enum.Enum):
    """A worker channel's connectivity (grpc.ChannelConnectivity without grpc)."""

    IDLE = "idle"
    CONNECTING = "connecting"
    READY = "ready"
    TRANSIENT_FAILURE = "transient_failure"
    SHUTDOWN = "shutdown"


class WorkerClient(Protocol):
    """The worker RPCs the orchestrator uses (gateway.worker_client.ChannelPool; in-memory fakes in tests).
    Errors: InvalidRequestError and WorkerError subclasses (above)."""

    async def reserve(self, endpoint: str, job: WorkerJob, lease_ms: int,
                      timeout: float | None) -> TransferTarget: ...

    async def renew(self, endpoint: str, request_id: str, handle: str, lease_ms: int,
                    timeout: float | None) -> int:
        """Extend a reservation's lease from now; returns the lease granted (ms)."""

    async def prefill(self, endpoint: str, job: WorkerJob, target: TransferTarget,
                      timeout: float | None) -> PrefillResult: ...

    def decode(self, endpoint: str, request_id: str, handle: str, first: PrefillResult | None,
               timeout: float | None) -> AsyncIterator[DecodeMessage]: ...

    async def abort(self, endpoint: str, role: str, request_id: str, timeout: float | None) -> bool: ...

    async def close(self) -> None: ...
