"""Copy-and-hash of paged KV pieces in native C (kernels/cpu_kv_copy.c): kvstore.shm_cache's zero-copy push.

A *block* is `num_pieces` pieces of `piece_bytes` bytes at byte offsets `base + p * stride` (p = 0 .. num_pieces - 1)
of a 1-D byte buffer (anything exposing the buffer protocol: a memoryview of an mmap, of a tensor's numpy view);
its digest is xxh3-128 streamed over its pieces in order, as `xxhash.xxh3_128().digest()` gives it (16 canonical,
big-endian bytes). For the KV cache [L, 2, num_blocks, block_size, Hkv, D]: base = block_id * piece_bytes,
stride = num_blocks * piece_bytes, num_pieces = 2 * L (kvstore.shm_cache's module doc).

    hash_pieces(src, bases, stride, num_pieces, piece_bytes)
        the digest of each block, read where it is
    copy_hash_pieces(src, src_bases, src_stride, dst, dst_bases, dst_stride, num_pieces, piece_bytes)
        copy block i of src to block i of dst piece by piece, hashing what landed: the digests of the bytes in
        dst, never of what was read from src (kvstore.shm_cache says why)
    PlaneHasher(blocks, bases, stride, num_pieces, piece_bytes)
        hash_pieces taken a few planes at a time: hash(n) walks the next n pieces of every block (a prefill step
        hashes each layer's pieces right after writing them), digests() once every piece was walked
    PieceStream(blocks, bases, stride, num_pieces, piece_bytes)
        the blocks' records as one payload (block 0's pieces in order, then block 1's, ...), moved in order, any
        number of bytes at a time, into the blocks (land) or out of them into a contiguous buffer (gather), each
        stretch hashed where it was written; `digests` grows as records complete (the grpc transport's two ends)

All check first that every piece of every block lies inside its buffer (ValueError naming the block, before
any byte is written), then run the C loop when `available()`, else the Python loops `*_ref` (the definition:
same digests, same bytes landed). The C code is compiled on first use by kernels.native_build. Its xxh3-128 is
of two kinds:
- hash_pieces and copy_hash_pieces, on blocks whose pieces are whole 64-byte stripes (every KV cache with blocks
  of 16 tokens) and records over 240 bytes: xxh3-128's long-input loop written out in the C file (AVX512, AVX2
  or portable C, picked at run time; `isa` forces one, ISA_BEST by default, and one the CPU lacks falls back),
  one pass a piece: each stripe is loaded once, stored to the destination (streaming stores, past the caches),
  and folded into the hash from the register it was stored from, i.e. the digest of what landed. The walk goes
  plane by plane (piece p of every block, in source-address order, before piece p + 1), each block's hash kept
  apart: pieces of one plane are near each other (fewer page walks, sequential runs of adjacent blocks), 1.3-1.7x
  faster than block by block on 256 blocks. The same digests as the package's, tested against it over many
  layouts, block orders and every ISA. `native_path` says which runs.
- PieceStream on records of whole stripes over 240 bytes (its pieces may cut stripes): the same loop, a stripe
  cut by a stretch's or a piece's end completed from the next one.
- everything else (other layouts): the installed xxhash package's own functions (resolved with
  ctypes from its extension module; the runtime-dispatched update, AVX2/AVX512, when it exports one, as the
  package's own update uses), each piece copied, then hashed while it is in L1/L2.
No compiler, a failed build or a symbol the extension lacks logs one warning and `available()` is False. ctypes
releases the GIL for the call: other threads run while a transfer copies.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

from kernels import native_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kv_copy.c")
DIGEST_BYTES = 16
ISA_BEST, ISA_PORTABLE, ISA_AVX2, ISA_AVX512 = -1, 0, 1, 2
_XXH3_SYMBOLS = ("XXH3_createState", "XXH3_freeState", "XXH3_128bits_reset", "XXH3_128bits_update",
                 "XXH3_128bits_digest", "XXH128_canonicalFromHash")


def _xxh3_functions() -> tuple[ctypes.CDLL, list[int]]:
    """xxhash's extension module loaded once more (the same mapping) and the addresses of _XXH3_SYMBOLS in
    pd_kv_copy_init's order; OSError naming what is missing."""
    path = xxhash._xxhash.__file__
    ext = ctypes.CDLL(path)
    missing = [name for name in _XXH3_SYMBOLS if not hasattr(ext, name)]
    if missing:
        raise OSError(f"{path} exports no {', '.join(missing)}")
    names = list(_XXH3_SYMBOLS)
    if hasattr(ext, "XXH3_128bits_update_dispatch"):  # x86 builds: the plain symbol is the SSE2 baseline
        names[3] = "XXH3_128bits_update_dispatch"
    return ext, [ctypes.cast(getattr(ext, name), ctypes.c_void_p).value for name in names]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, its xxh3 functions set; None (after one warning) when it cannot be."""
    try:
        ext, functions = _xxh3_functions()
    except (OSError, AttributeError) as exc:
        log.warning("native CPU kv copy kernels unavailable, using the Python loops: %s", exc)
        return None
    lib = native_build.load(SOURCE, "kv copy", "the Python loops")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pd_kv_copy_init.restype, lib.pd_kv_copy_init.argtypes = None, [ptr] * 6
    lib.pd_copy_hash_pieces.restype = ctypes.c_int
    lib.pd_copy_hash_pieces.argtypes = [ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, ptr, ctypes.c_int]
    lib.pd_hash_pieces.restype = ctypes.c_int
    lib.pd_hash_pieces.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ctypes.c_int]
    lib.pd_kv_copy_path.restype, lib.pd_kv_copy_path.argtypes = ctypes.c_int, [i64, i64, ctypes.c_int]
    lib.pd_stream_new.restype, lib.pd_stream_new.argtypes = ptr, [ctypes.c_int]
    lib.pd_stream_free.restype, lib.pd_stream_free.argtypes = None, [ptr]
    lib.pd_stream_move.restype = i64
    lib.pd_stream_move.argtypes = [ptr, ptr, i64, ctypes.c_int, ptr, ptr, i64, i64, i64, i64, ptr, ptr]
    lib.pd_planes_new.restype, lib.pd_planes_new.argtypes = ptr, [ptr, i64, i64, i64, ctypes.c_int]
    lib.pd_planes_walk.restype, lib.pd_planes_walk.argtypes = i64, [ptr, ptr, i64, i64, ptr]
    lib.pd_planes_free.restype, lib.pd_planes_free.argtypes = None, [ptr]
    lib.pd_kv_copy_init(*functions)
    lib.xxhash_extension = ext  # the C code holds its function pointers: keep the library referenced
    return lib


def available() -> bool:
    """Whether the native loops are built and loaded (else hash_pieces / copy_hash_pieces run the Python ones)."""
    return library() is not None


# --------------------------------------------------------------------------------------------------- reference
def hash_pieces_ref(src: memoryview, bases: Sequence[int], stride: int, num_pieces: int,
                    piece_bytes: int) -> list[bytes]:
    """hash_pieces, one Python iteration per piece."""
    digests = []
    for base in bases:
        h = xxhash.xxh3_128()
        for p in range(num_pieces):
            start = base + p * stride
            h.update(src[start:start + piece_bytes])
        digests.append(h.digest())
    return digests


def copy_hash_pieces_ref(src: memoryview, src_bases: Sequence[int], src_stride: int, dst: memoryview,
                         dst_bases: Sequence[int], dst_stride: int, num_pieces: int, piece_bytes: int) -> list[bytes]:
    """copy_hash_pieces, one Python iteration per piece."""
    digests = []
    for sb, db in zip(src_bases, dst_bases, strict=True):
        h = xxhash.xxh3_128()
        for p in range(num_pieces):
            so, do = sb + p * src_stride, db + p * dst_stride
            landed = dst[do:do + piece_bytes]
            landed[:] = src[so:so + piece_bytes]
            h.update(landed)
        digests.append(h.digest())
    return digests


# --------------------------------------------------------------------------------------------------- launchers
def _checked(name: str, buf, bases: Sequence[int], stride: int, num_pieces: int, piece_bytes: int) -> memoryview:
    """`buf` as a 1-D byte memoryview, after checking that every piece of every block lies inside it: the C
    loops check no bound."""
    view = memoryview(buf).cast("B")
    if num_pieces < 1 or piece_bytes < 1 or stride < 0:
        raise ValueError(f"num_pieces and piece_bytes must be >= 1 and {name} stride >= 0, got {num_pieces}, "
                         f"{piece_bytes}, {stride}")
    last = view.nbytes - (num_pieces - 1) * stride - piece_bytes  # the last base whose pieces all fit
    for i, base in enumerate(bases):
        if not 0 <= base <= last:
            raise ValueError(f"{name} block {i} at byte {base}: its {num_pieces} pieces of {piece_bytes} bytes, "
                             f"{stride} apart, run outside the {view.nbytes}-byte buffer")
    return view


def _address(view: memoryview) -> int:
    # numpy takes read-only buffers too (ctypes' from_buffer does not); `view` keeps the memory alive
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _offsets(bases: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(bases))(*bases)


def _split(out: ctypes.Array, num_blocks: int) -> list[bytes]:
    raw = out.raw
    return [raw[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES] for i in range(num_blocks)]


def native_path(num_pieces: int, piece_bytes: int, isa: int = ISA_BEST) -> str:
    """Which loop hash_pieces / copy_hash_pieces run for blocks of this shape (module doc): "portable", "avx2" or
    "avx512" (the one-pass xxh3: whole 64-byte stripes, records over 240 bytes), "xxhash" (the package's xxh3,
    piece by piece), or "python" (no native library)."""
    if not available():
        return "python"
    return {-1: "xxhash", ISA_PORTABLE: "portable", ISA_AVX2: "avx2",
            ISA_AVX512: "avx512"}[library().pd_kv_copy_path(num_pieces, piece_bytes, isa)]


def hash_pieces(src, bases: Sequence[int], stride: int, num_pieces: int, piece_bytes: int,
                isa: int = ISA_BEST) -> list[bytes]:
    """The xxh3-128 digest of each block of `src` (module doc), hashed where it is. `isa`: module doc."""
    view = _checked("src", src, bases, stride, num_pieces, piece_bytes)
    if not bases or not available():
        return hash_pieces_ref(view, bases, stride, num_pieces, piece_bytes)
    lib, out = library(), ctypes.create_string_buffer(len(bases) * DIGEST_BYTES)
    if lib.pd_hash_pieces(_address(view), _offsets(bases), stride, len(bases), num_pieces, piece_bytes, out, isa):
        raise MemoryError("native kv copy: out of memory for an xxh3 state")
    return _split(out, len(bases))


def copy_hash_pieces(src, src_bases: Sequence[int], src_stride: int, dst, dst_bases: Sequence[int],
                     dst_stride: int, num_pieces: int, piece_bytes: int, isa: int = ISA_BEST) -> list[bytes]:
    """Block i of `src` -> block i of `dst` (module doc): the xxh3-128 digest of each block as it landed. `isa`:
    module doc."""
    if len(src_bases) != len(dst_bases):
        raise ValueError(f"{len(src_bases)} source blocks for {len(dst_bases)} destination blocks")
    src_view = _checked("src", src, src_bases, src_stride, num_pieces, piece_bytes)
    dst_view = _checked("dst", dst, dst_bases, dst_stride, num_pieces, piece_bytes)
    if dst_view.readonly:
        raise ValueError("dst must be a writable buffer")
    if not src_bases or not available():
        return copy_hash_pieces_ref(src_view, src_bases, src_stride, dst_view, dst_bases, dst_stride, num_pieces,
                                    piece_bytes)
    lib, out = library(), ctypes.create_string_buffer(len(src_bases) * DIGEST_BYTES)
    if lib.pd_copy_hash_pieces(_address(src_view), _offsets(src_bases), src_stride, _address(dst_view),
                               _offsets(dst_bases), dst_stride, len(src_bases), num_pieces, piece_bytes, out, isa):
        raise MemoryError("native kv copy: out of memory for an xxh3 state")
    return _split(out, len(src_bases))


class _NativeState:
    """A native state (`_native`, freed by the subclass's `_free`) that close(), the with block's end or garbage
    collection frees once."""

    _native = None

    def close(self) -> None:
        if self._native is not None:
            native, self._native = self._native, None
            self._free(native)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class PlaneHasher(_NativeState):
    """hash_pieces of blocks `bases` of `blocks` (module doc), walked a few planes at a time: hash(n) folds the
    next n pieces of every block into its digest (pieces 0 .. n - 1 first), reading them where they are then;
    digests() gives hash_pieces' digests once all num_pieces were walked. The bytes of a piece must not change
    between its walk and the use of the digest. Natively when the layout takes the one-pass loop (`native`),
    else one xxhash state per block. Not thread-safe; close() (or the with block's end) frees the native
    state."""

    def __init__(self, blocks, bases: Sequence[int], stride: int, num_pieces: int, piece_bytes: int,
                 isa: int = ISA_BEST) -> None:
        self._view = _checked("blocks", blocks, bases, stride, num_pieces, piece_bytes)
        self._bases, self._stride, self.num_pieces, self._piece_bytes = list(bases), stride, num_pieces, piece_bytes
        self.walked = 0
        """Pieces of every block hashed so far."""
        self._native = None
        if self._bases and available() and library().pd_kv_copy_path(num_pieces, piece_bytes, isa) >= 0:
            self._lib = library()  # held: close() may run at interpreter exit
            self._native = self._lib.pd_planes_new(_offsets(self._bases), len(self._bases), num_pieces,
                                                   piece_bytes, isa)
            if not self._native:
                raise MemoryError("native kv copy: out of memory for the blocks' xxh3 states")
            self._address = _address(self._view)
            self._out = ctypes.create_string_buffer(len(self._bases) * DIGEST_BYTES)  # written by the last walk
        else:
            self._hashes = [xxhash.xxh3_128() for _ in self._bases]

    @property
    def native(self) -> bool:
        """Whether the C loop walks the pieces (else the xxhash package, piece by piece from Python)."""
        return self._native is not None

    def hash(self, pieces: int) -> None:
        """Fold pieces walked .. walked + pieces - 1 of every block into its digest."""
        if not 0 <= pieces <= self.num_pieces - self.walked:
            raise ValueError(f"{pieces} more pieces after {self.walked} of {self.num_pieces}")
        if self._native is not None:
            self._lib.pd_planes_walk(self._native, self._address, self._stride, pieces, self._out)
        else:
            for h, base in zip(self._hashes, self._bases):
                for p in range(self.walked, self.walked + pieces):
                    start = base + p * self._stride
                    h.update(self._view[start:start + self._piece_bytes])
        self.walked += pieces

    def digests(self) -> list[bytes]:
        """Each block's xxh3-128 digest (hash_pieces'); ValueError before every piece was walked."""
        if self.walked != self.num_pieces:
            raise ValueError(f"{self.walked} of {self.num_pieces} pieces walked: no digest yet")
        if self._native is None:
            return [h.digest() for h in self._hashes]
        return _split(self._out, len(self._bases))

    def _free(self, native) -> None:
        self._lib.pd_planes_free(native)


class PieceStream(_NativeState):
    """The records of blocks `bases` of `blocks` (module doc) as one payload, moved in order between it and
    contiguous bytes: land(data) writes the payload's next len(data) bytes into the blocks, gather(out) fills
    `out` with the next len(out) bytes of them. Each stretch is hashed right where it was written, so `digests`
    are of what landed (land) or of what was sent (gather); a record's digest is appended when its last byte
    has moved. `known`: a digest or None per record, the ones the caller already has (a prefill worker's,
    engine.kv_digests); gathering copies those records without hashing them and `digests` takes them as given.
    Natively, records of whole stripes take the one-pass xxh3 (`isa`: module doc; landing uses streaming stores,
    gathering plain ones: a message is read again soon), others the package's. Not thread-safe; close() (or the
    with block's end) frees the native state."""

    def __init__(self, blocks, bases: Sequence[int], stride: int, num_pieces: int, piece_bytes: int,
                 isa: int = ISA_BEST, known: Sequence[bytes | None] | None = None) -> None:
        self._view = _checked("blocks", blocks, bases, stride, num_pieces, piece_bytes)
        self._bases, self._stride, self._num_pieces, self._piece_bytes = list(bases), stride, num_pieces, piece_bytes
        self.num_records = len(self._bases)
        self.record_bytes = num_pieces * piece_bytes
        self.payload_bytes = self.num_records * self.record_bytes
        self._known = list(known) if known is not None else [None] * self.num_records
        if len(self._known) != self.num_records or any(d is not None and len(d) != DIGEST_BYTES for d in self._known):
            raise ValueError(f"known: one {DIGEST_BYTES}-byte digest or None per record ({self.num_records})")
        self._any_known = any(d is not None for d in self._known)
        self.fed = 0
        """Payload bytes moved so far."""
        self.digests: list[bytes] = []
        """xxh3-128 digests (16 bytes each) of the records complete so far, in order."""
        self._native = None
        if self._bases and available():
            self._native = library().pd_stream_new(isa)
            if not self._native:
                raise MemoryError("native kv copy: out of memory for a stream's xxh3 state")
            self._address = _address(self._view)
            self._offsets = _offsets(self._bases)
            self._flags = ((ctypes.c_uint8 * self.num_records)(*(d is not None for d in self._known))
                           if self._any_known else None)
            self._out = ctypes.create_string_buffer(len(self._bases) * DIGEST_BYTES)
        else:
            self._hash = xxhash.xxh3_128()

    def land(self, data) -> int:
        """Write the payload's next len(data) bytes into the blocks; returns how many records are complete."""
        if self._any_known:
            raise ValueError("known digests are for gathering: landed bytes are hashed as they land")
        return self._move(memoryview(data).cast("B"), land=True)

    def gather(self, out) -> int:
        """Fill the writable buffer `out` with the payload's next len(out) bytes; returns how many records are
        complete."""
        view = memoryview(out).cast("B")
        if view.readonly:
            raise ValueError("gather needs a writable buffer")
        return self._move(view, land=False)

    def _move(self, run: memoryview, land: bool) -> int:
        if len(run) > self.payload_bytes - self.fed:
            raise ValueError(f"{len(run)} more bytes after {self.fed} of a {self.payload_bytes}-byte payload")
        if self._native is not None:
            done = library().pd_stream_move(self._native, _address(run), len(run), int(land), self._address,
                                            self._offsets, self._stride, len(self._bases), self._num_pieces,
                                            self._piece_bytes, self._flags, self._out)
            have = len(self.digests)
            if done > have:  # only the digests completed by this call
                raw = ctypes.string_at(ctypes.addressof(self._out) + have * DIGEST_BYTES, (done - have) * DIGEST_BYTES)
                self.digests.extend(self._known[have + i] or raw[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]
                                    for i in range(done - have))
        else:
            self._move_ref(run, land)
        self.fed += len(run)
        return len(self.digests)

    def _move_ref(self, run: memoryview, land: bool) -> None:
        """_move, one Python iteration per stretch of a piece."""
        pos, fed = 0, self.fed
        while pos < len(run):
            record, within = divmod(fed, self.record_bytes)
            piece, offset = divmod(within, self._piece_bytes)
            n = min(self._piece_bytes - offset, len(run) - pos)
            at = self._bases[record] + piece * self._stride + offset
            written = self._view[at:at + n] if land else run[pos:pos + n]
            written[:] = run[pos:pos + n] if land else self._view[at:at + n]
            if self._known[record] is None:
                self._hash.update(written)
            pos, fed = pos + n, fed + n
            if fed % self.record_bytes == 0:
                self.digests.append(self._known[record] or self._hash.digest())
                self._hash.reset()

    def _free(self, native) -> None:
        library().pd_stream_free(native)
