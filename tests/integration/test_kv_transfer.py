"""KV transfer end to end: a real grpc server on 127.0.0.1, a receiver owning a cache tensor, KvSender pushing
over the grpc and shm transports."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
import torch

from engine.parallel.partition import kv_head_ranges, plan_kv_resharding
from kernels import gather_blocks
from kvstore.reshard_plan import payload_slices
from kvstore.shm import SHM_DIR
from kvstore.transfer_manifest import DEFAULT_CHUNK_BYTES, KvLayoutSpec, TransferManifest, TransferRejected
from kvstore.transfer_service import GRPC_OPTIONS, KvTransferServicer, ReceiveTarget, ReceivedBlocks
from kvstore.kv_sender import FaultInjection, KvSender, TransferFailed
from kvstore.transfer_slices import KvSlices, merge_slices, take_heads
from protos.convert import layout_to_pb
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

TIMEOUT_S = 120.0
FINGERPRINT = "test-weights-v1"


def segment_exists(name: str) -> bool:
    return (SHM_DIR / name).exists()


class CacheReceiver:
    """A decode worker's transfer side reduced to a dict of reservations over one cache tensor."""

    def __init__(self, layout: KvLayoutSpec, num_blocks: int) -> None:
        self.layout = layout
        gen = torch.Generator().manual_seed(1234)
        # kv_cache: [L, 2, num_blocks, block_size, Hkv, D], filled with noise so "untouched" is checkable
        self.kv_cache = torch.randn((layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads,
                                     layout.head_dim), generator=gen).to(getattr(torch, layout.dtype))
        self._reservations: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._lock = threading.Lock()
        self.checked: list[TransferManifest] = []
        self.segment_seen: list[bool] = []
        self.committed: list[tuple[str, str, ReceivedBlocks]] = []
        self.rejected: list[tuple[str, str, str]] = []

    def reserve(self, request_id: str, block_ids) -> str:
        handle = f"h-{request_id}"
        with self._lock:
            self._reservations[handle] = (request_id, tuple(block_ids))
        return handle

    def check(self, manifest: TransferManifest) -> ReceiveTarget:
        with self._lock:
            self.checked.append(manifest)
            if manifest.transport == "shm":
                self.segment_seen.append(segment_exists(manifest.shm_name))
            reservation = self._reservations.get(manifest.handle)
        if reservation is None or reservation[0] != manifest.request_id:
            raise TransferRejected(f"no reservation {manifest.handle!r} for {manifest.request_id!r}", "handle")
        return ReceiveTarget(self.layout, reservation[1], self.kv_cache)

    def commit(self, request_id: str, handle: str, blocks: ReceivedBlocks) -> None:
        with self._lock:
            del self._reservations[handle]
            self.committed.append((request_id, handle, blocks))

    def reject(self, request_id: str, handle: str, reason: str) -> None:
        with self._lock:
            self._reservations.pop(handle, None)
            self.rejected.append((request_id, handle, reason))


def layout_of(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32", fingerprint=FINGERPRINT):
    return KvLayoutSpec(num_layers, num_kv_heads, head_dim, block_size, dtype, fingerprint)


def source_cache(layout: KvLayoutSpec, num_blocks: int, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return (torch.randn(shape, generator=gen) * 2).to(getattr(torch, layout.dtype))


@pytest.fixture
def serve():
    """serve(receiver) -> endpoint of a started in-process KvTransfer server; all stopped at teardown."""
    servers = []

    def start(receiver) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
        kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(KvTransferServicer(receiver), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


@pytest.fixture
def sender():
    with KvSender() as s:
        yield s


# 48 blocks of 64 KiB: a 3 MiB payload, two 2 MiB chunks.
SRC_IDS = list(range(50, 2, -1))
DST_IDS = [i * 2 + 1 for i in range(48)]


def push(sender, endpoint, receiver, src, layout, *, request_id="req-1", src_ids=SRC_IDS, dst_ids=DST_IDS, **kw):
    handle = receiver.reserve(request_id, dst_ids)
    return sender.push(endpoint, request_id=request_id, handle=handle, layout=layout, kv_cache=src,
                       src_block_ids=src_ids, dst_block_ids=dst_ids, timeout_s=TIMEOUT_S, **kw)


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_raw_push_copies_the_blocks_exactly(serve, sender, transport):
    layout = layout_of()
    src = source_cache(layout, 64)
    receiver = CacheReceiver(layout, 100)
    before = receiver.kv_cache.clone()

    stats = push(sender, serve(receiver), receiver, src, layout, transport=transport, codec="raw")

    dst = receiver.kv_cache
    assert torch.equal(gather_blocks(dst, torch.tensor(DST_IDS)), gather_blocks(src, torch.tensor(SRC_IDS)))
    others = [b for b in range(100) if b not in DST_IDS]
    assert torch.equal(dst[:, :, others], before[:, :, others])
    assert (stats.transport, stats.codec, stats.num_blocks) == (transport, "raw", 48)
    assert stats.num_bytes == 48 * layout.block_bytes("raw") == 3 * 2**20
    assert receiver.rejected == []
    [(request_id, handle, blocks)] = receiver.committed
    assert (request_id, handle, blocks.block_ids, blocks.transport) == ("req-1", "h-req-1", tuple(DST_IDS), transport)


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_int8_push_is_within_quantization_error(serve, sender, transport):
    layout = layout_of(num_layers=16, dtype="bfloat16")  # 65,792-byte int8 records: two chunks, one record split
    src = source_cache(layout, 64)
    receiver = CacheReceiver(layout, 100)

    stats = push(sender, serve(receiver), receiver, src, layout, transport=transport, codec="int8")

    sent = gather_blocks(src, torch.tensor(SRC_IDS)).float()  # [n, L, 2, block_size, Hkv, D]
    got = gather_blocks(receiver.kv_cache, torch.tensor(DST_IDS)).float()
    # int8 step = absmax / 127 per (block, layer, K/V, head); half a step, plus bf16 rounding of the result
    half_step = sent.abs().amax(dim=(3, 5), keepdim=True) / 254
    assert ((got - sent).abs() <= half_step + sent.abs() * 2**-8 + 1e-6).all()
    assert not torch.equal(got, sent)
    assert stats.num_bytes == 48 * (16 * 2 * 16 * 2 * 64 + 16 * 2 * 2 * 4) > DEFAULT_CHUNK_BYTES
    assert len(receiver.committed) == 1 and receiver.rejected == []


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_corrupted_chunk_is_rejected_and_leaves_nothing_of_it(serve, sender, transport):
    layout = layout_of()
    src = source_cache(layout, 64)
    receiver = CacheReceiver(layout, 100)
    before = receiver.kv_cache.clone()
    endpoint = serve(receiver)

    # The last chunk: every block before it passes its digest. grpc lands each chunk as it arrives and zeroes the
    # destination blocks on rejection; shm scatters only after every digest passed.
    with pytest.raises(TransferFailed) as info:
        push(sender, endpoint, receiver, src, layout, transport=transport, fault=FaultInjection(corrupt_chunk_index=1))

    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    corrupt_block = DEFAULT_CHUNK_BYTES // layout.block_bytes("raw")  # the first block of chunk 1
    assert f"block_digests[{corrupt_block}]" in info.value.details
    rest = [b for b in range(100) if b not in DST_IDS]
    assert torch.equal(receiver.kv_cache[:, :, rest], before[:, :, rest])
    if transport == "grpc":
        assert not receiver.kv_cache[:, :, DST_IDS].any()
    else:
        assert torch.equal(receiver.kv_cache, before)
    assert receiver.committed == []
    [(request_id, handle, reason)] = receiver.rejected
    assert (request_id, handle) == ("req-1", "h-req-1") and "digest" in reason
    if transport == "shm":
        assert receiver.segment_seen == [True]
        assert not segment_exists(receiver.checked[0].shm_name)


def test_shm_segment_is_gone_after_the_push(serve, sender):
    layout = layout_of()
    receiver = CacheReceiver(layout, 100)
    push(sender, serve(receiver), receiver, source_cache(layout, 64), layout, transport="shm")
    [manifest] = receiver.checked
    assert receiver.segment_seen == [True]  # it existed while the receiver read it
    assert not segment_exists(manifest.shm_name)


@pytest.mark.parametrize("field, sender_layout", [
    ("layout.num_kv_heads", layout_of(num_kv_heads=1)),
    ("layout.head_dim", layout_of(head_dim=32)),
    ("layout.dtype", layout_of(dtype="float16")),
    ("layout.model_fingerprint", layout_of(fingerprint="other-weights")),
])
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_layout_mismatch_is_rejected_naming_the_field(serve, sender, transport, field, sender_layout):
    receiver = CacheReceiver(layout_of(), 100)
    before = receiver.kv_cache.clone()
    with pytest.raises(TransferFailed) as info:
        push(sender, serve(receiver), receiver, source_cache(sender_layout, 64), sender_layout, transport=transport)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details.startswith(f"{field}: ")
    assert [r[:2] for r in receiver.rejected] == [("req-1", "h-req-1")]
    assert torch.equal(receiver.kv_cache, before)
    if transport == "shm":
        assert not segment_exists(receiver.checked[0].shm_name)


def test_destination_out_of_bounds_is_invalid_argument(serve, sender):
    layout = layout_of()
    receiver = CacheReceiver(layout, 32)
    with pytest.raises(TransferFailed) as info:
        push(sender, serve(receiver), receiver, source_cache(layout, 64), layout, src_ids=[1, 2, 3],
             dst_ids=[5, 32, 6], transport="grpc")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details.startswith("block_ids: ") and "[32]" in info.value.details
    assert len(receiver.rejected) == 1


def test_destination_ids_other_than_the_reservation_are_invalid_argument(serve, sender):
    layout = layout_of()
    receiver = CacheReceiver(layout, 32)
    handle = receiver.reserve("req-1", [5, 6, 7])
    with pytest.raises(TransferFailed) as info:
        sender.push(serve(receiver), request_id="req-1", handle=handle, layout=layout,
                    kv_cache=source_cache(layout, 8), src_block_ids=[1, 2, 3], dst_block_ids=[5, 7, 6],
                    transport="grpc", timeout_s=TIMEOUT_S)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details.startswith("block_ids: ")
    assert [r[:2] for r in receiver.rejected] == [("req-1", handle)]


def test_unknown_reservation_is_rejected(serve, sender):
    layout = layout_of()
    receiver = CacheReceiver(layout, 32)
    with pytest.raises(TransferFailed) as info:
        sender.push(serve(receiver), request_id="req-9", handle="nope", layout=layout,
                    kv_cache=source_cache(layout, 8), src_block_ids=[1], dst_block_ids=[5], transport="grpc",
                    timeout_s=TIMEOUT_S)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details.startswith("handle: ")
    assert receiver.rejected == [] and receiver.committed == []  # a refused check has nothing to release


def _raw_push(endpoint: str, messages):
    with grpc.insecure_channel(endpoint) as channel:
        return kv_transfer_pb2_grpc.KvTransferStub(channel).Push(iter(messages), timeout=TIMEOUT_S)


def test_missing_shm_segment_is_rejected_not_silently_fallen_back(serve):
    layout = layout_of()
    receiver = CacheReceiver(layout, 32)
    handle = receiver.reserve("req-1", [5])
    manifest = kv_transfer_pb2.KvManifest(
        request_id="req-1", handle=handle, layout=layout_to_pb(layout), block_ids=[5], block_digests=[b"\0" * 16],
        codec="raw", transport="shm", shm_name="pdkv_0_doesnotexist", payload_bytes=layout.block_bytes("raw"))
    with pytest.raises(grpc.RpcError) as info:
        _raw_push(serve(receiver), [kv_transfer_pb2.KvChunk(manifest=manifest)])
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details().startswith("shm_name: ")
    assert len(receiver.rejected) == 1 and receiver.committed == []


def test_stream_not_starting_with_a_manifest_is_invalid_argument(serve):
    receiver = CacheReceiver(layout_of(), 32)
    with pytest.raises(grpc.RpcError) as info:
        _raw_push(serve(receiver), [kv_transfer_pb2.KvChunk(data=b"x" * 10)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("manifest: ")


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_64_blocks_of_a_smollm2_layout_move_exactly(serve, sender, transport):
    # SmolLM2-135M: 30 layers, 3 kv heads of 64; fp32 blocks of 16 tokens are 737,280 bytes (46 MiB for 64).
    layout = layout_of(num_layers=30, num_kv_heads=3, head_dim=64)
    assert layout.block_bytes("raw") == 30 * 2 * 16 * 3 * 64 * 4 == 737_280
    src = source_cache(layout, 80)
    receiver = CacheReceiver(layout, 96)
    src_ids, dst_ids = list(range(8, 72)), list(range(95, 31, -1))

    stats = push(sender, serve(receiver), receiver, src, layout, src_ids=src_ids, dst_ids=dst_ids,
                 transport=transport)

    assert stats.num_bytes == 64 * 737_280
    assert torch.equal(gather_blocks(receiver.kv_cache, torch.tensor(dst_ids)),
                       gather_blocks(src, torch.tensor(src_ids)))
    assert len(receiver.committed) == 1


def sliced_source(src: torch.Tensor, sender_kv_heads, src_ids=SRC_IDS) -> KvSlices:
    """What a tensor-parallel sender gathers from its ranks: blocks `src_ids` of each payload slice's heads."""
    ids = torch.tensor(src_ids)
    return KvSlices(tuple(sender_kv_heads), tuple(
        src[:, :, ids][:, :, :, :, w.kv_heads.start:w.kv_heads.stop].contiguous()
        for w in payload_slices(sender_kv_heads)))


@pytest.mark.parametrize("transport", ["grpc", "shm"])
@pytest.mark.parametrize("src_tp,codec", [(2, "raw"), (2, "int8"), (4, "raw")])  # 3 KV heads: 2 + 1 at TP=2;
# at TP=4 KV head 0 is on ranks 0 and 1
def test_sliced_push_from_tensor_parallel_ranks_lands_every_head(serve, sender, transport, codec, src_tp):
    layout = layout_of(num_kv_heads=3)
    src = source_cache(layout, 64)
    receiver, unsliced = CacheReceiver(layout, 100), CacheReceiver(layout, 100)
    endpoint = serve(receiver)

    heads = kv_head_ranges(3, src_tp)
    stats = push(sender, endpoint, receiver, sliced_source(src, heads), layout, src_ids=list(range(48)),
                 transport=transport, codec=codec)
    push(sender, serve(unsliced), unsliced, src, layout, transport=transport, codec=codec)

    [manifest] = receiver.checked
    num_slices = 2 if src_tp == 2 else 3
    assert manifest.sender_kv_heads == heads
    # per slice and block, in the manifest (shm) or in the trailer after the data (grpc)
    assert len(manifest.block_digests) == (num_slices * 48 if transport == "shm" else 0)
    # every head once on the wire: as many bytes as the unsliced payload, and the same cache after
    assert stats.num_bytes == unsliced.committed[0][2].num_bytes == 48 * layout.block_bytes(codec)
    assert torch.equal(receiver.kv_cache, unsliced.kv_cache)
    # a receiver with one rank takes all three slices (KV heads 0, 1, 2 from ranks 0, 2, 3 at TP=4)
    assert (stats.reshard_bytes, stats.reshard_slices) == (stats.num_bytes, num_slices)
    assert receiver.committed[0][2].reshard_bytes == stats.num_bytes and receiver.rejected == []


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_sliced_push_corrupted_in_its_second_slice_is_rejected(serve, sender, transport):
    layout = layout_of(num_kv_heads=3)
    src = source_cache(layout, 64)
    receiver = CacheReceiver(layout, 100)
    before = receiver.kv_cache.clone()

    with pytest.raises(TransferFailed) as info:  # chunk 2 starts inside slice 1 (heads 2): 48 * 64 KiB of slice 0
        push(sender, serve(receiver), receiver, sliced_source(src, kv_head_ranges(3, 2)), layout,
             src_ids=list(range(48)), transport=transport, fault=FaultInjection(corrupt_chunk_index=2))

    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    slice0_bytes = 48 * layout.block_bytes("raw") * 2 // 3
    record = (2 * DEFAULT_CHUNK_BYTES - slice0_bytes) // (layout.block_bytes("raw") // 3)
    assert f"block {record} of payload slice 1" in info.value.details
    assert f"block_digests[{48 + record}]" in info.value.details
    assert torch.equal(receiver.kv_cache, before) and receiver.committed == []


class RankedReceiver(CacheReceiver):
    """A tensor-parallel receiver: its ranks' caches are one tensor per rank, written through the plan."""

    def __init__(self, layout: KvLayoutSpec, num_blocks: int, tp_size: int) -> None:
        super().__init__(layout, num_blocks)
        self.rank_kv_heads = kv_head_ranges(layout.num_kv_heads, tp_size)
        self.rank_caches = [self.kv_cache[:, :, :, :, h.start:h.stop].clone() for h in self.rank_kv_heads]
        self.plans = []

    def check(self, manifest: TransferManifest) -> ReceiveTarget:
        target = super().check(manifest)
        return ReceiveTarget(target.layout, target.block_ids, target.kv_cache.to("meta"), self.write,
                             self.rank_kv_heads)

    def write(self, plan, slices, block_ids) -> None:
        self.plans.append(plan)
        for rank, cache in enumerate(self.rank_caches):
            mine = merge_slices([(s.kv_heads, take_heads(slices, s.kv_heads)) for s in plan.slices_to(rank)])
            mine.scatter_into(cache, block_ids)


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_push_to_tensor_parallel_ranks_follows_the_plan(serve, sender, transport):
    layout = layout_of(num_kv_heads=3)
    src = source_cache(layout, 64)
    receiver = RankedReceiver(layout, 100, 4)  # KV head 0 on receiving ranks 0 and 1

    stats = push(sender, serve(receiver), receiver, sliced_source(src, kv_head_ranges(3, 2)), layout,
                 src_ids=list(range(48)), transport=transport)

    [plan] = receiver.plans
    assert plan == plan_kv_resharding(2, 4, 3)
    sent = gather_blocks(src, torch.tensor(SRC_IDS))  # [n, L, 2, block_size, 3, D]
    for cache, heads in zip(receiver.rank_caches, receiver.rank_kv_heads):
        assert torch.equal(gather_blocks(cache, torch.tensor(DST_IDS)), sent[:, :, :, :, heads.start:heads.stop])
    # head 0 crossed the wire once and went to two ranks: 4 of 3 heads' bytes handed out, in 4 slices
    assert (stats.reshard_bytes, stats.reshard_slices) == (stats.num_bytes * 4 // 3, 4)
