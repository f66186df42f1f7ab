"""Chained, process-independent block hashes: the global content key of a full KV block.

    h_-1 = root_hash(model_fingerprint)
    h_i  = hash_block(h_{i-1}, tokens of block i, extra_keys_i)

Only full blocks are hashed. Gateway and workers compute the same values in different processes
(and machines), so the hash is defined by bytes, never by Python's ``hash()``:

    H(bytes) = xxhash.xxh3_128 (seed 0), read as an unsigned 128-bit Python int.

Canonical encodings (all integers little-endian):

    root_hash:   b"pdserve/root/v1\\0" + u32(len(fp_utf8)) + fp_utf8
    hash_block:  parent            16 bytes (u128)
                 u32(num_tokens)   then each token id as u32 (ids must be in [0, 2**32))
                 u32(num_extras)   then for each extra key: u32(len(utf8)) + utf8

Length prefixes make the encoding unambiguous (no two inputs share bytes). ``cache_salt`` (per-tenant
isolation) enters as the extra key ``"salt:" + cache_salt`` of the FIRST block only: chaining carries
it into every later hash. ``None`` and ``""`` both mean "no salt". Gateway and workers both hash through
``extend_block_hashes`` (``hash_prompt_blocks`` is its from-scratch form), so the salt is encoded in one
place, ``first_block_extras``. Changing any of this is a protocol
change: bump the ``v1`` tag and the pinned vectors in tests/unit/kvstore/test_hashing.py.
"""
from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

_ROOT_TAG = b"pdserve/root/v1\x00"
_U32 = struct.Struct("<I")
_NEEDS_BYTESWAP = sys.byteorder == "big"
_xxh3_128 = xxhash.xxh3_128_intdigest

assert array("I").itemsize == 4, "token ids are packed as u32; array('I') must be 4 bytes"


def _u32_le_bytes(token_ids: Sequence[int]) -> bytes:
    packed = array("I", token_ids)
    if _NEEDS_BYTESWAP:
        packed.byteswap()
    return packed.tobytes()


def _encode_extras(extra_keys: tuple[str, ...]) -> bytes:
    parts = [_U32.pack(len(extra_keys))]
    for key in extra_keys:
        data = key.encode("utf-8")
        parts.append(_U32.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


_NO_EXTRAS = _encode_extras(())


def root_hash(model_fingerprint: str) -> int:
    """h_-1 for a model: any change of the fingerprint (weights, dtype, tokenizer) separates all caches."""
    data = model_fingerprint.encode("utf-8")
    return _xxh3_128(_ROOT_TAG + _U32.pack(len(data)) + data)


def hash_block(parent_hash: int, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> int:
    """Hash of one block given its parent's hash, its token ids and its extra keys (see module doc)."""
    extras = _encode_extras(extra_keys) if extra_keys else _NO_EXTRAS
    return _xxh3_128(parent_hash.to_bytes(16, "little") + _U32.pack(len(token_ids))
                     + _u32_le_bytes(token_ids) + extras)


def first_block_extras(cache_salt: str | None) -> tuple[str, ...]:
    """Extra keys of block 0: ``("salt:" + cache_salt,)``, or none when there is no salt."""
    return (f"salt:{cache_salt}",) if cache_salt else ()


def extend_block_hashes(block_hashes: list[int], token_ids: Sequence[int], block_size: int, root: int,
                        cache_salt: str | None = None) -> list[int]:
    """Append to ``block_hashes`` (the chained hashes of the first blocks of ``token_ids``) the hashes of
    every further FULL block of ``token_ids``; returns the appended hashes. The one implementation of the
    chain: the gateway hashes a prompt from ``[]``, a worker extends its sequence's list as tokens arrive.

    Equal to folding ``hash_block`` block by block; packs the new token ids once instead of per block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    start = len(block_hashes)
    num_full = len(token_ids) // block_size
    if num_full <= start:
        return []
    packed = _u32_le_bytes(token_ids[start * block_size: num_full * block_size])
    stride = 4 * block_size
    header = _U32.pack(block_size)
    parent = block_hashes[-1] if block_hashes else root
    new: list[int] = []
    for i in range(start, num_full):
        extras = _encode_extras(first_block_extras(cache_salt)) if i == 0 and cache_salt else _NO_EXTRAS
        j = i - start
        parent = _xxh3_128(parent.to_bytes(16, "little") + header + packed[j * stride:(j + 1) * stride] + extras)
        new.append(parent)
    block_hashes.extend(new)
    return new


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, root: int,
                       cache_salt: str | None = None) -> list[int]:
    """Chained hashes of the FULL blocks of ``token_ids`` (a trailing partial block is not hashed)."""
    return extend_block_hashes([], token_ids, block_size, root, cache_salt)


def block_hash_hex(h: int) -> str:
    """Fixed-width (32 lowercase hex chars) form of a block hash; the Redis key suffix."""
    return f"{h:032x}"
