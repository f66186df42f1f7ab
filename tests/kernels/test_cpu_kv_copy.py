"""kernels.cpu_kv_copy (the native copy-and-hash of paged KV pieces) against its Python loops and against the
digest of each block's gathered record (kvstore.transfer.block_digest): byte-identical digests, identical landed
bytes, on the default model's cache shape and a tiny one, in float32 and bfloat16; bounds refused before any
byte is written; the Python loops when the native code is unavailable."""

from __future__ import annotations

import logging

import pytest
import torch

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
