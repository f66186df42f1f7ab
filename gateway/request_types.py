"""What the orchestrator hands the public fronts: output chunks, usage, timings, the request's route, and the
errors that end a request, each with one status code (`error_code`; gateway.server turns it into a gRPC status,
gateway.http_front into an HTTP one)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError, OverloadedError
from engine.sequence import FinishReason, PromptLogprob, TokenLogprob
from gateway.auth import Unauthenticated

RETRY_AFTER_MS = 500
"""Back-off suggested to callers turned away with RESOURCE_EXHAUSTED."""

# ------------------------------------------------------------------------------------------------------ errors
class NoWorkerAvailable(Exception):
    """No live, compatible decode worker could take the request (UNAVAILABLE; retryable)."""


class Overloaded(OverloadedError):
    """Every decode worker is full, or the gateway is at max_inflight (RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, retry_after_ms: int = RETRY_AFTER_MS) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class KeyLimited(Overloaded):
    """The caller's API key is at one of its limits (max_concurrent, tokens_per_minute): RESOURCE_EXHAUSTED."""


class DeadlineExceeded(Exception):
    """The caller's deadline passed (DEADLINE_EXCEEDED)."""


class WorkerFailed(Exception):
    """The decode worker failed after the request started (UNAVAILABLE; the caller may retry)."""


class ShuttingDown(Exception):
    """The gateway is draining and takes no new requests (UNAVAILABLE; retry on another gateway)."""


class ClientGone(Exception):
    """The client closed its connection before the response ended (CANCELLED)."""


def error_code(exc: BaseException | None) -> str:
    """The status a request ends with, as a grpc.StatusCode name: "OK" for None, else the code of `exc`."""
    if exc is None:
        return "OK"
    if isinstance(exc, InvalidRequestError):
        return "INVALID_ARGUMENT"
    if isinstance(exc, Unauthenticated):
        return "UNAUTHENTICATED"
    if isinstance(exc, OverloadedError):
        return "RESOURCE_EXHAUSTED"
    if isinstance(exc, (NoWorkerAvailable, WorkerFailed, ShuttingDown)):
        return "UNAVAILABLE"
    if isinstance(exc, DeadlineExceeded):
        return "DEADLINE_EXCEEDED"
    if isinstance(exc, (ClientGone, asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return "INTERNAL"


# ------------------------------------------------------------------------------------------------------ outputs
@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    """Summed over the request's choices, as OpenAI counts them (the prompt is counted once)."""
    cached_tokens: int
    """Prompt tokens whose KV came from a prefix cache: P's hit when P prefilled, D's when D did."""


@dataclass(frozen=True)
class Timings:
    """Milliseconds, as in generation.proto Timings. How each is measured here:

    queue_ms     arrival -> D's Reserve answered, plus the part of the Prefill RPC that P reported neither as
                 prefill nor as transfer (P's queueing and the RPC overhead)
    prefill_ms   P's reported prefill time; local: Decode sent -> first token back (includes D's queueing)
    transfer_ms  P's reported push time (0 when local)
    ttft_ms      arrival -> the first token handed to the client stream
    kv_reshard_bytes / kv_reshard_slices   P's report of the push's re-sharding plan between the workers'
                 tensor-parallel ranks (0 when local)
    """

    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    ttft_ms: float
    transport: str
    transfer_bytes: int
    kv_reshard_bytes: int = 0
    kv_reshard_slices: int = 0


@dataclass(frozen=True)
class OutputChunk:
    """New text and token ids of one choice since its previous chunk. The last chunk of each choice has its
    finish_reason; the last chunk of the request (the one with usage) also has timings."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    choice_index: int = 0
    """Which choice of the request (sampling.n > 1) the chunk continues."""
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    """With sampling.prompt_logprobs, on the first chunk only: prompt tokens 1..n-1 (the first has none)."""


@dataclass
class RequestTrace:
    """Where a request went (filled in as it happens; the server reports it as trailing metadata)."""

    decode_worker: str = ""
    prefill_workers: list[str] = field(default_factory=list)
    """Every prefill worker tried, in order; the last one succeeded unless local_reason is set."""
    local_reason: str = ""
    """Why D prefilled locally: a routing.LOCAL_* reason, or "prefill_failed"."""

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("pdserve-decode-worker", self.decode_worker),
                ("pdserve-prefill-workers", ",".join(self.prefill_workers)),
                ("pdserve-local-prefill", self.local_reason))
