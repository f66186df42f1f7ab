"""Keeps one worker's entries in the prefix index current, from a background thread (see IndexPublisher);
`PublisherStats` is what it reports."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.block_pool import AllBlocksCleared, BlockStored, KVEvent
from kvstore.index import IndexUnavailable, PrefixIndex
from kvstore.local_index import WorkerInfo, WorkerNotRegistered

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublisherStats:
    """A snapshot of one IndexPublisher (``get_stats()``); the counters only grow."""

    synced: bool
    """Registered, and every submitted event published or pending (False: a full re-publish is due)."""
    epoch: int | None
    """The worker's epoch in the index; None before the first registration."""
    num_pending_events: int
    """Events queued for the next cycle."""
    num_published_events: int
    """Events applied (a full re-publish counts one per chunk of at most max_hashes_per_call hashes)."""
    num_dropped_events: int
    """Events never applied one by one: submitted while not synced, or pending when a cycle failed or the queue
    overflowed. The full re-publish that follows covers them; a growing count means Redis was unreachable."""
    num_republishes: int
    """Registrations, each followed by a full re-publish of the mirrored set (1 after the first; each further
    one is a recovery)."""


class IndexPublisher:
    """Keeps one worker's entries in a prefix index current, from a daemon thread; never blocks serving.

    The engine thread calls ``submit(pool.take_events())`` and ``set_load(...)``; both only take a short
    lock. Every ``flush_interval_s`` the thread registers if needed, publishes pending events (chunks of
    at most ``max_hashes_per_call`` hashes, each atomic), heartbeats every ``heartbeat_interval_s``
    (default worker_ttl_s / 3) and collects garbage every ``gc_interval_s``.

    The publisher mirrors the worker's cached hash set from the events it is given (seed it with
    ``initial_hashes=pool.get_cached_hashes()`` if the pool cached blocks before), so it never reads
    the pool from its own thread. Any failure (Redis down, record expired, epoch superseded, a Sentinel
    failover to another master, more than ``max_pending_hashes`` pending) drops the pending events; the
    next successful cycle registers under a new epoch and re-publishes the full mirrored set.
    Retries back off from 50 ms to 2 s. ``get_stats()`` is a snapshot of its counters, for the worker's metrics.
    """

    _MIN_BACKOFF_S = 0.05
    _MAX_BACKOFF_S = 2.0

    def __init__(self, index: PrefixIndex, worker: WorkerInfo, *, initial_hashes: Iterable[int] = (),
                 flush_interval_s: float = 0.05, heartbeat_interval_s: float | None = None,
                 max_pending_hashes: int = 65536, max_hashes_per_call: int = 4096,
                 gc_interval_s: float = 5.0) -> None:
        self._index = index
        self.flush_interval_s = flush_interval_s
        self.heartbeat_interval_s = heartbeat_interval_s or (getattr(index, "worker_ttl_s", None) or 3.0) / 3
        self.max_pending_hashes = max_pending_hashes
        self.max_hashes_per_call = max_hashes_per_call
        self.gc_interval_s = gc_interval_s
        self._lock = threading.Lock()       # guards _worker, _mirror, _pending*, _synced, _num_* counters
        self._io_lock = threading.Lock()    # one sync cycle at a time
        self._worker = worker
        self._mirror: set[int] = set(initial_hashes)
        self._pending: list[KVEvent] = []
        self._num_pending_hashes = 0
        self._synced = False
        self.epoch: int | None = None
        self._next_attempt = self._next_heartbeat = self._next_gc = 0.0
        self._backoff_s = self._MIN_BACKOFF_S
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._num_published_events = 0
        self._num_dropped_events = 0
        self._num_republishes = 0

    @property
    def synced(self) -> bool:
        """True while registered and every submitted event is published or pending."""
        with self._lock:
            return self._synced

    def get_stats(self) -> PublisherStats:
        """The counters now (thread-safe; takes the short lock only)."""
        with self._lock:
            return PublisherStats(synced=self._synced, epoch=self.epoch, num_pending_events=len(self._pending),
                                  num_published_events=self._num_published_events,
                                  num_dropped_events=self._num_dropped_events,
                                  num_republishes=self._num_republishes)

    def start(self) -> IndexPublisher:
        self._thread = threading.Thread(target=self._run, name=f"index-publisher-{self._worker.worker_id}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, deregister: bool = True) -> None:
        """Stop the thread; then deregister (entries become garbage) or flush a last time."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._io_lock:
            if not deregister:
                self._sync_once(force=True)
            elif self.synced and self.epoch is not None:
                try:
                    self._index.deregister(self._worker.worker_id, self.epoch)
                except IndexUnavailable:
                    pass

    def __enter__(self) -> IndexPublisher:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def submit(self, events: Iterable[KVEvent]) -> None:
        """Queue the pool's events (non-blocking, thread-safe) and update the mirrored cached set."""
        with self._lock:
            for event in events:
                if isinstance(event, AllBlocksCleared):
                    self._mirror.clear()
                elif isinstance(event, BlockStored):
                    self._mirror.update(event.block_hashes)
                else:
                    self._mirror.difference_update(event.block_hashes)
                if self._synced:
                    self._pending.append(event)
                    self._num_pending_hashes += max(1, len(getattr(event, "block_hashes", ())))
                else:
                    self._num_dropped_events += 1
            if self._num_pending_hashes > self.max_pending_hashes:
                self._drop_pending_locked()

    def set_load(self, free_blocks: int, running: int, waiting: int) -> None:
        """Load fields sent with the next heartbeat (or registration)."""
        with self._lock:
            self._worker = dataclasses.replace(self._worker, free_blocks=free_blocks,
                                               running=running, waiting=waiting)

    def flush(self) -> bool:
        """Run one sync cycle now (ignoring retry backoff); True when every event submitted before
        the call is in the index."""
        with self._io_lock:
            return self._sync_once(force=True)

    def _run(self) -> None:
        while True:
            with self._io_lock:
                try:
                    self._sync_once(force=False)
                except Exception:  # a bug must not kill the thread or serving; resync later
                    log.exception("index publisher cycle failed")
                    self._on_failure(time.monotonic())
            if self._stop.wait(self.flush_interval_s):
                return

    def _sync_once(self, force: bool) -> bool:
        now = time.monotonic()
        batch: list[KVEvent] = []
        try:
            if not self.synced:
                if not force and now < self._next_attempt:
                    return False
                self._resync(now)
            with self._lock:
                batch, self._pending, self._num_pending_hashes = self._pending, [], 0
                worker = self._worker
            self._publish(batch)
            batch = []
            if now >= self._next_heartbeat:
                self._index.heartbeat(worker.worker_id, self.epoch, worker.free_blocks,
                                      worker.running, worker.waiting)
                self._next_heartbeat = now + self.heartbeat_interval_s
            if now >= self._next_gc:
                self._index.collect_garbage()
                self._next_gc = now + self.gc_interval_s
        except (IndexUnavailable, WorkerNotRegistered) as exc:
            if self.synced:
                log.warning("prefix index sync of %s lost, will re-register: %s", self._worker.worker_id, exc)
            with self._lock:
                self._num_dropped_events += len(batch)
            self._on_failure(now)
            return False
        self._backoff_s = self._MIN_BACKOFF_S
        return self.synced

    def _resync(self, now: float) -> None:
        with self._lock:
            worker = self._worker
        self.epoch = self._index.register(worker)
        with self._lock:
            snapshot = tuple(self._mirror)
            self._synced = True
        self._publish([BlockStored(snapshot)])
        with self._lock:
            self._num_republishes += 1
        self._next_heartbeat = now + self.heartbeat_interval_s

    def _publish(self, events: list[KVEvent]) -> None:
        for chunk in _chunk_events(events, self.max_hashes_per_call):
            self.epoch = self._index.publish(self._worker.worker_id, self.epoch, chunk)
            with self._lock:
                self._num_published_events += len(chunk)

    def _on_failure(self, now: float) -> None:
        with self._lock:
            self._drop_pending_locked()
        self._next_attempt = now + self._backoff_s
        self._backoff_s = min(2 * self._backoff_s, self._MAX_BACKOFF_S)

    def _drop_pending_locked(self) -> None:
        self._num_dropped_events += len(self._pending)
        self._pending, self._num_pending_hashes, self._synced = [], 0, False


def _chunk_events(events: list[KVEvent], max_hashes: int) -> Iterable[list[KVEvent]]:
    """Split into lists of at most ``max_hashes`` hashes (large events are split), order kept."""
    chunk: list[KVEvent] = []
    size = 0
    for event in events:
        hashes = getattr(event, "block_hashes", None)
        pieces = [event] if not hashes else [type(event)(hashes[i:i + max_hashes])
                                              for i in range(0, len(hashes), max_hashes)]
        for piece in pieces:
            piece_size = max(1, len(getattr(piece, "block_hashes", ())))
            if chunk and size + piece_size > max_hashes:
                yield chunk
                chunk, size = [], 0
            chunk.append(piece)
            size += piece_size
    if chunk:
        yield chunk
