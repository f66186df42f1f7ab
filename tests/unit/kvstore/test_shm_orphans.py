"""Orphaned shared-memory segments: only a dead creator's old segments are removed (a temp dir stands in for
/dev/shm, so no real segment of a running test is at risk)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from kvstore.shm import SEGMENT_PREFIX, remove_orphaned_segments


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def touch(directory, name: str, age_s: float):
    path = directory / name
    path.write_bytes(b"")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_only_old_segments_of_dead_creators_are_removed(tmp_path):
    dead, alive = dead_pid(), os.getpid()
    old_dead = touch(tmp_path, f"{SEGMENT_PREFIX}{dead:x}_aaaa", 3600)
    young_dead = touch(tmp_path, f"{SEGMENT_PREFIX}{dead:x}_bbbb", 1)
    old_alive = touch(tmp_path, f"{SEGMENT_PREFIX}{alive:x}_cccc", 3600)
    not_ours = touch(tmp_path, "psm_12345", 3600)
    malformed = touch(tmp_path, f"{SEGMENT_PREFIX}zz_dddd", 3600)
    assert remove_orphaned_segments(tmp_path, min_age_s=600) == [old_dead.name]
    assert not old_dead.exists()
    assert all(p.exists() for p in (young_dead, old_alive, not_ours, malformed))


def test_no_shm_directory_is_a_no_op(tmp_path):
    assert remove_orphaned_segments(tmp_path / "missing") == []
