"""kernels.cpu_kv_copy (the native copy-and-hash of paged KV pieces) against its Python loops and against the
digest of each block's gathered record (kvstore.transfer.block_digest): byte-identical digests, identical landed
bytes, on the default model's cache shape and a tiny one, in float32 and bfloat16; the one-pass xxh3 on each
ISA against the xxhash package over record lengths around its block and stripe boundaries, into aligned and
unaligned destinations; bounds refused before any byte is written; the Python loops when the native code is
unavailable."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
import xxhash

from kernels import cpu_kv_copy
from kvstore.shm_cache import block_digests_in_place
from kvstore.transfer import block_digest

# [L, 2, num_blocks, block_size, Hkv, D]: the default model (SmolLM2) with 40 blocks, and a tiny cache
SHAPES = [(30, 2, 40, 16, 3, 64), (2, 2, 5, 4, 1, 8)]
SRC_IDS = [7, 3, 3, 0, 4, 1, 3]  # not sorted, block 3 three times
DST_IDS = [2, 0, 9, 4, 1, 7, 5]

native = pytest.mark.skipif(not cpu_kv_copy.available(), reason="native kv copy unavailable (no C compiler or "
                            "xxhash symbols): the Python loops are what runs")


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def layout(cache: torch.Tensor) -> tuple[int, int, int]:
    """(piece_bytes, stride between a block's pieces, num_pieces) of a cache [L, 2, num_blocks, bs, Hkv, D]."""
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    piece = block_size * num_kv_heads * head_dim * cache.element_size()
    return piece, num_blocks * piece, 2 * num_layers


def random_cache(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


def record_digests(cache: torch.Tensor, block_ids) -> list[bytes]:
    """The definition: xxh3-128 of each block's record [L, 2, bs, Hkv, D], gathered."""
    return [block_digest(as_bytes(cache[:, :, b].contiguous())) for b in block_ids]


def copy_case(shape, dtype):
    """(src cache, dst cache [num_blocks + 5 blocks], src/dst byte offsets and strides) for SRC_IDS -> DST_IDS."""
    src = random_cache(shape, dtype)
    dst = random_cache((*shape[:2], shape[2] + 5, *shape[3:]), dtype)
    piece, src_stride, num_pieces = layout(src)
    _, dst_stride, _ = layout(dst)
    ids = [b % shape[2] for b in SRC_IDS]
    return (src, dst, [b * piece for b in ids], src_stride, [b * piece for b in DST_IDS], dst_stride, num_pieces,
            piece, ids)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=["smollm2", "tiny"])
def test_copy_hash_matches_the_python_loop_and_the_record_digests(shape, dtype):
    src, dst, src_bases, src_stride, dst_bases, dst_stride, num_pieces, piece, ids = copy_case(shape, dtype)
    dst_ref = dst.clone()
    got = cpu_kv_copy.copy_hash_pieces(as_bytes(src), src_bases, src_stride, as_bytes(dst), dst_bases, dst_stride,
                                       num_pieces, piece)
    want = cpu_kv_copy.copy_hash_pieces_ref(as_bytes(src), src_bases, src_stride, as_bytes(dst_ref), dst_bases,
                                            dst_stride, num_pieces, piece)
    assert got == want == record_digests(src, ids)
    assert torch.equal(dst.view(torch.uint8), dst_ref.view(torch.uint8))
    assert torch.equal(dst[:, :, DST_IDS].view(torch.uint8), src[:, :, ids].view(torch.uint8))
    assert len(set(got)) == len(set(ids))  # repeated source blocks, same digest; the others differ


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=["smollm2", "tiny"])
def test_hash_in_place_matches_the_python_loop_and_the_record_digests(shape, dtype):
    cache = random_cache(shape, dtype)
    piece, stride, num_pieces = layout(cache)
    ids = [b % shape[2] for b in SRC_IDS]
    bases = [b * piece for b in ids]
    got = cpu_kv_copy.hash_pieces(as_bytes(cache), bases, stride, num_pieces, piece)
    assert got == cpu_kv_copy.hash_pieces_ref(as_bytes(cache), bases, stride, num_pieces, piece)
    assert got == record_digests(cache, ids)
    assert block_digests_in_place(cache, ids) == tuple(got)


@native
def test_copy_into_records_the_staging_layout():
    # CacheRead.copy_records: block i lands as raw record i (its pieces one after the other)
    src = random_cache(SHAPES[1], torch.bfloat16)
    piece, stride, num_pieces = layout(src)
    ids, record = [b % src.shape[2] for b in SRC_IDS], num_pieces * piece
    out = torch.zeros(len(ids) * record, dtype=torch.uint8)
    dst_bases = [i * record for i in range(len(ids))]
    digests = cpu_kv_copy.copy_hash_pieces(as_bytes(src), [b * piece for b in ids], stride, as_bytes(out),
                                           dst_bases, piece, num_pieces, piece)
    assert digests == record_digests(src, ids)
    for i, b in enumerate(ids):
        assert bytes(as_bytes(out)[i * record:(i + 1) * record]) == bytes(as_bytes(src[:, :, b].contiguous()))


# (num_pieces, piece_bytes): records of 256 bytes (the shortest whole-stripe record of xxh3's long path), 1 KiB
# (one block of 16 stripes), 1 KiB + 1 stripe (the last stripe alone after a scramble), 1 KiB + 2 stripes, many
# blocks, pieces that cut blocks anywhere; and the default model's (60 pieces of 12 KiB).
ONE_PASS_LAYOUTS = [(1, 256), (4, 64), (1, 1024), (16, 64), (17, 64), (1, 1088), (2, 576), (3, 1984), (7, 320),
                    (5, 4096), (60, 12288)]
ISAS = {"portable": cpu_kv_copy.ISA_PORTABLE, "avx2": cpu_kv_copy.ISA_AVX2, "avx512": cpu_kv_copy.ISA_AVX512}


@native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dst_offset", [0, 8], ids=["aligned", "unaligned"])
def test_the_one_pass_xxh3_gives_the_package_digests_and_bytes(isa, dst_offset):
    if cpu_kv_copy.native_path(*ONE_PASS_LAYOUTS[0], ISAS[isa]) != isa:
        pytest.skip(f"this CPU does not run {isa}")
    rng = random.Random(isa)
    for num_pieces, piece in ONE_PASS_LAYOUTS:
        num_blocks = 3
        stride = num_blocks * piece + 64  # pieces of one block are apart, the blocks' pieces interleave
        src = np.frombuffer(rng.randbytes(num_pieces * stride), dtype=np.uint8)
        bases = [2 * piece, 0, piece]
        dst = np.zeros(dst_offset + num_pieces * stride, dtype=np.uint8)
        dst_view = memoryview(dst)[dst_offset:]
        records = [b"".join(src[b + p * stride:b + p * stride + piece].tobytes() for p in range(num_pieces))
                   for b in bases]
        want = [xxhash.xxh3_128(r).digest() for r in records]
        assert cpu_kv_copy.hash_pieces(src, bases, stride, num_pieces, piece, ISAS[isa]) == want, (num_pieces, piece)
        dst_bases = [0, piece, 2 * piece]
        got = cpu_kv_copy.copy_hash_pieces(src, bases, stride, dst_view, dst_bases, stride, num_pieces, piece,
                                           ISAS[isa])
        assert got == want, (num_pieces, piece)
        for record, b in zip(records, dst_bases, strict=True):
            landed = b"".join(bytes(dst_view[b + p * stride:b + p * stride + piece]) for p in range(num_pieces))
            assert landed == record
        assert not dst[:dst_offset].any()


@native
@pytest.mark.parametrize("isa", ISAS)
def test_the_plane_by_plane_walk_returns_each_block_its_own_digest(isa):
    # The C loop walks piece p of every block in source-address order before piece p + 1, one hash per block:
    # digests and landed bytes must come back in the caller's block order, whatever that order, with repeats.
    if cpu_kv_copy.native_path(*ONE_PASS_LAYOUTS[0], ISAS[isa]) != isa:
        pytest.skip(f"this CPU does not run {isa}")
    rng = random.Random(f"walk-{isa}")
    num_pieces, piece, num_blocks = 6, 320, 40
    stride = num_blocks * piece
    src = np.frombuffer(rng.randbytes(num_pieces * stride), dtype=np.uint8)
    for ids in (list(range(num_blocks))[::-1], rng.sample(range(num_blocks), 17), [5, 5, 0, 39, 5, 12], [],
                [rng.randrange(num_blocks) for _ in range(60)]):
        bases = [b * piece for b in ids]
        want = [xxhash.xxh3_128(b"".join(src[b + p * stride:b + p * stride + piece].tobytes()
                                         for p in range(num_pieces))).digest() for b in bases]
        assert cpu_kv_copy.hash_pieces(src, bases, stride, num_pieces, piece, ISAS[isa]) == want
        dst = np.zeros(max(len(ids), 1) * num_pieces * piece, dtype=np.uint8)
        record = num_pieces * piece  # block i lands as record i: destinations in the caller's order
        got = cpu_kv_copy.copy_hash_pieces(src, bases, stride, dst, [i * record for i in range(len(ids))], piece,
                                           num_pieces, piece, ISAS[isa])
        assert got == want
        for i, b in enumerate(bases):
            assert dst[i * record:(i + 1) * record].tobytes() == b"".join(
                src[b + p * stride:b + p * stride + piece].tobytes() for p in range(num_pieces))


@pytest.mark.parametrize("isa", [*ISAS, "package"])
def test_a_walk_taken_a_few_planes_at_a_time_gives_the_digests_of_the_whole_blocks(isa):
    # What a prefill step does: each layer's pieces hashed right after they were written, the digests at the end.
    rng = random.Random(f"planes-{isa}")
    num_pieces, piece, num_blocks = 6, 320 if isa != "package" else 100, 40  # 100: not whole stripes
    if isa != "package" and cpu_kv_copy.native_path(num_pieces, piece, ISAS[isa]) != isa:
        pytest.skip(f"this CPU does not run {isa}")
    stride = num_blocks * piece
    src = np.frombuffer(bytearray(rng.randbytes(num_pieces * stride)), dtype=np.uint8)
    ids = [5, 5, 0, 39, 12] + rng.sample(range(num_blocks), 9)
    bases = [b * piece for b in ids]
    hasher = cpu_kv_copy.PlaneHasher(src, bases, stride, num_pieces, piece, ISAS.get(isa, cpu_kv_copy.ISA_BEST))
    assert hasher.native == (isa != "package" and cpu_kv_copy.available())
    with hasher:
        for n in (2, 0, 1, 3):
            with pytest.raises(ValueError, match="pieces walked"):
                hasher.digests()
            hasher.hash(n)
        with pytest.raises(ValueError, match="more pieces"):
            hasher.hash(1)
        assert hasher.digests() == cpu_kv_copy.hash_pieces_ref(memoryview(src), bases, stride, num_pieces, piece)


@native
def test_layouts_the_one_pass_xxh3_does_not_take_use_the_package():
    assert cpu_kv_copy.native_path(60, 12288) in ("avx512", "avx2", "portable")
    for num_pieces, piece in ((2, 100), (3, 64), (1, 240), (5, 96)):  # not whole stripes, or 240 bytes or less
        assert cpu_kv_copy.native_path(num_pieces, piece) == "xxhash"
        src = np.frombuffer(random.Random(piece).randbytes(num_pieces * piece * 2), dtype=np.uint8)
        want = cpu_kv_copy.hash_pieces_ref(memoryview(src), [0, piece], 2 * piece, num_pieces, piece)
        assert cpu_kv_copy.hash_pieces(src, [0, piece], 2 * piece, num_pieces, piece) == want


def test_the_python_loops_run_when_the_native_code_is_unavailable(monkeypatch):
    src, dst, src_bases, src_stride, dst_bases, dst_stride, num_pieces, piece, ids = copy_case(SHAPES[1],
                                                                                               torch.float32)
    monkeypatch.setattr(cpu_kv_copy, "available", lambda: False)
    monkeypatch.setattr(cpu_kv_copy, "library", lambda: pytest.fail("the native library was used"))
    digests = cpu_kv_copy.copy_hash_pieces(as_bytes(src), src_bases, src_stride, as_bytes(dst), dst_bases,
                                           dst_stride, num_pieces, piece)
    assert digests == record_digests(src, ids)
    assert torch.equal(dst[:, :, DST_IDS], src[:, :, ids])
    assert list(block_digests_in_place(src, ids)) == digests


@pytest.mark.parametrize("path", ["native", "python"])
def test_blocks_outside_a_buffer_are_refused_before_any_byte_is_written(path, monkeypatch):
    if path == "native" and not cpu_kv_copy.available():
        pytest.skip("native kv copy unavailable")
    if path == "python":
        monkeypatch.setattr(cpu_kv_copy, "available", lambda: False)
    src = random_cache(SHAPES[1], torch.float32)
    dst = torch.zeros_like(src)
    piece, stride, num_pieces = layout(src)
    num_blocks = src.shape[2]
    for src_ids, dst_ids in (([0, num_blocks], [0, 1]), ([0, 1], [1, num_blocks]), ([-1, 0], [0, 1]),
                             ([0, 1], [0, -1])):
        with pytest.raises(ValueError, match="run outside the"):
            cpu_kv_copy.copy_hash_pieces(as_bytes(src), [b * piece for b in src_ids], stride, as_bytes(dst),
                                         [b * piece for b in dst_ids], stride, num_pieces, piece)
        assert not dst.any()
    for bad in (num_blocks, -1, 10 ** 12):
        with pytest.raises(ValueError, match="run outside the"):
            block_digests_in_place(src, [0, bad])
    with pytest.raises(ValueError, match="source blocks for"):
        cpu_kv_copy.copy_hash_pieces(as_bytes(src), [0], stride, as_bytes(dst), [0, piece], stride, num_pieces,
                                     piece)


def test_a_missing_xxhash_symbol_leaves_the_python_loops_after_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kv_copy, "_XXH3_SYMBOLS", (*cpu_kv_copy._XXH3_SYMBOLS[:-1], "XXH_noSuchSymbol"))
    cpu_kv_copy.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_kv_copy.__name__):
            assert not cpu_kv_copy.available() and not cpu_kv_copy.available()
        warnings = [r.getMessage() for r in caplog.records if r.name == cpu_kv_copy.__name__]
        assert len(warnings) == 1 and "exports no XXH_noSuchSymbol" in warnings[0]
        cache = random_cache(SHAPES[0], torch.float32)
        assert list(block_digests_in_place(cache, SRC_IDS)) == record_digests(cache, SRC_IDS)
    finally:
        cpu_kv_copy.library.cache_clear()
