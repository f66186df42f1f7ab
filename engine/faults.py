"""Fault injection for tests: make chosen requests fail inside the engine while the rest of the batch runs.

Contract: `SAMPLING_FAULTS.arm(request_id)` makes every sampling of that request raise `InjectedFault` until
`disarm(request_id)` (or leaving the `armed(...)` context). Nothing is armed unless a test arms it, and the
production cost is one lookup in an empty set per sampled row. Process-wide on purpose: tests reach an
engine that runs inside a gRPC worker (same process) without any flag or request field.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class InjectedFault(RuntimeError):
    """Raised by an armed fault point."""


class FaultPoint:
    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._request_ids: frozenset[str] = frozenset()

    def arm(self, request_id: str) -> None:
        with self._lock:
            self._request_ids = self._request_ids | {request_id}

    def disarm(self, request_id: str) -> None:
        with self._lock:
            self._request_ids = self._request_ids - {request_id}

    @contextlib.contextmanager
    def armed(self, request_id: str) -> Iterator[None]:
        self.arm(request_id)
        try:
            yield
        finally:
            self.disarm(request_id)

    def check(self, request_id: str) -> None:
        """Raise InjectedFault when `request_id` is armed here (called by the engine at this point)."""
        if request_id in self._request_ids:  # read of an immutable snapshot: no lock on the hot path
            raise InjectedFault(f"injected {self.name} fault for request {request_id!r}")


SAMPLING_FAULTS = FaultPoint("sampling")
"""Checked once per sampled row, inside `engine.sampler.sample`."""
