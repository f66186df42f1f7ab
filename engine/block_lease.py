"""The one owner of a request's KV blocks: a lease with explicit states and one release path.

Every request the engine knows has exactly one `BlockLease`; the only call of `KVCacheManager.free` is here.

    local request:   QUEUED ──schedule──▶ RUNNING ──finish/abort──▶ RELEASED
                        ▲                    │
                        └────── preempt ─────┤ (blocks freed, request re-queued)
                                             └─finish(hold_blocks)─▶ HELD ──pin──▶ PUSHING ──unpin──▶ HELD
                                                                      └──────────release─────────────▶ RELEASED
    decode side:     RESERVED ──pin──▶ RECEIVING ──unpin(commit)──▶ COMMITTED ──start──▶ RUNNING
                        │                  └──unpin(failed)──▶ RESERVED
                        └──start (prefill locally)──▶ RUNNING;  RESERVED / COMMITTED ──release──▶ RELEASED

Rules (asserted under the lease's lock, so threads other than the engine loop may pin and unpin):
- `release()` is legal from QUEUED, RUNNING, RESERVED, COMMITTED and HELD, never twice: a second release
  raises `IllegalTransition` (exactly once is checked, not assumed).
- A pinned lease (RECEIVING: a transfer writes its blocks; PUSHING: a push reads them) is never released.
  `request_release()` on it records the wish and returns False; the pin's holder sees it from `unpin()` and
  routes the release back to the engine loop once the blocks are no longer in use, so a release waits for
  the push or transfer that holds the pin.
- Pinning a lease that is no longer in the expected state (e.g. released by an abort) raises
  `IllegalTransition`: the pin holder must then not touch the blocks.

Pure Python: no torch, no I/O. Releases run on the engine loop thread (the only thread that touches the pool).
"""

from __future__ import annotations

import enum
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_cache_manager import KVCacheManager
    from engine.sequence import Sequence


class LeaseState(str, enum.Enum):
    QUEUED = "queued"          # waiting to be scheduled; holds no blocks
    RUNNING = "running"        # in the running batch
    RESERVED = "reserved"      # blocks set aside for a prompt whose KV another worker computes
    RECEIVING = "receiving"    # pinned: a transfer writes the blocks
    COMMITTED = "committed"    # the transferred KV is verified and in place
    HELD = "held"              # finished; blocks kept for a push
    PUSHING = "pushing"        # pinned: a push reads the blocks
    RELEASED = "released"      # terminal: blocks returned to the pool


S = LeaseState
_TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    S.QUEUED: frozenset({S.RUNNING, S.RELEASED}),
    S.RUNNING: frozenset({S.QUEUED, S.HELD, S.RELEASED}),
    S.RESERVED: frozenset({S.RECEIVING, S.RUNNING, S.RELEASED}),
    S.RECEIVING: frozenset({S.COMMITTED, S.RESERVED}),
    S.COMMITTED: frozenset({S.RUNNING, S.RELEASED}),
    S.HELD: frozenset({S.PUSHING, S.RELEASED}),
    S.PUSHING: frozenset({S.HELD}),
    S.RELEASED: frozenset(),
}
_PINNED = frozenset({S.RECEIVING, S.PUSHING})


class IllegalTransition(RuntimeError):
    """A lease was asked to move where its state machine does not go (e.g. a second release)."""


class BlockLease:
    """The KV blocks of `seq`, from its first block to their return to the pool."""

    def __init__(self, seq: Sequence, kv: KVCacheManager, state: LeaseState = LeaseState.QUEUED) -> None:
        assert state in (S.QUEUED, S.RESERVED)
        self.seq = seq
        self._kv = kv
        self._state = state
        self._release_requested = False
        self._lock = threading.Lock()

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def state(self) -> LeaseState:
        return self._state

    @property
    def released(self) -> bool:
        return self._state is S.RELEASED

    @property
    def release_requested(self) -> bool:
        return self._release_requested

    # --- engine loop ----------------------------------------------------------------------------------------
    def advance(self, to: LeaseState, *, expect: frozenset[LeaseState] | None = None) -> None:
        """Move to `to` (not RELEASED: use `release`, nor a pinned state: use `pin`); `expect` narrows the legal
        sources. Preempting (RUNNING -> QUEUED) frees the blocks: the request recomputes them later."""
        assert to is not S.RELEASED and to not in _PINNED, to
        with self._lock:
            self._check(to, expect)
            self._state = to
        if to is S.QUEUED:
            self._free_blocks()

    def release(self) -> None:
        """Return the blocks to the pool, exactly once; raises IllegalTransition if pinned or already released."""
        with self._lock:
            self._check(S.RELEASED, None)
            self._state = S.RELEASED
        self._free_blocks()

    def request_release(self) -> bool:
        """Release now (True), or, while pinned, record that the pin's holder must release after unpinning
        (False). Raises IllegalTransition when already released."""
        with self._lock:
            if self._state in _PINNED:
                self._release_requested = True
                return False
            self._check(S.RELEASED, None)
            self._state = S.RELEASED
        self._free_blocks()
        return True

    # --- any thread -----------------------------------------------------------------------------------------
    def pin(self, expect: LeaseState, to: LeaseState) -> None:
        """Take the pin: `expect` -> `to` (HELD -> PUSHING, RESERVED -> RECEIVING). IllegalTransition when the
        lease moved on (released by an abort, already receiving): then the caller must not use the blocks."""
        assert to in _PINNED
        with self._lock:
            self._check(to, frozenset({expect}))
            self._state = to

    def unpin(self, to: LeaseState) -> bool:
        """Drop the pin: -> `to`. Returns True when a release was requested meanwhile: the caller then has the
        engine release the lease (and must not let the request go on)."""
        with self._lock:
            assert self._state in _PINNED, f"{self.request_id}: unpin while {self._state.value}"
            self._check(to, None)
            self._state = to
            return self._release_requested

    def _free_blocks(self) -> None:
        self._kv.free(self.seq)  # the one call site of KVCacheManager.free

    def _check(self, to: LeaseState, expect: frozenset[LeaseState] | None) -> None:
        if to not in _TRANSITIONS[self._state] or (expect is not None and self._state not in expect):
            raise IllegalTransition(f"request {self.request_id!r}: blocks cannot go from {self._state.value} "
                                    f"to {to.value}")
