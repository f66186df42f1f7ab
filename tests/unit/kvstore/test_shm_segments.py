"""Which shared-memory segments a receiver accepts: real segments and hostile entries in /dev/shm (links, FIFOs,
other modes and owners, traversal names); each refused with the reason, none followed or read."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.shm import (SHM_DIR, OutgoingSegment, SegmentRefused, attach_segment, check_segment_name,
                         new_segment_name, reservation_token, take_segment)

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux shared memory as files)")

RID, HANDLE = "req-1", "h-1"


@pytest.fixture
def planted():
    """plant(kind, **kw) -> name of a hostile entry under /dev/shm with a well-formed name; removed after."""
    paths: list[Path] = []

    def plant(kind: str, mode: int = 0o600, target: Path | None = None) -> str:
        name = new_segment_name(RID, HANDLE)
        path = SHM_DIR / name
        if kind == "file":
            path.write_bytes(b"secret")
            os.chmod(path, mode)
        elif kind == "symlink":
            os.symlink(target, path)
        elif kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "hardlink":
            os.link(target, path)
        paths.append(path)
        return name

    yield plant
    for path in paths:
        if os.path.lexists(path):
            os.unlink(path)


def write_segment(payload: bytes, request_id: str = RID, handle: str = HANDLE) -> OutgoingSegment:
    segment = OutgoingSegment(len(payload), request_id=request_id, handle=handle)
    segment.write(0, payload)
    return segment


def test_take_reads_the_payload_and_unlinks_the_name():
    with write_segment(b"kv-bytes") as segment:
        assert (SHM_DIR / segment.name).exists()
        with take_segment(segment.name, request_id=RID, handle=HANDLE) as taken:
            assert bytes(taken.buf[:8]) == b"kv-bytes"
            assert not (SHM_DIR / segment.name).exists()
        with pytest.raises(FileNotFoundError) as info:      # not twice
            take_segment(segment.name, request_id=RID, handle=HANDLE)
        assert type(info.value) is FileNotFoundError


def test_receiver_mapping_never_writes_the_senders_pages():
    with write_segment(b"abcd") as segment:
        with attach_segment(segment.name) as attached:
            attached.buf[0] = ord("X")
        with attach_segment(segment.name) as again:
            assert bytes(again.buf[:4]) == b"abcd"


def test_sender_close_after_take_leaves_no_tracked_segment_behind():
    # The resource tracker would warn at exit about a segment whose unlink it never saw.
    script = ("from kvstore.shm import OutgoingSegment, take_segment\n"
              "s = OutgoingSegment(4, request_id='r', handle='h'); s.write(0, b'abcd')\n"
              "take_segment(s.name, request_id='r', handle='h').close(); s.close()\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).parents[3])
    assert result.returncode == 0, result.stderr
    assert "leaked" not in result.stderr and "Traceback" not in result.stderr


def test_segment_of_another_reservation_is_refused_and_left_alone():
    with write_segment(b"theirs", request_id="req-2", handle="h-2") as segment:
        with pytest.raises(SegmentRefused, match="made for another reservation"):
            take_segment(segment.name, request_id=RID, handle=HANDLE)
        assert (SHM_DIR / segment.name).exists()


def test_name_carries_the_reservation_token():
    name = new_segment_name(RID, HANDLE)
    assert name.split("_")[2] == reservation_token(RID, HANDLE)
    assert len(name) <= 30
    assert reservation_token(RID, HANDLE) != reservation_token(RID, "h-2") != reservation_token("req-2", HANDLE)


@pytest.mark.parametrize("name", [
    "../etc/passwd", "pdkv_1_../../etc/passwd", "/dev/shm/" + "pdkv_1_0123456789_abcdef",
    "pdkv_1_0123456789_abcdef/..", "pdkv_1_0123456789_abcde", "pdkv_1_0123456789_ABCDEF", "psm_1234",
    "pdkv_123456789_0123456789_abcdef", "", "pdkv_1_0123456789_abcdef\n", "pdkv_1_doesnotexist",
])
def test_malformed_names_never_reach_the_filesystem(name):
    with pytest.raises(SegmentRefused, match="invalid segment name"):
        attach_segment(name)
    with pytest.raises(SegmentRefused, match="invalid segment name"):
        take_segment(name, request_id=RID, handle=HANDLE)


def test_symlink_is_not_followed(planted, tmp_path):
    target = tmp_path / "private"
    target.write_bytes(b"do not read")
    os.chmod(target, 0o600)
    name = planted("symlink", target=target)
    with pytest.raises(SegmentRefused, match="a symbolic link"):
        take_segment(name, request_id=RID, handle=HANDLE)
    assert os.path.islink(SHM_DIR / name)    # the link is refused, not consumed


def test_symlink_to_a_real_segment_is_refused(planted):
    with write_segment(b"real") as segment:
        name = planted("symlink", target=SHM_DIR / segment.name)
        with pytest.raises(SegmentRefused, match="a symbolic link"):
            attach_segment(name)


@pytest.mark.parametrize("mode", [0o644, 0o660, 0o400, 0o606])
def test_other_modes_are_refused(planted, mode):
    name = planted("file", mode=mode)
    with pytest.raises(SegmentRefused, match=f"mode {mode:04o}, not 0600"):
        take_segment(name, request_id=RID, handle=HANDLE)


def test_fifo_is_refused_without_blocking(planted):
    name = planted("fifo")
    with pytest.raises(SegmentRefused, match="not a regular file"):
        take_segment(name, request_id=RID, handle=HANDLE)


def test_hard_link_to_another_segment_is_refused(planted):
    with write_segment(b"other", request_id="req-2", handle="h-2") as segment:
        name = planted("hardlink", target=SHM_DIR / segment.name)
        with pytest.raises(SegmentRefused, match="2 hard links"):
            take_segment(name, request_id=RID, handle=HANDLE)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user owns needs root")
def test_foreign_owner_is_refused(planted):
    name = planted("file")
    os.chown(SHM_DIR / name, 65534, 65534)
    with pytest.raises(SegmentRefused, match="owned by uid 65534"):
        take_segment(name, request_id=RID, handle=HANDLE)


def test_empty_file_is_refused(planted):
    name = planted("file")
    (SHM_DIR / name).write_bytes(b"")
    with pytest.raises(SegmentRefused, match="empty"):
        attach_segment(name)


def test_missing_segment_is_not_found():
    name = new_segment_name(RID, HANDLE)
    with pytest.raises(FileNotFoundError) as info:
        take_segment(name, request_id=RID, handle=HANDLE)
    assert type(info.value) is FileNotFoundError


def test_check_segment_name_without_a_reservation_checks_only_the_form():
    check_segment_name(new_segment_name("any", "thing"))
    with pytest.raises(SegmentRefused):
        check_segment_name(new_segment_name("any", "thing"), request_id="any", handle="other")
