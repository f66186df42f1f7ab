"""Copy-and-hash of paged KV pieces in native C (kernels/cpu_kv_copy.c): kvstore.shm_cache's zero-copy push.

A *block* is `num_pieces` pieces of `piece_bytes` bytes at byte offsets `base + p * stride` (p = 0 .. num_pieces - 1)
of a 1-D byte buffer (anything exposing the buffer protocol: a memoryview of an mmap, of a tensor's numpy view);
its digest is xxh3-128 streamed over its pieces in order, as `xxhash.xxh3_128().digest()` gives it (16 canonical,
big-endian bytes). For the KV cache [L, 2, num_blocks, block_size, Hkv, D]: base = block_id * piece_bytes,
stride = num_blocks * piece_bytes, num_pieces = 2 * L (kvstore.shm_cache's module doc).

    hash_pieces(src, bases, stride, num_pieces, piece_bytes)
        the digest of each block, read where it is
    copy_hash_pieces(src, src_bases, src_stride, dst, dst_bases, dst_stride, num_pieces, piece_bytes)
        copy block i of src to block i of dst piece by piece, each piece hashed right after it landed (in L1/L2):
        the digests of the bytes in dst, never of what was read from src (kvstore.shm_cache says why)

Both check first that every piece of every block lies inside its buffer (ValueError naming the block, before
any byte is written), then run the C loop when `available()`, else the Python loops `*_ref` (the definition:
same digests, same bytes landed). The C code is compiled on first use by kernels.native_build and calls the
installed xxhash package's own xxh3 functions (resolved with ctypes from its extension module; the runtime-
dispatched update, AVX2/AVX512, when it exports one, as the package's own update uses): no second xxh3. No
compiler, a failed build or a symbol the extension lacks logs one warning and `available()` is False. ctypes
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
    lib.pd_copy_hash_pieces.argtypes = [ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, ptr]
    lib.pd_hash_pieces.restype = ctypes.c_int
    lib.pd_hash_pieces.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr]
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


def hash_pieces(src, bases: Sequence[int], stride: int, num_pieces: int, piece_bytes: int) -> list[bytes]:
    """The xxh3-128 digest of each block of `src` (module doc), hashed where it is."""
    view = _checked("src", src, bases, stride, num_pieces, piece_bytes)
    if not bases or not available():
        return hash_pieces_ref(view, bases, stride, num_pieces, piece_bytes)
    lib, out = library(), ctypes.create_string_buffer(len(bases) * DIGEST_BYTES)
    if lib.pd_hash_pieces(_address(view), _offsets(bases), stride, len(bases), num_pieces, piece_bytes, out):
        raise MemoryError("native kv copy: out of memory for an xxh3 state")
    return _split(out, len(bases))


def copy_hash_pieces(src, src_bases: Sequence[int], src_stride: int, dst, dst_bases: Sequence[int],
                     dst_stride: int, num_pieces: int, piece_bytes: int) -> list[bytes]:
    """Block i of `src` -> block i of `dst` (module doc): the xxh3-128 digest of each block as it landed."""
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
                               _offsets(dst_bases), dst_stride, len(src_bases), num_pieces, piece_bytes, out):
        raise MemoryError("native kv copy: out of memory for an xxh3 state")
    return _split(out, len(src_bases))
