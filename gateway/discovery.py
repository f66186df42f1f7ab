"""Worker discovery and worker health, as the gateway sees them.

Discovery: workers come from the prefix index (`kvstore.index.PrefixIndex`); while Redis is unreachable the last
known worker list is used with no prefix information (routing by load only). Lookups are bounded by the index's
own timeout.

Health: a registration outlives its worker by up to the index's TTL, so the gateway also uses what it sees
itself. A worker is *down* from the moment the gateway saw it fail (a broken stream or a refused connection:
`report_unreachable`) or its channel was seen in TRANSIENT_FAILURE, until its channel is READY again. The
gateway is serving while at least one usable (compatible) decode worker is registered and not down;
`watch` re-evaluates that every `interval_s` (probing each decode worker's channel, which also reconnects
it) and calls back on every change, so grpc.health.v1 and HTTP /health follow a killed worker within about a
second and come back as soon as one is reachable.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from gateway.routing import RoutingPolicy, incompatibility
from gateway.worker_types import ChannelState
from kvstore.local_index import PrefixMatch, WorkerInfo

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 0.25
"""How often `watch` re-evaluates health."""


class _Index(Protocol):
    def match(self, block_hashes: Sequence[int]) -> list[PrefixMatch] | None: ...

    def close(self) -> None: ...


class _Channels(Protocol):
    def state(self, endpoint: str) -> ChannelState: ...


class WorkerDirectory:
    """Live workers (index plus last known ones) and which of them this gateway knows to be down."""

    def __init__(self, index: _Index, policy: RoutingPolicy, channels: _Channels) -> None:
        self._index = index
        self._policy = policy
        self._channels = channels
        self._last_known: list[WorkerInfo] = []
        self._seen: set[tuple[str, int]] = set()
        self._down: set[str] = set()
        """Endpoints seen failing and not READY since."""
        self.serving = False
        """Whether a usable decode worker is up, as of the last `refresh` (or `watch` round)."""

    # --- discovery --------------------------------------------------------------------------------------------
    async def list_workers(self) -> list[WorkerInfo]:
        """Every live worker, compatible or not (the last known ones while the index is unreachable)."""
        return [m.worker for m in await self.match(())]

    def is_usable(self, worker: WorkerInfo) -> bool:
        """Whether requests may be routed to `worker` (same model, block size and context as the gateway)."""
        return incompatibility(worker, self._policy) is None

    async def match(self, block_hashes: Sequence[int]) -> list[PrefixMatch]:
        """Every live worker with its leading cached blocks of `block_hashes` (0 each while Redis is down)."""
        matches = await asyncio.to_thread(self._index.match, list(block_hashes))
        if matches is None:
            return [PrefixMatch(worker, 0) for worker in self._last_known]
        self._last_known = [m.worker for m in matches]
        self._warn_incompatible(self._last_known)
        return matches

    def _warn_incompatible(self, workers: Sequence[WorkerInfo]) -> None:
        for worker in workers:
            if (worker.worker_id, worker.epoch) in self._seen:
                continue
            self._seen.add((worker.worker_id, worker.epoch))
            reason = incompatibility(worker, self._policy)
            if reason is not None:
                log.warning("ignoring %s worker %s: %s", worker.role, worker.worker_id, reason)

    # --- health -----------------------------------------------------------------------------------------------
    def report_unreachable(self, endpoint: str) -> None:
        """A call to `endpoint` found it unreachable or its stream broke: down until its channel is READY."""
        self._down.add(endpoint)

    def down_endpoints(self) -> frozenset[str]:
        return frozenset(self._down)

    def is_down(self, endpoint: str) -> bool:
        """Probe `endpoint`'s channel: READY clears a down mark, TRANSIENT_FAILURE sets one."""
        state = self._channels.state(endpoint)
        if state == ChannelState.READY:
            self._down.discard(endpoint)
        elif state in (ChannelState.TRANSIENT_FAILURE, ChannelState.SHUTDOWN):
            self._down.add(endpoint)
        return endpoint in self._down

    async def live_decode_workers(self) -> list[WorkerInfo]:
        """Usable decode workers that are registered and not down."""
        workers = [w for w in await self.list_workers() if w.role == "decode" and self.is_usable(w)]
        return [w for w in workers if not self.is_down(w.grpc_endpoint)]

    async def refresh(self) -> bool:
        """Re-evaluate `serving` now; returns it."""
        self.serving = bool(await self.live_decode_workers())
        return self.serving

    async def watch(self, on_change: Callable[[bool], Awaitable[None]], interval_s: float = HEALTH_INTERVAL_S) -> None:
        """Re-evaluate health every `interval_s` until cancelled; `on_change(serving)` first, then on changes."""
        previous = None
        while True:
            try:
                serving = await self.refresh()
            except Exception:                        # a bug here must not stop health tracking
                log.exception("health check failed")
                serving = False
            if serving != previous:
                if previous is not None:
                    log.warning("gateway health: %s", "SERVING" if serving else "NOT_SERVING (no live decode worker)")
                await on_change(serving)
                previous = serving
            await asyncio.sleep(interval_s)

    def close(self) -> None:
        self._index.close()
