"""KV transfer codec: encode -> chunk -> reassemble -> decode -> scatter round trips, digests, manifest checks."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import xxhash

from kernels import dequantize_blocks_int8, gather_blocks, quantize_blocks_int8
from kvstore.transfer import (BufferPool, PayloadAssembler, block_digest, decode_payload, encode_records,
                              iter_chunks, write_records)
from kvstore.transfer_manifest import (DEFAULT_CHUNK_BYTES, FAILED_PRECONDITION, INVALID_ARGUMENT, MAX_CHUNK_BYTES,
                                       MIN_CHUNK_BYTES, KvLayoutSpec, TransferManifest, TransferRejected,
                                       validate_manifest)
from protos.convert import manifest_from_pb, manifest_to_pb

# 48 KiB fp32 blocks: 40 of them make a 1.875 MiB payload, i.e. two 1 MiB chunks with block 21 split across them.
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 3, 2, 64, 16
SRC_IDS = [17, 3, 8, 0, 29, 11, 5, 22, 14, 1, 26, 9, 31, 2, 19, 7, 24, 12, 30, 4,
           15, 27, 6, 21, 10, 28, 13, 23, 16, 25, 18, 20, 36, 33, 39, 34, 38, 32, 37, 35]
DST_IDS = [60 - i for i in range(40)]


def make_cache(num_blocks: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
    shape = (NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """Blocks gathered in one piece, with a digest per record: the reference the sender's streams must equal."""
    codec: str
    block_bytes: int
    data: torch.Tensor  # [num_blocks * block_bytes] uint8
    digests: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def view(self) -> memoryview:
        return memoryview(self.data.numpy())


def encode_blocks(kv_cache, block_ids, codec) -> Encoded:
    data = encode_records(kv_cache, block_ids, codec)
    bb = KvLayoutSpec.from_cache(kv_cache, "").block_bytes(codec)
    view = memoryview(data.numpy())
    return Encoded(codec, bb, data, tuple(block_digest(view[i * bb:(i + 1) * bb]) for i in range(len(block_ids))))


def chunk(payload: Encoded, chunk_bytes: int):
    return iter_chunks([payload.data], chunk_bytes)


def receive(manifest: TransferManifest, chunks, layout: KvLayoutSpec) -> torch.Tensor:
    assembler = PayloadAssembler(manifest, layout.block_bytes(manifest.codec))
    for data in chunks:
        assembler.add(data)
    return assembler.finish()


def manifest_for(payload, layout: KvLayoutSpec, dst_ids, **changes) -> TransferManifest:
    m = TransferManifest("req-1", "handle-1", layout, tuple(dst_ids), payload.digests, payload.codec, "grpc", "",
                         payload.nbytes)
    return dataclasses.replace(m, **changes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_round_trip_lands_exactly_at_the_destination_ids(dtype):
    src = make_cache(40, dtype)
    dst = torch.full((NUM_LAYERS, 2, 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), -7.0, dtype=dtype)
    before = dst.clone()
    layout = KvLayoutSpec.from_cache(src, "fp")
    payload = encode_blocks(src, SRC_IDS, "raw")
    chunks = list(chunk(payload, MIN_CHUNK_BYTES))
    full, rest = divmod(payload.nbytes, MIN_CHUNK_BYTES)
    assert [len(c) for c in chunks] == [MIN_CHUNK_BYTES] * full + [rest]

    buffer = receive(manifest_for(payload, layout, DST_IDS), chunks, layout)
    decode_payload(buffer, layout, "raw", len(DST_IDS)).scatter_into(dst, DST_IDS)

    for s, d in zip(SRC_IDS, DST_IDS):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    untouched = [b for b in range(64) if b not in DST_IDS]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])


def test_int8_round_trip_is_within_quantization_error_and_equals_the_kernel_reference():
    src = make_cache(40)
    dst = torch.zeros(NUM_LAYERS, 2, 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    layout = KvLayoutSpec.from_cache(src, "fp")
    payload = encode_blocks(src, SRC_IDS, "int8")
    assert payload.nbytes == len(SRC_IDS) * layout.block_bytes("int8")

    buffer = receive(manifest_for(payload, layout, DST_IDS), chunk(payload, MIN_CHUNK_BYTES), layout)
    decode_payload(buffer, layout, "int8", len(DST_IDS)).scatter_into(dst, DST_IDS)

    staging = gather_blocks(src, torch.tensor(SRC_IDS))  # [n, L, 2, block_size, Hkv, D]
    expected = dequantize_blocks_int8(*quantize_blocks_int8(staging), torch.float32)
    received = gather_blocks(dst, torch.tensor(DST_IDS))
    assert torch.equal(received, expected)
    # |error| <= scale / 2 with scale = absmax / 127 per (block, layer, K/V, head)
    half_step = staging.abs().amax(dim=(3, 5), keepdim=True) / 254
    assert ((received - staging).abs() <= half_step * (1 + 1e-5) + 1e-7).all()
    assert (received != staging).any()  # it really went through int8


def test_payload_byte_layout_is_the_documented_one():
    src = make_cache(40)
    layout = KvLayoutSpec.from_cache(src, "fp")
    ids = [5, 2, 9]
    staging = gather_blocks(src, torch.tensor(ids))  # [3, L, 2, block_size, Hkv, D]
    raw = encode_blocks(src, ids, "raw")
    assert raw.block_bytes == NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
    assert raw.data.numpy().tobytes() == staging.numpy().tobytes()

    int8 = encode_blocks(src, ids, "int8")
    data, scales = quantize_blocks_int8(staging)  # [3, L, 2, bs, Hkv, D] int8, [3, L, 2, Hkv] fp32
    records = b"".join(data[i].numpy().tobytes() + scales[i].numpy().tobytes() for i in range(3))
    assert int8.data.numpy().tobytes() == records
    assert int8.block_bytes == layout.block_elems + NUM_LAYERS * 2 * NUM_KV_HEADS * 4


def test_digests_are_xxh3_128_of_each_block_record():
    assert block_digest(b"pdserve").hex() == "1b1d32a6d82a350ad298a937ac90120e"  # pinned: protocol
    src = make_cache(40)
    src[:, :, 7] = src[:, :, 3]
    for codec in ("raw", "int8"):
        payload = encode_blocks(src, [3, 7, 4], codec)
        view = payload.view()
        bb = payload.block_bytes
        assert payload.digests == tuple(xxhash.xxh3_128(view[i * bb:(i + 1) * bb]).digest() for i in range(3))
        assert payload.digests[0] == payload.digests[1] != payload.digests[2]  # content, not block id


def test_one_changed_value_changes_exactly_that_blocks_digest():
    src = make_cache(40)
    before = encode_blocks(src, SRC_IDS, "raw").digests
    src[2, 1, SRC_IDS[5], 3, 1, 7] += 1.0
    after = encode_blocks(src, SRC_IDS, "raw").digests
    assert [i for i in range(len(SRC_IDS)) if before[i] != after[i]] == [5]


def test_write_records_into_caller_memory_equals_the_gathered_payload_and_its_digests():
    src = make_cache(40, torch.bfloat16)
    for codec in ("raw", "int8"):
        full = encode_blocks(src, SRC_IDS, codec)
        out = torch.full((full.nbytes + 100,), 0xAB, dtype=torch.uint8)  # a buffer bigger than the payload
        digests = []
        for start in range(0, len(SRC_IDS), 7):  # groups of 7, as the sender writes them
            ids = SRC_IDS[start:start + 7]
            digests.extend(write_records(src, ids, codec, out[start * full.block_bytes:
                                                              (start + len(ids)) * full.block_bytes]))
        assert tuple(digests) == full.digests
        assert torch.equal(out[:full.nbytes], full.data)
        assert (out[full.nbytes:] == 0xAB).all()  # nothing written past the records
    with pytest.raises(ValueError, match="out must be"):
        write_records(src, SRC_IDS, "raw", torch.empty(10, dtype=torch.uint8))


def test_trailer_mode_assembler_hashes_as_data_arrives_and_checks_the_trailer():
    src = make_cache(40)
    layout = KvLayoutSpec.from_cache(src, "fp")
    payload = encode_blocks(src, SRC_IDS, "raw")
    manifest = manifest_for(payload, layout, DST_IDS, block_digests=(), digests_in_trailer=True)
    validate_manifest(manifest, layout, DST_IDS, 64)
    reused = torch.zeros(payload.nbytes + 4096, dtype=torch.uint8)

    assembler = PayloadAssembler(manifest, payload.block_bytes, reused)
    for data in chunk(payload, MIN_CHUNK_BYTES):
        assembler.add(data)
    assert torch.equal(assembler.finish(payload.digests), payload.data)
    assert reused[:payload.nbytes].data_ptr() == assembler.buffer.data_ptr()  # assembled in the given buffer

    def finish_with(digests):
        assembler = PayloadAssembler(manifest, payload.block_bytes)
        for data in chunk(payload, MIN_CHUNK_BYTES):
            assembler.add(data)
        with pytest.raises(TransferRejected) as info:
            assembler.finish(digests)
        return info.value

    bad = list(payload.digests)
    bad[5] = bytes(16)
    assert finish_with(tuple(bad)).field == "block_digests[5]"
    assert finish_with(payload.digests[:-1]).field == "block_digests"
    assert (finish_with(None).field, finish_with(None).code) == ("trailer", INVALID_ARGUMENT)
    with pytest.raises(TransferRejected) as info:  # digests in both places
        validate_manifest(dataclasses.replace(manifest, block_digests=payload.digests), layout, DST_IDS, 64)
    assert info.value.field == "block_digests"
    with pytest.raises(TransferRejected) as info:
        validate_manifest(dataclasses.replace(manifest, transport="shm", shm_name="pdkv_1_0000000000_000000"),
                          layout, DST_IDS, 64)
    assert info.value.field == "digests_in_trailer"


def test_buffer_pool_reuses_the_smallest_fitting_buffer_and_bounds_what_it_keeps():
    pool = BufferPool(max_idle_bytes=12 << 20)
    small, big = pool.take(1000), pool.take(5 << 20)
    assert (small.numel(), big.numel()) == (4 << 20, 8 << 20)  # rounded up to powers of two, >= 4 MiB
    pool.give_back(big)
    pool.give_back(small)
    assert pool.take(3 << 20).data_ptr() == small.data_ptr()
    assert pool.take(3 << 20).data_ptr() == big.data_ptr()
    assert pool.num_allocated == 2
    pool.give_back(small)
    pool.give_back(big)
    pool.give_back(torch.empty(8 << 20, dtype=torch.uint8))  # 20 MiB idle > 12: the smallest go
    assert pool.idle_bytes() == 8 << 20


def test_chunks_span_group_boundaries_and_rejoin():
    buffers = [bytes([i]) * n for i, n in enumerate([700_000, 10, 1_500_000, 0, MIN_CHUNK_BYTES])]
    pieces = list(iter_chunks(buffers, MIN_CHUNK_BYTES))
    total = sum(len(b) for b in buffers)
    assert [len(p) for p in pieces] == [MIN_CHUNK_BYTES] * (total // MIN_CHUNK_BYTES) + [total % MIN_CHUNK_BYTES]
    assert b"".join(pieces) == b"".join(buffers)
    assert list(iter_chunks([], DEFAULT_CHUNK_BYTES)) == []
    for bad in (MIN_CHUNK_BYTES - 1, MAX_CHUNK_BYTES + 1):
        with pytest.raises(ValueError, match="chunk_bytes"):
            list(iter_chunks(buffers, bad))


def test_assembler_rejects_corruption_before_the_stream_ends_and_short_or_long_streams():
    src = make_cache(40)
    layout = KvLayoutSpec.from_cache(src, "fp")
    payload = encode_blocks(src, SRC_IDS, "raw")
    manifest = manifest_for(payload, layout, DST_IDS)
    first, second = chunk(payload, MIN_CHUNK_BYTES)
    bb = payload.block_bytes

    corrupted = bytearray(first)
    corrupted[3 * bb + 100] ^= 1
    assembler = PayloadAssembler(manifest, bb)
    with pytest.raises(TransferRejected) as info:
        assembler.add(bytes(corrupted))
    assert (info.value.field, info.value.code) == ("block_digests[3]", FAILED_PRECONDITION)
    assert f"destination block {DST_IDS[3]}" in info.value.reason

    assembler = PayloadAssembler(manifest, bb)
    assembler.add(first)
    with pytest.raises(TransferRejected) as info:
        assembler.finish()
    assert info.value.field == "payload_bytes"

    assembler = PayloadAssembler(manifest, bb)
    assembler.add(first)
    assembler.add(second)
    with pytest.raises(TransferRejected) as info:
        assembler.add(b"x")
    assert info.value.field == "payload_bytes"


LAYOUT = KvLayoutSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, "float32", "smollm2-fp")
RESERVATION = ((4, 9, 2), 10)   # destination ids, blocks in the receiver's cache
GOOD = TransferManifest("req-1", "handle-1", LAYOUT, (4, 9, 2), (b"\x00" * 16,) * 3, "raw", "grpc", "",
                        3 * LAYOUT.block_bytes("raw"))


def test_a_consistent_manifest_passes():
    validate_manifest(GOOD, LAYOUT, *RESERVATION)
    validate_manifest(dataclasses.replace(GOOD, transport="shm", shm_name="pdkv_1_ab"), LAYOUT, *RESERVATION)
    validate_manifest(dataclasses.replace(GOOD, codec="int8", payload_bytes=3 * LAYOUT.block_bytes("int8")),
                      LAYOUT, *RESERVATION)


@pytest.mark.parametrize("field, value", [("num_layers", 30), ("num_kv_heads", 3), ("head_dim", 128),
                                          ("block_size", 32), ("dtype", "bfloat16"),
                                          ("model_fingerprint", "other-weights")])
def test_every_layout_mismatch_is_rejected_naming_its_field(field, value):
    sent = dataclasses.replace(GOOD, layout=dataclasses.replace(LAYOUT, **{field: value}))
    with pytest.raises(TransferRejected) as info:
        validate_manifest(sent, LAYOUT, *RESERVATION)
    assert (info.value.field, info.value.code) == (f"layout.{field}", FAILED_PRECONDITION)
    assert repr(value) in info.value.reason


@pytest.mark.parametrize("changes, field, code", [
    ({"codec": "fp8"}, "codec", INVALID_ARGUMENT),
    ({"transport": "rdma"}, "transport", INVALID_ARGUMENT),
    ({"transport": "shm"}, "shm_name", INVALID_ARGUMENT),
    ({"shm_name": "pdkv_1_ab"}, "shm_name", INVALID_ARGUMENT),
    ({"block_ids": (4, 9, 10)}, "block_ids", INVALID_ARGUMENT),  # out of bounds
    ({"block_ids": (4, 9, -1)}, "block_ids", INVALID_ARGUMENT),
    ({"block_ids": (4, 2, 9)}, "block_ids", INVALID_ARGUMENT),  # not the reservation's (order matters)
    ({"block_ids": (4, 9)}, "block_ids", INVALID_ARGUMENT),
    ({"block_digests": (b"\x00" * 16,) * 2}, "block_digests", FAILED_PRECONDITION),
    ({"block_digests": (b"\x00" * 16, b"\x00" * 8, b"\x00" * 16)}, "block_digests", FAILED_PRECONDITION),
    ({"payload_bytes": 3 * LAYOUT.block_bytes("raw") - 1}, "payload_bytes", FAILED_PRECONDITION),
    ({"codec": "int8"}, "payload_bytes", FAILED_PRECONDITION),  # raw-sized payload announced as int8
])
def test_every_manifest_rejection_names_its_field(changes, field, code):
    with pytest.raises(TransferRejected) as info:
        validate_manifest(dataclasses.replace(GOOD, **changes), LAYOUT, *RESERVATION)
    assert (info.value.field, info.value.code) == (field, code)
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu test: no CUDA device available")
@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_round_trip_between_cuda_caches(codec):
    src = make_cache(40).cuda()
    dst = torch.zeros(NUM_LAYERS, 2, 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda")
    layout = KvLayoutSpec.from_cache(src, "fp")
    payload = encode_blocks(src, SRC_IDS, codec)  # Triton gather on the device, bytes on the host
    assert payload.data.device.type == "cpu"
    out = torch.empty(payload.nbytes, dtype=torch.uint8)
    assert write_records(src, SRC_IDS, codec, out) == payload.digests and torch.equal(out, payload.data)

    buffer = receive(manifest_for(payload, layout, DST_IDS), chunk(payload, MIN_CHUNK_BYTES), layout)
    decode_payload(buffer, layout, codec, len(DST_IDS)).scatter_into(dst, DST_IDS)

    sent = gather_blocks(src, torch.tensor(SRC_IDS, device="cuda"))
    got = gather_blocks(dst, torch.tensor(DST_IDS, device="cuda"))
    if codec == "raw":
        assert torch.equal(got, sent)
    else:
        half_step = sent.abs().amax(dim=(3, 5), keepdim=True) / 254
        assert ((got - sent).abs() <= half_step * (1 + 1e-5) + 1e-7).all()


# --- the zero-copy path's manifest (kvstore.shm_cache): the blocks are named in the sender's cache segment ---
CACHE_PUSH = dataclasses.replace(GOOD, transport="shm", block_digests=(), digests_in_trailer=True,
                                 cache_segment="pdkv_1_cache_0123abcd", src_block_ids=(7, 0, 3), cache_num_blocks=8,
                                 sender_epoch="0123456789abcdef")


def test_a_consistent_zero_copy_manifest_passes_and_round_trips_through_protobuf():
    validate_manifest(CACHE_PUSH, LAYOUT, *RESERVATION)
    assert manifest_from_pb(manifest_to_pb(CACHE_PUSH)) == CACHE_PUSH
    assert manifest_from_pb(manifest_to_pb(GOOD)).cache_segment == ""   # absent fields: every other path


@pytest.mark.parametrize("changes, field", [
    ({"transport": "grpc"}, "transport"),
    ({"shm_name": "pdkv_1_ab"}, "shm_name"),
    ({"codec": "int8", "payload_bytes": 3 * LAYOUT.block_bytes("int8")}, "codec"),
    ({"sender_kv_heads": (range(0, 2),)}, "sender_kv_heads"),
    ({"digests_in_trailer": False, "block_digests": (b"\x00" * 16,) * 3}, "digests_in_trailer"),
    ({"src_block_ids": (7, 0)}, "src_block_ids"),
    ({"src_block_ids": (7, 0, 8)}, "src_block_ids"),              # outside the sender's cache of 8 blocks
    ({"sender_epoch": ""}, "sender_epoch"),
])
def test_every_zero_copy_manifest_rejection_names_its_field(changes, field):
    with pytest.raises(TransferRejected) as info:
        validate_manifest(dataclasses.replace(CACHE_PUSH, **changes), LAYOUT, *RESERVATION)
    assert (info.value.field, info.value.code) == (field, INVALID_ARGUMENT)
