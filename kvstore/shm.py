"""Same-host KV data path over POSIX shared memory (multiprocessing.shared_memory).

Lifecycle of one transfer (the grpc stream carries only the manifest, naming the segment):

    sender    OutgoingSegment(n, request_id=, handle=) creates "pdkv_<pid>_<token>_<random>", writes the payload
    sender    Push(manifest{transport="shm", shm_name})
    receiver  take_segment(name, request_id=, handle=) checks and maps it, unlinks its name, verifies digests,
              scatters straight from the mapping, closes
    sender    unlinks once Push returns, whatever happened (OutgoingSegment is a context manager; a name the
              receiver already took is fine)

What the receiver accepts (the manifest is the caller's word; the segment must be one this host's prefill worker
made for this reservation). Every refusal is a SegmentRefused naming the reason:

    name      exactly SEGMENT_NAME_PATTERN: the prefix, lowercase hex fields, no "/", no "..", no path
    binding   <token> == reservation_token(request_id, handle) of the reservation the manifest was checked
              against: a Push cannot name a segment made for another transfer
    opening   /dev/shm/<name> with O_NOFOLLOW (a symbolic link is refused) and O_NONBLOCK (a FIFO cannot
              block the handler); then fstat: a regular file, one link, owned by our effective uid, mode 0600,
              not empty
    once      take_segment unlinks the name as soon as the checked file is mapped: it cannot be read twice
``attach_segment(name)`` makes the same name and file checks without the binding and without unlinking.

Only the creator tracks the segment with Python's resource_tracker, so a crashed sender's segment is still
removed when its tracker exits. A SIGKILL that lands between creating a segment and registering it (or that
takes the tracker too) leaves it behind: `remove_orphaned_segments`, run when a prefill worker starts, unlinks
the ones whose creator is gone. The receiver maps the file descriptor it checked (a private copy-on-write
mapping: it never writes the sender's pages) and never registers it with a resource tracker.

The prefill worker picks the shm transport only when the target's ``host_id()`` equals its own; the choice is
explicit and reported, and a receiver that cannot open the segment rejects the transfer.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import mmap
import os
import platform
import re
import secrets
import socket
import stat
import sys
import time
import uuid
from pathlib import Path
from multiprocessing import resource_tracker, shared_memory

import torch

SEGMENT_PREFIX = "pdkv_"
SEGMENT_NAME_PATTERN = re.compile(r"pdkv_[0-9a-f]{1,8}_[0-9a-f]{10}_[0-9a-f]{6}")
"""<prefix><creator pid>_<reservation token>_<random>; at most 30 characters (macOS caps names at 31 with "/")."""
TOKEN_HEX_CHARS = 10

SHM_DIR = Path("/dev/shm")
ORPHAN_MIN_AGE_S = 600.0
"""A segment is only ever removed as orphaned when older than this (a transfer takes seconds)."""


class SegmentRefused(FileNotFoundError):
    """A named segment this receiver will not read: not one this host's sender made for the reservation.
    A FileNotFoundError, so code that treats "no usable segment" as a missing one fails closed."""


def reservation_token(request_id: str, handle: str) -> str:
    """The segment-name field that binds a segment to one reservation (request id and transfer handle)."""
    digest = hashlib.sha256(b"pdserve-shm-v1\0" + request_id.encode() + b"\0" + handle.encode()).hexdigest()
    return digest[:TOKEN_HEX_CHARS]


def new_segment_name(request_id: str = "", handle: str = "") -> str:
    return f"{SEGMENT_PREFIX}{os.getpid():x}_{reservation_token(request_id, handle)}_{secrets.token_hex(3)}"


def check_segment_name(name: str, *, request_id: str | None = None, handle: str | None = None) -> None:
    """SegmentRefused unless `name` has the segment form (and, given the reservation, is bound to it)."""
    if not isinstance(name, str) or not SEGMENT_NAME_PATTERN.fullmatch(name):
        raise SegmentRefused(f"invalid segment name {name!r}: expected {SEGMENT_NAME_PATTERN.pattern}")
    if request_id is not None or handle is not None:
        token = name.split("_")[2]
        if token != reservation_token(request_id or "", handle or ""):
            raise SegmentRefused(f"segment {name!r} was made for another reservation")


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
            age_s = now - path.lstat().st_mtime
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
    """A sender-owned segment of `nbytes` (the payload) for the reservation (`request_id`, `handle`). Unlinked
    by close(), which is idempotent."""

    def __init__(self, nbytes: int, *, request_id: str = "", handle: str = "") -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.nbytes = nbytes
        while True:
            try:  # a zero-byte segment cannot be mapped; an empty payload still gets a (1-byte) segment
                self._shm = shared_memory.SharedMemory(name=new_segment_name(request_id, handle), create=True,
                                                       size=max(1, nbytes))
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

    def payload(self, nbytes: int | None = None) -> torch.Tensor:
        """The payload as a [nbytes] uint8 tensor viewing the segment (drop it before close)."""
        count = self.nbytes if nbytes is None else nbytes
        if count > self.nbytes:
            raise ValueError(f"payload of {count} bytes asked from a {self.nbytes}-byte segment")
        if count == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=count)

    def flip_byte(self, offset: int) -> None:
        """Test hook: invert one payload byte."""
        self._shm.buf[offset] ^= 0xFF

    def release(self, *, reusable: bool) -> None:
        """The sender's end of a transfer (as kvstore.shm_pool.PooledSegment.release): a one-shot segment is
        never reused, so this is close()."""
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._shm.close()
        except BufferError:  # a tensor still views it (an exception's traceback): unmapped when collected
            pass
        finally:
            try:
                self._shm.unlink()
            except FileNotFoundError:  # the receiver took the name: only the tracker still holds it
                if os.name == "posix":
                    resource_tracker.unregister("/" + self.name, "shared_memory")

    def __enter__(self) -> OutgoingSegment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _refuse_unless(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise SegmentRefused(f"segment {name!r} refused: {why}")


def open_checked(name: str) -> tuple[int, os.stat_result]:
    """A read-only descriptor of segment `name`, after the file checks of the module doc; FileNotFoundError
    (plain) when there is no such segment."""
    if os.name != "posix":
        raise SegmentRefused("shared-memory transfers need POSIX shared memory")
    if SHM_DIR.is_dir():
        try:
            fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SegmentRefused(f"segment {name!r} refused: a symbolic link") from None
            raise
    else:  # shared memory that is not a directory of files (macOS): no links to follow
        import _posixshmem

        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    try:
        st = os.fstat(fd)
        _refuse_unless(stat.S_ISREG(st.st_mode), name, "not a regular file")
        _refuse_unless(st.st_nlink <= 1, name, f"{st.st_nlink} hard links")
        _refuse_unless(st.st_uid == os.geteuid(), name, f"owned by uid {st.st_uid}, not {os.geteuid()}")
        _refuse_unless(stat.S_IMODE(st.st_mode) == 0o600, name, f"mode {stat.S_IMODE(st.st_mode):04o}, not 0600")
        _refuse_unless(st.st_size > 0, name, "empty")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


class AttachedSegment:
    """A receiver's private mapping of a sender's checked segment; never registered for cleanup."""

    def __init__(self, name: str, *, take: bool = False) -> None:
        self.name = name
        fd, st = open_checked(name)
        try:
            mapping = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        if take:
            try:
                _unlink_same(name, st)
            except BaseException:
                mapping.close()
                raise
        self._mmap = mapping
        self.buf = memoryview(mapping)

    @property
    def size(self) -> int:
        """Mapped bytes (may exceed the payload: sizes round up to pages on some systems)."""
        return len(self.buf)

    def close(self) -> None:
        """Unmap. While tensors still view the mapping (e.g. held by an exception's traceback) the unmap is
        left to garbage collection instead of raising."""
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            pass

    def __enter__(self) -> AttachedSegment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unlink_same(name: str, opened: os.stat_result) -> None:
    """Unlink `name` if it still names the file that was checked (only our uid can replace it: /dev/shm is
    sticky); SegmentRefused if it was replaced meanwhile."""
    if SHM_DIR.is_dir():
        path = SHM_DIR / name
        now = os.stat(path, follow_symlinks=False)
        _refuse_unless((now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino), name, "replaced while opening")
        os.unlink(path)
    else:
        import _posixshmem

        _posixshmem.shm_unlink("/" + name)


def take_segment(name: str, *, request_id: str, handle: str) -> AttachedSegment:
    """The receiver's one way in: map the segment `name` that the manifest of reservation (`request_id`,
    `handle`) announces, after every check of the module doc, and unlink its name. SegmentRefused (with the
    reason) when it is not acceptable; FileNotFoundError when there is no such segment on this host."""
    check_segment_name(name, request_id=request_id, handle=handle)
    return AttachedSegment(name, take=True)


def attach_segment(name: str) -> AttachedSegment:
    """Map the segment `name` after the name and file checks (no reservation binding, no unlink).
    SegmentRefused when it is not acceptable; FileNotFoundError when there is none on this host."""
    check_segment_name(name)
    return AttachedSegment(name)


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
