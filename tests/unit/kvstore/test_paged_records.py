"""kvstore.paged_records: a payload of raw records gathered out of / landed in a paged cache at any chunk boundary,
hashed as it moves, equal to the gathered payload and its per-record digests, natively and in Python."""
from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from kernels import cpu_kv_copy, gather_blocks
from kvstore.paged_records import PagedRecords, is_paged_cache
from kvstore.transfer import PayloadAssembler, block_digest, encode_records
from kvstore.transfer_manifest import KvLayoutSpec, TransferManifest, TransferRejected

# 3 layers x 2 heads x 8 x 4 tokens, float32: 1 KiB pieces, 6 KiB records
SHAPE = (3, 2, 12, 4, 2, 8)
SRC_IDS = [7, 0, 11, 3, 5]
DST_IDS = [2, 9, 4, 10, 0]
LAYOUT = KvLayoutSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
                      model_fingerprint="test")


def make_cache(seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))  # [L, 2, num_blocks, bs, Hkv, D]


NATIVE_ISAS = {"native": cpu_kv_copy.ISA_BEST, "native-avx2": cpu_kv_copy.ISA_AVX2,
               "native-portable": cpu_kv_copy.ISA_PORTABLE}


@pytest.fixture(params=[*NATIVE_ISAS, "python"])
def stream_impl(request, monkeypatch):
    """Each test with the native stream (kernels/cpu_kv_copy.c) on the best ISA, on AVX2 and portable C, and with
    its Python loops."""
    if request.param in NATIVE_ISAS:
        if not cpu_kv_copy.available():
            pytest.skip("native kv copy unavailable: the Python loops are what runs")
        isa = NATIVE_ISAS[request.param]
        if isa != cpu_kv_copy.ISA_BEST and cpu_kv_copy.native_path(1, 1024, isa) != request.param[len("native-"):]:
            pytest.skip(f"this CPU does not run {request.param}")
        monkeypatch.setattr(cpu_kv_copy.PieceStream.__init__, "__defaults__", (isa, None))
    else:
        monkeypatch.setattr(cpu_kv_copy, "available", lambda: False)
    return request.param


def cuts_of(total: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + chunk_bytes, total)) for lo in range(0, total, chunk_bytes)]


@pytest.mark.parametrize("chunk_bytes", [1, 1000, 1024, 6144, 7000, 1 << 20])
def test_chunks_gathered_out_of_the_cache_are_the_payload_with_each_records_digest(chunk_bytes, stream_impl):
    cache = make_cache()
    records = PagedRecords(cache, SRC_IDS)
    payload = encode_records(cache, SRC_IDS, "raw")  # [n * block_bytes] uint8, gathered by the kernels
    assert records.record_bytes == LAYOUT.block_bytes("raw") and records.payload_bytes == payload.numel()
    chunks, counts = [], []
    with records.stream() as stream:
        for lo, hi in cuts_of(records.payload_bytes, chunk_bytes):
            chunk = bytearray(hi - lo)
            counts.append(stream.gather(chunk))
            chunks.append(bytes(chunk))
        with pytest.raises(ValueError, match="more bytes after"):
            stream.gather(bytearray(1))
    assert b"".join(chunks) == payload.numpy().tobytes()
    bb = records.record_bytes
    assert stream.digests == [block_digest(payload[i * bb:(i + 1) * bb].numpy()) for i in range(len(SRC_IDS))]
    assert counts[-1] == len(SRC_IDS) and counts == sorted(counts)
    assert counts[0] == (chunk_bytes // bb if chunk_bytes < records.payload_bytes else len(SRC_IDS))


@pytest.mark.parametrize("chunk_bytes", [1000, 6144, 1 << 20])
def test_records_whose_digests_the_sender_has_are_gathered_unhashed_and_keep_those_digests(chunk_bytes, stream_impl):
    """Known digests (a prefill worker's): those records' bytes still go out, their digests are taken as given
    (a made-up one comes back unchanged: nothing hashed it), and the others are hashed as they are gathered."""
    cache = make_cache()
    records = PagedRecords(cache, SRC_IDS)
    payload = encode_records(cache, SRC_IDS, "raw").numpy().tobytes()
    bb = records.record_bytes
    truth = [block_digest(payload[i * bb:(i + 1) * bb]) for i in range(len(SRC_IDS))]
    given = [bytes([i]) * 16 if i % 2 == 0 else None for i in range(len(SRC_IDS))]  # not the records' digests
    chunks = []
    with records.stream(given) as stream:
        for lo, hi in cuts_of(records.payload_bytes, chunk_bytes):
            chunk = bytearray(hi - lo)
            stream.gather(chunk)
            chunks.append(bytes(chunk))
        with pytest.raises(ValueError, match="known digests are for gathering"):
            stream.land(bytes(1))
    assert b"".join(chunks) == payload
    assert stream.digests == [g or t for g, t in zip(given, truth, strict=True)]
    for bad in (given[:-1], [*given[:-1], b"short"]):
        with pytest.raises(ValueError, match="known: one 16-byte digest or None per record"):
            records.stream(bad)


@pytest.mark.parametrize("cuts", [[], [1], [1000, 1001, 5000], [6144, 12288], [30719]])
def test_landing_at_any_cut_writes_each_record_in_its_block_and_nothing_else(cuts, stream_impl):
    src, dst = make_cache(1), make_cache(2)
    before = dst.clone()
    payload = encode_records(src, SRC_IDS, "raw").numpy().tobytes()
    stream = PagedRecords(dst, DST_IDS).stream()
    bounds = [0, *cuts, len(payload)]
    for lo, hi in pairwise(bounds):
        stream.land(payload[lo:hi])
    assert torch.equal(gather_blocks(dst, torch.tensor(DST_IDS)), gather_blocks(src, torch.tensor(SRC_IDS)))
    rest = [b for b in range(SHAPE[2]) if b not in DST_IDS]
    assert torch.equal(dst[:, :, rest], before[:, :, rest])
    bb = LAYOUT.block_bytes("raw")
    assert stream.digests == [block_digest(payload[i * bb:(i + 1) * bb]) for i in range(len(SRC_IDS))]
    stream.close()


@pytest.mark.parametrize("piece_bytes", [96, 100], ids=["records-of-whole-stripes", "the-package-xxh3"])
def test_a_stream_of_any_piece_size_lands_and_gathers_the_payload_and_its_digests(piece_bytes, stream_impl):
    # 96-byte pieces: 576-byte records, 9 whole stripes, half of them across two pieces; 100: 600-byte records
    num_pieces, bases = 6, [0, 2 * piece_bytes, piece_bytes]
    stride = 4 * piece_bytes
    blocks = bytes(range(256)) * (stride * num_pieces // 256 + 1)
    blocks = bytearray(blocks[:stride * num_pieces])
    records = [b"".join(blocks[b + p * stride:b + (p + 1) * stride][:piece_bytes] for p in range(num_pieces))
               for b in bases]
    payload = b"".join(records)
    with cpu_kv_copy.PieceStream(blocks, bases, stride, num_pieces, piece_bytes) as out:
        chunks = [bytearray(n) for n in (7, 64, 300, len(payload) - 371)]
        for chunk in chunks:
            out.gather(chunk)
    assert b"".join(chunks) == payload and out.digests == [block_digest(r) for r in records]
    landing = bytearray(len(blocks))
    with cpu_kv_copy.PieceStream(landing, bases, stride, num_pieces, piece_bytes) as into:
        for lo, hi in pairwise([0, 1, 65, 200, len(payload)]):
            into.land(payload[lo:hi])
    assert into.digests == out.digests
    assert [b"".join(landing[b + p * stride:b + p * stride + piece_bytes] for p in range(num_pieces))
            for b in bases] == records


def test_a_stream_refuses_a_read_only_gather_buffer_and_blocks_outside_the_cache():
    records = PagedRecords(make_cache(), SRC_IDS)
    with records.stream() as stream, pytest.raises(ValueError, match="writable"):
        stream.gather(bytes(16))
    with pytest.raises(ValueError, match="block 1 at byte"):
        cpu_kv_copy.PieceStream(bytearray(6144 * 2), [0, 6144 * 2], 1024, 6, 1024)


def test_only_a_contiguous_cpu_cache_is_paged():
    cache = make_cache()
    assert is_paged_cache(cache)
    assert not is_paged_cache(cache.transpose(3, 4)) and not is_paged_cache(cache.to("meta"))
    with pytest.raises(ValueError, match="contiguous CPU cache"):
        PagedRecords(cache.transpose(3, 4), SRC_IDS)


def test_a_landing_assembler_checks_manifest_digests_as_records_complete():
    src, dst = make_cache(1), make_cache(2)
    payload = encode_records(src, SRC_IDS, "raw")
    bb = LAYOUT.block_bytes("raw")
    digests = [block_digest(payload[i * bb:(i + 1) * bb].numpy()) for i in range(len(SRC_IDS))]
    digests[2] = bytes(16)
    manifest = TransferManifest("r", "h", LAYOUT, tuple(DST_IDS), tuple(digests), "raw", "grpc", "", payload.numel())
    assembler = PayloadAssembler(manifest, bb, landing=PagedRecords(dst, DST_IDS))
    data = payload.numpy().tobytes()
    assembler.add(data[:3 * bb - 1])  # blocks 0 and 1 complete and match; block 2 lacks its last byte
    with pytest.raises(TransferRejected) as info:
        assembler.add(data[3 * bb - 1:])
    assert info.value.field == "block_digests[2]"
    with pytest.raises(ValueError, match="landing holds"):
        PayloadAssembler(manifest, bb, landing=PagedRecords(dst, DST_IDS[:4]))
