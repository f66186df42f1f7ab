"""Pinned workers lend each other their CPUs while their engines are idle, one step at a time.

On a machine split between pinned workers (`pdserve up --pin-workers`), a prefill worker has only its own
cores and a decode worker only its own, while each one's cores idle between its bursts of work. `pdserve up
--pin-workers --lend-idle-cpus` lets each use the other's idle cores, without waiting for the other:

    lending    a worker holds an exclusive flock on a lock file (its `--busy-lock`) from the first step of a burst
               of work until its engine has nothing left (BusyLock, EngineLoop's activity hook);
    borrowing  before each step, a worker tries a shared flock on its partner's file without waiting
               (`--borrow-lock`) and drops it at once (CpuBorrower): free, the partner is idle, and the step runs
               on its own CPUs and the partner's (`--borrow-cpus`), one torch thread per CPU; held, on its own.

CpuShare does both for one worker, taking its own lock before it tests the partner's, so that two partners that
start work together never both borrow. So cores are borrowed a step at a time, and a worker that gets work while
its partner runs a borrowed step shares its cores with one of the partner's threads until that step ends (bound
a prefill step with --max-num-batched-tokens; a decode step is short). Nothing waits on a lock: a worker takes
its own (a held shared lock lasts the few microseconds of a test) and only tests its partner's. A worker that
dies drops its lock with its file descriptor; one that never started leaves it free. A borrowing process loads
libgomp on both sets of CPUs, with short spinning (pdserve.affinity.pin_process `borrowed=`): loaded on its own
CPUs, libgomp put the borrowed step's threads to sleep after every parallel region; spinning for libgomp's
default time, an idle thread kept the partner's core after the borrowed step.

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
    """The lending side: `activity(True)` takes the exclusive lock (if not held), `activity(False)` drops it.
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
    """The borrowing side: `activity(True)` before each step sets the calling (loop) thread's CPUs and torch
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


class CpuShare:
    """One worker's side of lending, on its engine loop's thread (EngineLoop.set_activity_hook): it holds its own
    busy lock while its engine has work (`busy_lock`: its CPUs are lent), and it borrows its partner's CPUs while
    the partner's lock is free (`borrow_cpus`, `borrow_lock`). Its own lock is taken before the partner's is tested,
    so two partners that start work together never both borrow. `steps` is the borrower's (None: no borrowing)."""

    def __init__(self, busy_lock: str | None = None, own_cpus: Sequence[int] = (), borrow_cpus: Sequence[int] = (),
                 borrow_lock: str | None = None) -> None:
        if bool(borrow_cpus) != bool(borrow_lock):
            raise ValueError("CpuShare: borrow_cpus and borrow_lock go together")
        self._borrower = CpuBorrower(borrow_lock, own_cpus, borrow_cpus) if borrow_lock else None
        self._busy = BusyLock(busy_lock) if busy_lock else None
        self.steps = self._borrower.steps if self._borrower is not None else None

    def activity(self, busy: bool) -> None:
        if self._busy is not None:
            self._busy.activity(busy)
        if self._borrower is not None:
            self._borrower.activity(busy)

    def close(self) -> None:
        for part in (self._busy, self._borrower):
            if part is not None:
                part.close()
