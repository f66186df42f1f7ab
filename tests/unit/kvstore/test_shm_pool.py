"""The sender's shared-memory segment pool: bounded, reused, pre-faulted, every segment released exactly once."""
from __future__ import annotations

import threading

import pytest

from kvstore.shm import SHM_DIR
from kvstore.shm_pool import HEADER_BYTES, SegmentPool, SegmentPoolExhausted

SMALL = (4 << 20) + HEADER_BYTES  # the capacity of a segment for payloads up to 4 MiB


def test_segments_are_reused_smallest_first_and_bounded():
    with SegmentPool(max_bytes=2 * SMALL) as pool:
        a = pool.acquire(1000, request_id="r", handle="a")
        b = pool.acquire(4 << 20, request_id="r", handle="b")
        assert a.capacity == b.capacity == SMALL
        with pytest.raises(SegmentPoolExhausted):   # both in use, no room for a third
            pool.acquire(10, request_id="r", handle="c", timeout_s=0.05)
        a.release(reusable=True)
        c = pool.acquire(10, request_id="r", handle="c")
        assert c is a and c.payload().numel() == 10
        stats = pool.stats()
        assert (stats.num_segments, stats.num_in_use, stats.num_created, stats.num_reused) == (2, 2, 2, 1)
        c.release(reusable=False)                   # unlinked, not reused
        assert not (SHM_DIR / a.name).exists() and pool.stats().num_segments == 1
        b.release(reusable=True)
        big = pool.acquire(5 << 20, request_id="r", handle="d")  # 8 MiB: the idle 4 MiB one is unlinked for it
        assert big.capacity == (8 << 20) + HEADER_BYTES and not (SHM_DIR / b.name).exists()
        big.release(reusable=True)
        with pytest.raises(AssertionError, match="released twice"):
            big.release(reusable=True)
        names = pool.segment_names()
    assert not any((SHM_DIR / n).exists() for n in names)


def test_a_waiting_acquire_gets_the_segment_released_meanwhile():
    with SegmentPool(max_bytes=SMALL) as pool:
        held = pool.acquire(100, request_id="r", handle="a")
        threading.Timer(0.1, lambda: held.release(reusable=True)).start()
        again = pool.acquire(100, request_id="r", handle="b", timeout_s=30)
        assert again.name == held.name
        again.release(reusable=True)      # else its segment outlives the pool, and this process's name with it


def test_a_payload_larger_than_the_pool_is_refused_naming_max_bytes():
    with SegmentPool(max_bytes=SMALL) as pool, pytest.raises(ValueError, match="max_bytes"):
        pool.acquire(5 << 20, request_id="r", handle="a")
