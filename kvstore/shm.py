"""Same-host KV data path over POSIX shared memory (multiprocessing.shared_memory).

Lifecycle of one transfer (the grpc stream carries only the manifest, naming the segment):

    sender    OutgoingSegment(n)  creates "pdkv_<pid>_<random>" (unique per transfer), writes the payload
    sender    Push(manifest{transport="shm", shm_name})
    receiver  attach_segment(name) maps it, verifies digests, scatters straight from it, closes (never unlinks)
    sender    unlinks once Push returns, whatever happened (OutgoingSegment is a context manager)

Only the creator tracks the segment with Python's resource_tracker, so a crashed sender's segment is still
removed when its tracker exits. A SIGKILL that lands between creating a segment and registering it (or that
takes the tracker too) leaves it behind: `remove_orphaned_segments`, run when a prefill worker starts, unlinks
the ones whose creator is gone. The receiver maps the segment without registering it (``track=False`` on
Python >= 3.13; a direct shm_open + mmap before): on 3.10-3.12 ``SharedMemory(name)`` registers every attach,
and unregistering afterwards is wrong when sender and receiver share one tracker (one process, or children of
one multiprocessing parent): it would drop the sender's registration and make its unlink warn.

The sender picks the shm transport only when the target's ``host_id()`` equals its own (``choose_transport``);
the choice is explicit and reported, a receiver that cannot open the segment rejects the transfer.
"""
from __future__ import annotations

import functools
import mmap
import os
import platform
import secrets
import socket
import sys
import time
import uuid
from pathlib import Path
from multiprocessing import shared_memory

import torch

SEGMENT_PREFIX = "pdkv_"


SHM_DIR = Path("/dev/shm")
ORPHAN_MIN_AGE_S = 600.0
"""A segment is only ever removed as orphaned when older than this (a transfer takes seconds)."""


def new_segment_name() -> str:
    # Short: macOS caps POSIX shm names at 31 bytes.
    return f"{SEGMENT_PREFIX}{os.getpid():x}_{secrets.token_hex(6)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # alive, another user's
        return True
    return True


def remove_orphaned_segments(shm_dir: Path = SHM_DIR, min_age_s: float = ORPHAN_MIN_AGE_S) -> list[str]:
    """Unlink the segments ("pdkv_<creator pid>_<random>") whose creator is not running and that are older than
    `min_age_s`; returns their names. The age guard keeps a live sender safe when its pid means another process
    here (a container with its own pid namespace sharing this /dev/shm). Where shared memory is not a directory
    of files (not Linux) it does nothing."""
    if not shm_dir.is_dir():
        return []
    removed = []
    now = time.time()
    for path in shm_dir.glob(SEGMENT_PREFIX + "*"):
        pid_hex, sep, _ = path.name[len(SEGMENT_PREFIX):].partition("_")
        try:
            pid = int(pid_hex, 16)
            age_s = now - path.stat().st_mtime
        except (ValueError, OSError):    # not one of ours, or gone meanwhile
            continue
        if not sep or age_s < min_age_s or _pid_alive(pid):
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:                  # removed meanwhile, or not ours to remove
            pass
    return removed


class OutgoingSegment:
    """A sender-owned segment of `nbytes` (the payload). Unlinked by close(), which is idempotent."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.nbytes = nbytes
        while True:
            try:  # a zero-byte segment cannot be mapped; an empty payload still gets a (1-byte) segment
                self._shm = shared_memory.SharedMemory(name=new_segment_name(), create=True, size=max(1, nbytes))
                break
            except FileExistsError:
                continue
        self.name = self._shm.name
        self._closed = False

    def write(self, offset: int, data) -> None:
        """Copy `data` (bytes-like, or a 1-D uint8 CPU tensor) to payload offset `offset`."""
        view = memoryview(data.numpy() if isinstance(data, torch.Tensor) else data).cast("B")
        if offset < 0 or offset + len(view) > self.nbytes:
            raise ValueError(f"write of {len(view)} bytes at {offset} overflows the {self.nbytes}-byte payload")
        self._shm.buf[offset:offset + len(view)] = view

    def flip_byte(self, offset: int) -> None:
        """Test hook: invert one payload byte."""
        self._shm.buf[offset] ^= 0xFF

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._shm.close()
        finally:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> OutgoingSegment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AttachedSegment:
    """A receiver's read/write mapping of a sender's segment; never unlinks, never registers it for cleanup."""

    def __init__(self, name: str) -> None:
        self.name = name
        if sys.version_info >= (3, 13):
            self._shm = shared_memory.SharedMemory(name=name, track=False)
            self._mmap = None
            self.buf = self._shm.buf
        elif os.name == "posix":
            import _posixshmem  # what SharedMemory itself uses

            self._shm = None
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
            try:
                self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            self.buf = memoryview(self._mmap)
        else:  # Windows: no resource tracker for shared memory
            self._shm = shared_memory.SharedMemory(name=name)
            self._mmap = None
            self.buf = self._shm.buf

    @property
    def size(self) -> int:
        """Mapped bytes (may exceed the payload: sizes round up to pages on some systems)."""
        return len(self.buf)

    def close(self) -> None:
        """Unmap. While tensors still view the mapping (e.g. held by an exception's traceback) the unmap is
        left to garbage collection instead of raising."""
        try:
            self.buf.release()
            if self._shm is not None:
                self._shm.close()
            else:
                self._mmap.close()
        except BufferError:
            pass

    def __enter__(self) -> AttachedSegment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def attach_segment(name: str) -> AttachedSegment:
    """Map the sender's segment `name`. FileNotFoundError when there is none on this host."""
    return AttachedSegment(name)


def segment_exists(name: str) -> bool:
    try:
        attach_segment(name).close()
    except FileNotFoundError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """Identity of the shared-memory domain this process lives in: equal for two processes exactly when one
    can open the other's segments. Linux: the kernel's boot id (one per machine and boot) and the device of
    the /dev/shm mount (containers without a shared /dev/shm differ). Elsewhere: hostname and MAC address."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot_id = f.read().strip()
            return f"linux:{boot_id}:{os.stat('/dev/shm').st_dev:x}"
        except OSError:
            pass
    return f"{platform.system().lower()}:{socket.gethostname()}:{uuid.getnode():x}"


def choose_transport(target_host_id: str, *, allow_shm: bool = True) -> str:
    """"shm" when the target shares this host's shared memory (and shm is allowed), else "grpc"."""
    return "shm" if allow_shm and target_host_id and target_host_id == host_id() else "grpc"
