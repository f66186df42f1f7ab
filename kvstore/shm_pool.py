"""Pooled shared-memory segments: the same-host KV data path without a fresh segment per transfer.

A fresh segment costs a page fault per 4 KiB page on each side (the sender's first write allocates the tmpfs
pages, the receiver's first read maps them) and that, not the copy, was most of a same-host transfer. A prefill
worker therefore keeps a bounded ``SegmentPool`` of pre-faulted segments, gathers blocks straight into one
(kernels.gather_blocks(out=)), and the decode worker keeps each segment mapped (``PooledSegmentReader``) and
scatters straight out of the mapping. kvstore/shm.py's one-shot segments stay the path of a sender without a pool.

Segment: ``pdkv_<creator pid>_pool_<random>``, HEADER_BYTES of header, then the payload (page aligned):

    magic          8 bytes   b"PDKVPOOL"
    token          10 bytes  kvstore.shm.reservation_token of the transfer using the segment; zeros while idle
    (padding)      6 bytes
    payload_bytes  8 bytes   little-endian: bytes of the current payload

Sender lifecycle (one owner, one release per acquire):

    pool.acquire(nbytes, request_id=, handle=) ─▶ PooledSegment, header stamped with the reservation's token:
        the smallest idle segment that fits, else a new pre-faulted one; to stay within max_bytes the pool
        unlinks idle segments, then waits (up to timeout_s) for one in use to come back
    gather into segment.payload(nbytes); Push(manifest{shm_name})
    segment.release(reusable=True)   the receiver committed (it has stopped reading): token cleared, idle again
    segment.release(reusable=False)  any other end (rejection, deadline, cancel, exception): unlinked, since a
                                     receiver still running must never see the next transfer's bytes
    pool.close()                     unlinks every segment (worker shutdown)

A dead sender's segments go with its resource tracker (the creator registers each one), and if that dies too,
with kvstore.shm.remove_orphaned_segments at the next start (same prefix and pid field).

Receiver: only names of the pooled form; on every transfer the file checks of kvstore.shm (regular file, one
link, our uid, mode 0600, no symlink, no FIFO), then the header must carry this reservation's token and the
manifest's payload_bytes (else SegmentRefused naming why). Mappings are private and never written, never
unlinked, kept per (name, inode) in a small LRU; one whose name is gone or now names another file is unmapped.
The same reader keeps the mappings of senders' KV cache segments (kvstore.shm_cache, through attach()).
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import torch

from kvstore.shm import SEGMENT_PREFIX, SHM_DIR, SegmentRefused, open_checked, reservation_token

POOLED_NAME_PATTERN = re.compile(r"pdkv_[0-9a-f]{1,8}_pool_[0-9a-f]{8}")
HEADER_BYTES = 4096
MAGIC = b"PDKVPOOL"
_HEADER = struct.Struct("<8s10s6xQ")  # magic, token, payload_bytes
_IDLE_TOKEN = b"\0" * 10
PAGE_BYTES = mmap.PAGESIZE
MIN_CAPACITY = 4 << 20
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_READER_MAPPINGS = 8


class SegmentPoolExhausted(TimeoutError):
    """Every pooled byte is in use by other transfers and none came back in time."""


def is_pooled_name(name: str) -> bool:
    return isinstance(name, str) and POOLED_NAME_PATTERN.fullmatch(name) is not None


def _capacity_for(nbytes: int) -> int:
    """Segment size for a payload: the header plus the payload rounded up to a power of two (>= 4 MiB), so that
    payloads of similar size share segments."""
    return HEADER_BYTES + max(MIN_CAPACITY, 1 << max(0, (nbytes - 1).bit_length()))


class PooledSegment:
    """One pooled segment, owned by one transfer between acquire and release."""

    def __init__(self, pool: SegmentPool, shm: shared_memory.SharedMemory) -> None:
        self._pool = pool
        self._shm = shm
        self.name = shm.name
        self.capacity = shm.size
        self.nbytes = 0
        self.in_use = False

    def _stamp(self, token: bytes, nbytes: int) -> None:
        self._shm.buf[:_HEADER.size] = _HEADER.pack(MAGIC, token, nbytes)
        self.nbytes = nbytes

    def payload(self, nbytes: int | None = None) -> torch.Tensor:
        """The payload area as a [nbytes] uint8 tensor viewing the segment (drop it before release)."""
        count = self.nbytes if nbytes is None else nbytes
        if count > self.nbytes:
            raise ValueError(f"payload of {count} bytes asked from a {self.nbytes}-byte transfer")
        if count == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=count, offset=HEADER_BYTES)

    def write(self, offset: int, data) -> None:
        """Copy `data` (bytes-like, or a 1-D uint8 CPU tensor) to payload offset `offset`."""
        view = memoryview(data.numpy() if isinstance(data, torch.Tensor) else data).cast("B")
        if offset < 0 or offset + len(view) > self.nbytes:
            raise ValueError(f"write of {len(view)} bytes at {offset} overflows the {self.nbytes}-byte payload")
        start = HEADER_BYTES + offset
        self._shm.buf[start:start + len(view)] = view

    def flip_byte(self, offset: int) -> None:
        """Test hook: invert one payload byte."""
        self._shm.buf[HEADER_BYTES + offset] ^= 0xFF

    def release(self, *, reusable: bool) -> None:
        """End this transfer's use: back to the pool (reusable: the receiver has stopped reading) or unlinked."""
        self._pool._release(self, reusable)

    def _unlink(self) -> None:
        try:
            self._shm.unlink()
        except FileNotFoundError:  # removed behind our back: only the tracker still holds it
            resource_tracker.unregister("/" + self.name, "shared_memory")
        try:
            self._shm.close()
        except BufferError:  # a tensor still views it (an exception's traceback): unmapped when collected
            pass


@dataclass
class PoolStats:
    num_segments: int
    num_in_use: int
    total_bytes: int
    num_created: int
    num_reused: int


class SegmentPool:
    """Bounded pool of pre-faulted segments (`max_bytes` of segments at most, in use or idle). Thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < _capacity_for(1):
            raise ValueError(f"max_bytes must be >= {_capacity_for(1)}, got {max_bytes}")
        self.max_bytes = max_bytes
        self._segments: list[PooledSegment] = []   # idle and in use, oldest first
        self._reserved_bytes = 0                    # capacities of segments being created
        self._cond = threading.Condition()
        self._closed = False
        self.num_created = 0
        self.num_reused = 0

    def acquire(self, nbytes: int, *, request_id: str, handle: str, timeout_s: float = 30.0) -> PooledSegment:
        """A segment holding `nbytes` of payload for the reservation (`request_id`, `handle`). Raises ValueError
        (a payload larger than the pool) or SegmentPoolExhausted (nothing came back within `timeout_s`)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        need = _capacity_for(nbytes)
        if need > self.max_bytes:
            raise ValueError(f"a {nbytes}-byte payload needs a {need}-byte segment, more than the shared-memory "
                             f"pool's max_bytes {self.max_bytes}")
        token = reservation_token(request_id, handle).encode()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the segment pool is closed")
                idle = [s for s in self._segments if not s.in_use and s.capacity >= need]
                if idle:
                    segment = min(idle, key=lambda s: s.capacity)
                    segment.in_use = True
                    segment._stamp(token, nbytes)
                    self.num_reused += 1
                    return segment
                while self._total_bytes() + need > self.max_bytes and self._evict_one_idle():
                    pass
                if self._total_bytes() + need <= self.max_bytes:
                    self._reserved_bytes += need
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SegmentPoolExhausted(f"shared-memory pool: {self._total_bytes()} of {self.max_bytes} "
                                               f"bytes in use, none free for {nbytes} bytes within {timeout_s} s")
                self._cond.wait(left)
        try:
            segment = self._create(need)
        except BaseException:
            with self._cond:
                self._reserved_bytes -= need
                self._cond.notify_all()
            raise
        segment.in_use = True
        segment._stamp(token, nbytes)
        with self._cond:
            self._reserved_bytes -= need
            self._segments.append(segment)
            self.num_created += 1
            if self._closed:  # closed while we created it
                self._segments.remove(segment)
                segment._unlink()
                raise RuntimeError("the segment pool is closed")
        return segment

    def _create(self, capacity: int) -> PooledSegment:
        if SHM_DIR.is_dir():  # touching a page past the tmpfs size would kill us with SIGBUS: refuse first
            fs = os.statvfs(SHM_DIR)
            if capacity > fs.f_bavail * fs.f_frsize:
                raise OSError(errno.ENOSPC, f"{SHM_DIR} has {fs.f_bavail * fs.f_frsize} bytes free, a {capacity}-byte "
                              "KV segment does not fit (give the container more shared memory, or lower "
                              "--shm-pool-bytes)")
        while True:
            name = f"{SEGMENT_PREFIX}{os.getpid():x}_pool_{secrets.token_hex(4)}"
            try:
                shm = shared_memory.SharedMemory(name=name, create=True, size=capacity)
                break
            except FileExistsError:
                continue
        try:
            # Pre-fault: touch every page now, so that no transfer pays the tmpfs allocation.
            torch.frombuffer(shm.buf, dtype=torch.uint8)[::PAGE_BYTES].zero_()
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        return PooledSegment(self, shm)

    def _total_bytes(self) -> int:
        return sum(s.capacity for s in self._segments) + self._reserved_bytes

    def _evict_one_idle(self) -> bool:
        """Under the lock: unlink the oldest idle segment; False when none is idle."""
        for segment in self._segments:
            if not segment.in_use:
                self._segments.remove(segment)
                segment._unlink()
                return True
        return False

    def _release(self, segment: PooledSegment, reusable: bool) -> None:
        with self._cond:
            assert segment.in_use and segment in self._segments, f"segment {segment.name} released twice"
            segment.in_use = False
            if reusable and not self._closed:
                segment._stamp(_IDLE_TOKEN, 0)
            else:
                self._segments.remove(segment)
                segment._unlink()
            self._cond.notify_all()

    def stats(self) -> PoolStats:
        with self._cond:
            return PoolStats(len(self._segments), sum(s.in_use for s in self._segments), self._total_bytes(),
                             self.num_created, self.num_reused)

    def segment_names(self) -> list[str]:
        with self._cond:
            return [s.name for s in self._segments]

    def close(self) -> None:
        """Unlink the idle segments now; those in use are unlinked at their release."""
        with self._cond:
            self._closed = True
            for segment in [s for s in self._segments if not s.in_use]:
                self._segments.remove(segment)
                segment._unlink()
            self._cond.notify_all()

    def __enter__(self) -> SegmentPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------- receiving
class _Mapping:
    def __init__(self, name: str, st: os.stat_result, mapping: mmap.mmap) -> None:
        self.name = name
        self.key = (st.st_dev, st.st_ino)
        self.mmap = mapping
        self.buf = memoryview(mapping)
        self.readers = 0
        self.stamp = b""

    def close(self) -> None:
        try:
            self.buf.release()
            self.mmap.close()
        except BufferError:  # a tensor still views it: unmapped when collected
            pass


class PooledSegmentReader:
    """The receiver's mappings of pooled segments, at most `max_mappings` kept. Thread-safe."""

    def __init__(self, max_mappings: int = DEFAULT_READER_MAPPINGS) -> None:
        self.max_mappings = max_mappings
        self._mappings: dict[str, _Mapping] = {}  # LRU order: least recently used first
        self._lock = threading.Lock()
        self.num_mapped = 0

    def open(self, name: str, *, request_id: str, handle: str, payload_bytes: int) -> PooledPayload:
        """The payload of pooled segment `name` for reservation (`request_id`, `handle`), after every check of
        the module doc. SegmentRefused with the reason; FileNotFoundError when there is no such segment."""
        if not is_pooled_name(name):
            raise SegmentRefused(f"invalid pooled segment name {name!r}: expected {POOLED_NAME_PATTERN.pattern}")
        entry = self.attach(name)
        try:
            magic, token, announced = _HEADER.unpack_from(entry.buf)
            if magic != MAGIC:
                raise SegmentRefused(f"segment {name!r} refused: not a pooled KV segment")
            if token != reservation_token(request_id, handle).encode():
                raise SegmentRefused(f"segment {name!r} refused: it holds no payload of this reservation")
            if announced != payload_bytes or HEADER_BYTES + payload_bytes > len(entry.buf):
                raise SegmentRefused(f"segment {name!r} refused: holds {announced} payload bytes in "
                                     f"{len(entry.buf) - HEADER_BYTES}, the manifest announces {payload_bytes}")
        except BaseException:
            self.done(entry)
            raise
        return PooledPayload(self, entry, payload_bytes)

    def attach(self, name: str, stamp: bytes = b"") -> _Mapping:
        """The kept mapping of segment `name` (of a form the caller checked), after the file checks of
        kvstore.shm, mapped again when the name now means another file or the caller's `stamp` (what it read in
        the header last time, e.g. kvstore.shm_cache's epoch) changed. The caller reads it, then calls done()."""
        fd, st = open_checked(name)
        try:
            with self._lock:
                self._prune()
                entry = self._mappings.pop(name, None)
                if entry is not None and (entry.key != (st.st_dev, st.st_ino) or entry.stamp != stamp):
                    self._drop(entry)
                    entry = None
                if entry is None:
                    entry = _Mapping(name, st, mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY))
                    entry.stamp = stamp
                    self.num_mapped += 1
                self._mappings[name] = entry
                entry.readers += 1
        finally:
            os.close(fd)
        return entry

    def prune(self) -> None:
        """Unmap the mappings of segments that are gone (their pages stay allocated while mapped)."""
        with self._lock:
            self._prune(room_for_one=False)

    def _prune(self, room_for_one: bool = True) -> None:
        """Under the lock: unmap entries whose name is gone or names another file, then the least recently used
        beyond max_mappings (one fewer when one is about to be added); entries being read stay."""
        for name, entry in list(self._mappings.items()):
            try:
                st = os.stat(SHM_DIR / name, follow_symlinks=False)
                stale = (st.st_dev, st.st_ino) != entry.key
            except OSError:
                stale = True
            if stale and entry.readers == 0:
                self._drop(self._mappings.pop(name))
        idle = [n for n, e in self._mappings.items() if e.readers == 0]
        for name in idle[:max(0, len(self._mappings) - self.max_mappings + room_for_one)]:
            self._drop(self._mappings.pop(name))

    @staticmethod
    def _drop(entry: _Mapping) -> None:
        if entry.readers == 0:
            entry.close()

    def done(self, entry: _Mapping) -> None:
        """The end of one read of `entry` (from attach)."""
        with self._lock:
            entry.readers -= 1
            if entry.readers == 0 and self._mappings.get(entry.name) is not entry:
                entry.close()

    def num_mappings(self) -> int:
        with self._lock:
            return len(self._mappings)

    def close(self) -> None:
        with self._lock:
            for entry in self._mappings.values():
                self._drop(entry)
            self._mappings.clear()


class PooledPayload:
    """One transfer's read of a pooled segment; a context manager (the mapping stays cached)."""

    def __init__(self, reader: PooledSegmentReader, entry: _Mapping, payload_bytes: int) -> None:
        self._reader = reader
        self._entry = entry
        self.buf = entry.buf[HEADER_BYTES:HEADER_BYTES + payload_bytes]  # [payload_bytes] of the mapping

    def close(self) -> None:
        try:
            self.buf.release()
        except BufferError:  # a tensor still views it (an exception's traceback): the mapping stays cached
            pass
        self._reader.done(self._entry)

    def __enter__(self) -> PooledPayload:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
