"""In-process prefix index, and the types every prefix index shares.

``LocalPrefixIndex`` has the interface and semantics of the Redis ``kvstore.index.PrefixIndex``
(register / heartbeat / publish / match / lookup / list_workers / deregister / collect_garbage)
over plain dicts, for the single-process offline API, where one engine is the only worker and
there is nothing to share. It is also the reference the Redis index is tested against.

Semantics both implementations keep:
- ``register`` starts a new epoch for the worker (1, 2, ...); entries of older epochs never count.
- ``publish(worker_id, epoch, events)`` applies the events in order and returns the worker's
  epoch afterwards: ``AllBlocksCleared`` starts a new epoch (all of the worker's entries stop
  counting at once). A missing or superseded worker raises ``WorkerNotRegistered``: the caller
  must register again and re-publish its full cached set.
- A worker is live while its last register/heartbeat is younger than ``worker_ttl_s``
  (``None``: forever). ``match`` returns every live worker of the role, sorted by worker_id, with
  the number of LEADING prompt blocks it holds (counting stops at its first miss).
Here lookups never return None (there is no I/O to fail). Not thread-safe: one owner drives it.
"""
from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.block_pool import AllBlocksCleared, BlockStored, KVEvent

ROLES = ("prefill", "decode")
_WORKER_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,200}")


class WorkerNotRegistered(Exception):
    """The worker's record is missing (expired, deregistered, index restarted) or its epoch is superseded."""


@dataclass(frozen=True)
class WorkerInfo:
    """A worker as the index knows it; the load fields are as of its last heartbeat."""
    worker_id: str                  # unique and stable across restarts, e.g. "decode-0"; [A-Za-z0-9._:-]
    role: str                       # "prefill" or "decode"
    endpoints: dict[str, str] = field(default_factory=dict)  # e.g. {"grpc": "10.0.0.5:50061"}
    epoch: int = 0                  # assigned by register(); 0 before that
    capacity_blocks: int = 0        # KV blocks in the worker's pool
    free_blocks: int = 0            # blocks with ref_count 0 (cached-but-evictable included)
    running: int = 0                # sequences in the running batch
    waiting: int = 0                # sequences queued

    def __post_init__(self) -> None:
        if not _WORKER_ID_RE.fullmatch(self.worker_id):
            raise ValueError(f"worker_id must match {_WORKER_ID_RE.pattern}, got {self.worker_id!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


@dataclass(frozen=True)
class PrefixMatch:
    """One live worker and how many leading blocks of the looked-up prompt it holds."""
    worker: WorkerInfo
    num_cached_blocks: int


class LocalPrefixIndex:
    def __init__(self, worker_ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_ttl_s = worker_ttl_s
        self._clock = clock
        self._workers: dict[str, WorkerInfo] = {}
        self._last_seen: dict[str, float] = {}
        self._epoch_counters: dict[str, int] = {}
        self._holders: dict[int, dict[str, int]] = {}      # block_hash -> {worker_id: epoch}
        self._worker_hashes: dict[str, set[int]] = {}      # worker_id -> hashes of its current epoch

    def register(self, worker: WorkerInfo) -> int:
        self._forget_entries(worker.worker_id)
        epoch = self._epoch_counters.get(worker.worker_id, 0) + 1
        self._epoch_counters[worker.worker_id] = epoch
        self._workers[worker.worker_id] = dataclasses.replace(worker, epoch=epoch)
        self._last_seen[worker.worker_id] = self._clock()
        return epoch

    def heartbeat(self, worker_id: str, epoch: int, free_blocks: int, running: int, waiting: int) -> None:
        worker = self._get_current(worker_id, epoch)
        self._workers[worker_id] = dataclasses.replace(
            worker, free_blocks=free_blocks, running=running, waiting=waiting)
        self._last_seen[worker_id] = self._clock()

    def deregister(self, worker_id: str, epoch: int) -> None:
        """Remove the worker if ``epoch`` is still its current one (a newer incarnation stays)."""
        worker = self._workers.get(worker_id)
        if worker is not None and worker.epoch == epoch:
            self._drop_worker(worker_id)

    def publish(self, worker_id: str, epoch: int, events: Iterable[KVEvent]) -> int:
        self._get_current(worker_id, epoch)
        hashes = self._worker_hashes.setdefault(worker_id, set())
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self._forget_entries(worker_id)
                epoch += 1
                self._epoch_counters[worker_id] = epoch
                self._workers[worker_id] = dataclasses.replace(self._workers[worker_id], epoch=epoch)
                hashes = self._worker_hashes.setdefault(worker_id, set())
            elif isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self._holders.setdefault(block_hash, {})[worker_id] = epoch
                    hashes.add(block_hash)
            else:
                for block_hash in event.block_hashes:
                    if block_hash in hashes:
                        hashes.remove(block_hash)
                        holders = self._holders[block_hash]
                        del holders[worker_id]
                        if not holders:
                            del self._holders[block_hash]
        return epoch

    def match(self, block_hashes: Sequence[int], role: str | None = None) -> list[PrefixMatch]:
        live = self._live_workers(role)
        counts = dict.fromkeys((w.worker_id for w in live), 0)
        active = {w.worker_id: w.epoch for w in live}
        for block_hash in block_hashes:
            if not active:
                break
            holders = self._holders.get(block_hash, {})
            active = {wid: ep for wid, ep in active.items() if holders.get(wid) == ep}
            for wid in active:
                counts[wid] += 1
        return [PrefixMatch(w, counts[w.worker_id]) for w in live]

    def lookup(self, block_hashes: Sequence[int], role: str | None = None) -> dict[str, int]:
        return {m.worker.worker_id: m.num_cached_blocks for m in self.match(block_hashes, role)}

    def list_workers(self, role: str | None = None) -> list[WorkerInfo]:
        return self._live_workers(role)

    def collect_garbage(self) -> int:
        """Drop workers whose TTL ran out (and their entries); returns how many."""
        return len(self._drop_dead_workers())

    def _get_current(self, worker_id: str, epoch: int) -> WorkerInfo:
        worker = self._workers.get(worker_id)
        if worker is None or not self._is_live(worker_id):
            raise WorkerNotRegistered(f"worker {worker_id!r} is not registered")
        if worker.epoch != epoch:
            raise WorkerNotRegistered(f"worker {worker_id!r} epoch {epoch} superseded by {worker.epoch}")
        return worker

    def _is_live(self, worker_id: str) -> bool:
        return self.worker_ttl_s is None or self._clock() - self._last_seen[worker_id] <= self.worker_ttl_s

    def _live_workers(self, role: str | None) -> list[WorkerInfo]:
        if role is not None and role not in ROLES:
            raise ValueError(f"role must be one of {ROLES} or None, got {role!r}")
        self._drop_dead_workers()
        return sorted((w for w in self._workers.values() if role is None or w.role == role),
                      key=lambda w: w.worker_id)

    def _drop_dead_workers(self) -> list[str]:
        dead = [worker_id for worker_id in self._workers if not self._is_live(worker_id)]
        for worker_id in dead:
            self._drop_worker(worker_id)
        return dead

    def _drop_worker(self, worker_id: str) -> None:
        self._forget_entries(worker_id)
        del self._workers[worker_id]
        del self._last_seen[worker_id]

    def _forget_entries(self, worker_id: str) -> None:
        for block_hash in self._worker_hashes.pop(worker_id, ()):
            holders = self._holders[block_hash]
            del holders[worker_id]
            if not holders:
                del self._holders[block_hash]
