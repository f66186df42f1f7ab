"""Errors the engine raises at its boundary; the service layer maps them to status codes."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request field is out of range. `field` names it (maps to gRPC INVALID_ARGUMENT / HTTP 400)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class OverloadedError(RuntimeError):
    """No room now: the waiting queue or the KV pool is full, or a caller holds its share of reservations
    (maps to gRPC RESOURCE_EXHAUSTED / HTTP 429). `retry_after_ms`, when known, is when to try again."""

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class PreconditionError(Exception):
    """The request is valid but the worker's state does not allow it, e.g. a reservation that expired or
    whose KV has not arrived (maps to gRPC FAILED_PRECONDITION)."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its sampling or bookkeeping raised); the other requests of its
    batch went on. Not retryable as is: the same request fails the same way (maps to gRPC INTERNAL)."""


class RequestAborted(Exception):
    """The request was aborted by its caller before this call could complete (maps to gRPC CANCELLED)."""


class PermissionDeniedError(Exception):
    """The caller may not ask for this, whoever it is authenticated as (maps to gRPC PERMISSION_DENIED).
    `field` names the request field that was refused."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
