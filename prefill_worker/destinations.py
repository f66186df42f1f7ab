"""Where a prefill worker may push KV: only to decode workers of its own cluster, never to a caller's choice.

A Prefill request names its target (``target.endpoint``); the worker checks it before computing anything:

    registered (redis_url)   the endpoint must be the grpc endpoint of a live decode worker record in the index
                             this worker registers in (kvstore.index.PrefixIndex.list_workers("decode")), looked
                             up at most every `refresh_s` (an unknown endpoint triggers one early refresh, at most
                             every `min_refresh_s`); while the index cannot be read the last answer stands
    unregistered             the endpoint must be one of the config's `decode_endpoints`

Anything else raises DestinationRefused naming ``target.endpoint`` (PERMISSION_DENIED). Over mutual TLS the
push channel also requires the server's certificate to be a decode worker's of the cluster CA
(protos.tls.channel_options("decode")), so a record written into the index by someone else, pointing at their
own listener, still gets no connection and no KV.

Thread-safe; no torch.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from engine.errors import PermissionDeniedError
from kvstore.index import PrefixIndex
from prefill_worker.config import PrefillWorkerConfig


class DestinationRefused(PermissionDeniedError):
    """A push target that is not a decode worker of this cluster."""

    def __init__(self, endpoint: str) -> None:
        super().__init__("target.endpoint", f"{endpoint!r} is not a live decode worker of this cluster")


class DecodeDestinations:
    """The decode endpoints this prefill worker may push to (see the module docstring)."""

    def __init__(self, *, list_decode_endpoints: Callable[[], Iterable[str] | None] | None = None,
                 static_endpoints: Iterable[str] = (), refresh_s: float = 1.0, min_refresh_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._list = list_decode_endpoints
        self._static = frozenset(static_endpoints)
        self.refresh_s = refresh_s
        self.min_refresh_s = min_refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._known: frozenset[str] = frozenset()
        self._fetched_at: float | None = None

    @classmethod
    def for_config(cls, config: PrefillWorkerConfig) -> DecodeDestinations:
        if not config.redis_url:
            return cls(static_endpoints=config.decode_endpoints)
        index = PrefixIndex(config.redis_url, worker_ttl_s=config.worker_ttl_s, lookup_timeout_s=0.5)

        def live_decode_endpoints() -> list[str] | None:
            workers = index.list_workers("decode")
            return None if workers is None else [w.grpc_endpoint for w in workers if w.grpc_endpoint]
        return cls(list_decode_endpoints=live_decode_endpoints)

    def check(self, endpoint: str) -> None:
        """Return if `endpoint` is an allowed destination; DestinationRefused otherwise."""
        if endpoint in self._static:
            return
        if self._list is None:
            raise DestinationRefused(endpoint)
        with self._lock:
            now = self._clock()
            age = None if self._fetched_at is None else now - self._fetched_at
            stale = age is None or age >= self.refresh_s
            if stale or (endpoint not in self._known and age >= self.min_refresh_s):
                fetched = self._list()
                self._fetched_at = now
                if fetched is not None:    # index unreachable: keep what it last said
                    self._known = frozenset(fetched)
            if endpoint not in self._known:
                raise DestinationRefused(endpoint)
