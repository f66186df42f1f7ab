"""A decode worker's CPUs lent to a prefill worker while its engine is idle, one step at a time.

On a machine split between pinned workers (`pdserve up --pin-workers`), a prefill worker has only its own
cores, while the decode worker's cores idle between its bursts of work. `pdserve up --pin-workers
--lend-idle-cpus` lets prefill use them then, without letting it slow a decode step:

    decode worker   holds an exclusive flock on a lock file (its `--busy-lock`) from the first step of a burst
                    of work until its engine has nothing left (BusyLock, EngineLoop's activity hook);
    prefill worker  before each step, tries a shared flock on that file without waiting (`--borrow-lock`) and
                    drops it at once (CpuBorrower): free, the decode worker is idle, and the step runs on its own
                    CPUs and the lent ones (`--borrow-cpus`), one torch thread per CPU; held, on its own.

So the lent cores are borrowed a step at a time, and a decode worker that gets work while a borrowed step runs
shares its core with one prefill thread until that step ends (bound it with --max-num-batched-tokens); the
next step is the prefill worker's own again. Nothing waits on the lock: the decode worker takes it (a held
shared lock lasts the few microseconds of the test), the prefill worker only tests it. A decode worker that dies
drops its lock with its file descriptor; one that never started leaves it free.

Why not the kernel's idle scheduling class (SCHED_IDLE) for the prefill worker on every core: a prefill step's
parallel regions wait for each of their threads, and a thread parked behind a busy decode worker stalls every
region until the kernel moves it (bench/bench_cpu_lending.py: a 1024-token prefill took 6.9x its one-core time
beside a decode worker that never idled, where a borrowing one took 0.98x; 0.52x with the decode worker idle).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence

from engine.engine_loop import set_thread_torch_threads

def _open_lock(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


class BusyLock:
    """The decode side: `activity(True)` takes the exclusive lock (if not held), `activity(False)` drops it.
    On the engine loop's thread (EngineLoop.set_activity_hook)."""

    def __init__(self, path: str) -> None:
        self._fd = _open_lock(path)
        self._held = False

    def activity(self, busy: bool) -> None:
        if busy != self._held:
            fcntl.flock(self._fd, fcntl.LOCK_EX if busy else fcntl.LOCK_UN)
            self._held = busy

    def close(self) -> None:
        os.close(self._fd)  # drops the lock


class CpuBorrower:
    """The prefill side: `activity(True)` before each step sets the calling (loop) thread's CPUs and torch
    threads to its own plus the lent ones when the lock is free, else to its own."""

    def __init__(self, path: str, own_cpus: Sequence[int], lent_cpus: Sequence[int]) -> None:
        if not own_cpus or not lent_cpus:
            raise ValueError("CpuBorrower needs CPUs of its own and CPUs to borrow")
        if set(own_cpus) & set(lent_cpus):
            raise ValueError(f"CpuBorrower: CPUs {sorted(set(own_cpus) & set(lent_cpus))} are both its own and lent")
        self._fd = _open_lock(path)
        self._own = frozenset(own_cpus)
        self._all = frozenset(own_cpus) | frozenset(lent_cpus)
        self._current: frozenset[int] | None = None
        self.steps = {"own": 0, "borrowed": 0}
        """Steps run on the worker's own CPUs, and on its own plus the lent ones."""

    def lender_idle(self) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return True

    def activity(self, busy: bool) -> None:
        if not busy:
            return
        cpus = self._all if self.lender_idle() else self._own
        self.steps["borrowed" if cpus is self._all else "own"] += 1
        if cpus is not self._current:
            # The loop thread's own mask: torch's OpenMP threads started from it inherit the wider one, and sleep
            # between regions while it steps on its own CPUs.
            os.sched_setaffinity(0, cpus)
            set_thread_torch_threads(len(cpus))
            self._current = cpus

    def close(self) -> None:
        os.close(self._fd)
