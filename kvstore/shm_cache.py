"""Zero-copy same-host KV transfer: the prefill worker's paged KV cache lives in a shared-memory segment, and a
decode worker on the same host copies the blocks it is sent straight out of it (one copy in all, no staging).

Segment: ``pdkv_<creator pid>_cache_<random>`` (kvstore.shm's prefix and pid field, so a dead creator's segment
is removed by its resource tracker, else by kvstore.shm.remove_orphaned_segments at the next start), mode 0600,
HEADER_BYTES of header, then the cache tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
contiguous in the cache dtype (page aligned):

    magic         8 bytes   b"PDKVCACH"
    epoch         16 bytes  random lowercase hex, new for every cache made (KvManifest.sender_epoch)
    num_layers, num_blocks, block_size, num_kv_heads, head_dim, itemsize    six little-endian uint64

Block b of layer l, K (kv 0) or V (kv 1) is the *piece* of ``piece_bytes = block_size * num_kv_heads *
head_dim * itemsize`` bytes at ``HEADER_BYTES + ((l * 2 + kv) * num_blocks + b) * piece_bytes``. A block's
record in kvstore.transfer's raw codec is its 2 * num_layers pieces in that (layer, kv) order, so hashing the
pieces in place one after the other (xxh3-128 streamed) gives exactly the record's digest: the digest
definition does not change, and nothing is gathered to compute it. Both loops over the pieces (hash in place;
copy, then hash what landed) run in C (kernels.cpu_kv_copy, the GIL released) when it could be built, else in
Python: the same digests and bytes.

One push (kvstore.kv_sender sends, kvstore.transfer_service receives):

    sender    Push: manifest {cache_segment, sender_epoch, cache_num_blocks, src_block_ids, block_ids,
              digests_in_trailer}, at once; then hashes the source blocks in place and sends the trailer
    receiver  maps the segment once (PooledSegmentReader.attach: the file checks of kvstore.shm; the mapping is
              kept while name, file and epoch stay), checks the header against the manifest, and copies each
              source block into its destination piece by piece, hashing what landed (in C: one pass, each
              64-byte stripe hashed from the register it was stored from); then compares the hashes of what
              landed with the trailer's
    mismatch  (or any failure after the first write) the destination blocks are zeroed (a fresh cache's state:
              no byte of a rejected transfer stays, and no NaN pattern) and the transfer is rejected as a whole

Why hash what landed rather than the source before copying: the sender keeps the source blocks referenced until
its Push returns, but a Push that ends early (deadline, cancel) frees them while the receiver may still copy.
The sender's digests were taken while the blocks were held, so a block reused under the reader shows up as a
mismatch of the copy itself: there is no window between a check and a copy.

Trust (DESIGN section 10): the receiver maps only a name of the cache form, after the file checks (regular
file, one link, our uid, mode 0600, no symbolic link, no FIFO), with a header that matches the manifest; the
segment is not bound to one reservation (one cache serves every transfer): the digests, sent over the
authenticated Push, are what binds the bytes to it.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import struct
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker, shared_memory

import torch

from kernels import cpu_kv_copy
from kvstore.paged_records import PagedRecords
from kvstore.shm import SEGMENT_PREFIX, SHM_DIR, SegmentRefused
from kvstore.shm_pool import PooledSegmentReader
from kvstore.transfer_manifest import (DTYPE_BYTES, KvLayoutSpec, TransferManifest, TransferRejected,
                                       check_trailer_digests)

log = logging.getLogger(__name__)

CACHE_NAME_PATTERN = re.compile(r"pdkv_[0-9a-f]{1,8}_cache_[0-9a-f]{8}")
HEADER_BYTES = 4096
MAGIC = b"PDKVCACH"
_HEADER = struct.Struct("<8s16s6Q")  # magic, epoch, num_layers, num_blocks, block_size, kv_heads, head_dim, itemsize


def is_cache_name(name: str) -> bool:
    return isinstance(name, str) and CACHE_NAME_PATTERN.fullmatch(name) is not None


def _piece_bytes(shape: Sequence[int], itemsize: int) -> int:
    _, _, _, block_size, num_kv_heads, head_dim = shape
    return block_size * num_kv_heads * head_dim * itemsize


def block_digests_in_place(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> tuple[bytes, ...]:
    """kvstore.transfer.block_digest of each block's raw record, computed over the blocks where they are in
    `kv_cache` (contiguous, CPU): no gather. ValueError for a block id outside the cache."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        raise ValueError("block_digests_in_place needs a contiguous CPU cache")
    return tuple(PagedRecords(kv_cache, block_ids).digests_in_place())


class SharedKvCache:
    """A KV cache tensor over a named shared-memory segment this process creates (module doc); `tensor` is
    zeroed and every page touched once (pre-faulted). close() unlinks the name (the pages stay while mapped)."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        shape = tuple(int(n) for n in shape)
        dtype_name = str(dtype).removeprefix("torch.")
        if len(shape) != 6 or shape[1] != 2 or dtype_name not in DTYPE_BYTES:
            raise ValueError(f"shape must be [L, 2, num_blocks, block_size, Hkv, D] in {list(DTYPE_BYTES)}, got "
                             f"{shape} {dtype}")
        numel = 1
        for n in shape:
            numel *= n
        size = HEADER_BYTES + numel * dtype.itemsize
        if SHM_DIR.is_dir():  # touching a page past the tmpfs size would kill us with SIGBUS: refuse first
            fs = os.statvfs(SHM_DIR)
            if size > fs.f_bavail * fs.f_frsize:
                raise OSError(errno.ENOSPC, f"{SHM_DIR} has {fs.f_bavail * fs.f_frsize} bytes free, a {size}-byte "
                              "KV cache does not fit")
        while True:
            name = f"{SEGMENT_PREFIX}{os.getpid():x}_cache_{secrets.token_hex(4)}"
            try:
                self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
                break
            except FileExistsError:
                continue
        self.name = name
        self.epoch = secrets.token_hex(8)
        self.shape = shape
        self._closed = False
        try:
            num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = shape
            self._shm.buf[:_HEADER.size] = _HEADER.pack(MAGIC, self.epoch.encode(), num_layers, num_blocks,
                                                        block_size, num_kv_heads, head_dim, dtype.itemsize)
            # tensor: [L, 2, num_blocks, block_size, Hkv, D] viewing the segment after its header
            self.tensor = torch.frombuffer(self._shm.buf, dtype=dtype, count=numel, offset=HEADER_BYTES).view(shape)
            self.tensor.zero_()
        except BaseException:
            self.close()
            raise

    @property
    def num_blocks(self) -> int:
        return self.shape[2]

    def holds(self, kv_cache) -> bool:
        """Whether `kv_cache` is this segment's cache tensor (the one the engine computes into)."""
        return (isinstance(kv_cache, torch.Tensor) and not self._closed
                and kv_cache.data_ptr() == self.tensor.data_ptr() and tuple(kv_cache.shape) == self.shape
                and kv_cache.is_contiguous())

    def flip_byte(self, block_id: int) -> None:
        """Test hook: invert the first byte of block `block_id` (layer 0, K); a second call restores it."""
        view = self.tensor.reshape(-1).view(torch.uint8)
        offset = block_id * _piece_bytes(self.shape, self.tensor.element_size())
        view[offset] = view[offset] ^ 0xFF

    def close(self) -> None:
        """Unlink the name, once; a receiver's kept mapping goes at its next prune (the name is gone)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._shm.unlink()
        except FileNotFoundError:  # removed behind our back: only the tracker still holds it
            resource_tracker.unregister("/" + self.name, "shared_memory")


# ------------------------------------------------------------------------------------------------- receiving
class CacheRead:
    """One transfer's read of a sender's cache segment (from open_cache): copy_into / copy_records, then close."""

    def __init__(self, reader: PooledSegmentReader, entry, manifest: TransferManifest, layout: KvLayoutSpec) -> None:
        self._manifest = manifest
        self._reader = reader
        self._entry = entry
        self._num_pieces = 2 * layout.num_layers
        self._piece = layout.block_size * layout.num_kv_heads * layout.head_dim * DTYPE_BYTES[layout.dtype]
        self._src_stride = manifest.cache_num_blocks * self._piece
        # the cache only, not the mapping's tail: a source id past the cache is refused, not read from the tail
        self._view = entry.buf[HEADER_BYTES:HEADER_BYTES + self._num_pieces * self._src_stride]
        self._src_bases = [b * self._piece for b in manifest.src_block_ids]

    def _copy(self, dst: memoryview, dst_bases: Sequence[int], dst_stride: int) -> list[bytes]:
        """Copy every source block to `dst` piece by piece, hashing what landed (kernels.cpu_kv_copy): the digests
        of what landed, in order. ValueError, before any byte is written, for a block outside either buffer."""
        return cpu_kv_copy.copy_hash_pieces(self._view, self._src_bases, self._src_stride, dst, dst_bases, dst_stride,
                                            self._num_pieces, self._piece)

    def copy_into(self, kv_cache: torch.Tensor, block_ids: Sequence[int]) -> list[bytes]:
        """Source block i -> block block_ids[i] of `kv_cache` (contiguous, CPU, the layout's shape)."""
        # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
        view = memoryview(kv_cache.reshape(-1).view(torch.uint8).numpy())
        return self._copy(view, [b * self._piece for b in block_ids], kv_cache.shape[2] * self._piece)

    def check_landed(self, landed: Sequence[bytes], sent: Sequence[bytes]) -> None:
        """TransferRejected naming the first block whose landed bytes do not match the sender's digest."""
        manifest = self._manifest
        check_trailer_digests(manifest, sent)
        for k, (got, want) in enumerate(zip(landed, sent, strict=True)):
            if got != want:
                raise TransferRejected(f"block {k} (destination block {manifest.block_ids[k]}, source block "
                                       f"{manifest.src_block_ids[k]}) does not match its digest",
                                       f"block_digests[{k}]")

    def copy_verified(self, kv_cache: torch.Tensor, block_ids: Sequence[int],
                      sender_digests: Callable[[], Sequence[bytes]]) -> None:
        """copy_into, then every landed block must match `sender_digests()` (the trailer, waited for only after
        the copy); on any failure the destination blocks are zeroed before the error goes on."""
        # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
        try:
            self.check_landed(self.copy_into(kv_cache, block_ids), sender_digests())
        except BaseException:  # nothing of a rejected transfer stays in the cache
            kv_cache[:, :, torch.as_tensor(list(block_ids), dtype=torch.int64)] = 0
            raise

    def copy_records(self, out: torch.Tensor) -> list[bytes]:
        """Source block i -> raw record i of `out` ([n * block_bytes] uint8 CPU, kvstore.transfer's layout)."""
        record = self._num_pieces * self._piece
        return self._copy(memoryview(out.numpy()), [i * record for i in range(len(self._src_bases))], self._piece)

    def close(self) -> None:
        try:
            self._view.release()
        except BufferError:
            pass
        self._reader.done(self._entry)

    def __enter__(self) -> CacheRead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_cache(reader: PooledSegmentReader, manifest: TransferManifest, layout: KvLayoutSpec) -> CacheRead:
    """The sender's cache segment the (validated) manifest names, mapped once and kept in `reader`, after the
    checks of the module doc. SegmentRefused naming why; FileNotFoundError when there is no such segment."""
    name = manifest.cache_segment
    if not is_cache_name(name):
        raise SegmentRefused(f"invalid cache segment name {name!r}: expected {CACHE_NAME_PATTERN.pattern}")
    entry = reader.attach(name, manifest.sender_epoch.encode())
    try:
        if len(entry.buf) < _HEADER.size:
            raise SegmentRefused(f"segment {name!r} refused: shorter than its header")
        magic, epoch, *dims = _HEADER.unpack_from(entry.buf)
        if magic != MAGIC:
            raise SegmentRefused(f"segment {name!r} refused: not a KV cache segment")
        if epoch != manifest.sender_epoch.encode():
            raise SegmentRefused(f"segment {name!r} refused: epoch {epoch.decode(errors='replace')!r}, the manifest "
                                 f"says {manifest.sender_epoch!r}")
        want = [layout.num_layers, manifest.cache_num_blocks, layout.block_size, layout.num_kv_heads,
                layout.head_dim, DTYPE_BYTES[layout.dtype]]
        if dims != want:
            raise SegmentRefused(f"segment {name!r} refused: header says (layers, blocks, block_size, kv_heads, "
                                 f"head_dim, itemsize) {tuple(dims)}, the manifest {tuple(want)}")
        cache_bytes = manifest.cache_num_blocks * layout.block_elems * DTYPE_BYTES[layout.dtype]
        if HEADER_BYTES + cache_bytes > len(entry.buf):
            raise SegmentRefused(f"segment {name!r} refused: {len(entry.buf)} bytes, its cache needs "
                                 f"{HEADER_BYTES + cache_bytes}")
    except BaseException:
        reader.done(entry)
        raise
    return CacheRead(reader, entry, manifest, layout)
