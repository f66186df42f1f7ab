"""The head of a KV transfer and its checks, as plain data: layout, manifest, rejection, chunk bounds.

Pure Python (no torch, no grpc), so that protos.convert converts manifests without pulling torch into the
gateway. The payload's bytes and codecs are in kvstore/transfer.py; the wire in kvstore/transfer_service.py.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from kvstore.reshard_plan import check_rank_heads, payload_slices

CODECS = ("raw", "int8")
TRANSPORTS = ("grpc", "shm")

MIN_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20
DEFAULT_CHUNK_BYTES = 2 << 20

DIGEST_BYTES = 16

# Status names (grpc.StatusCode member names) a rejection maps to; grpc itself stays in the service layer.
FAILED_PRECONDITION = "FAILED_PRECONDITION"
INVALID_ARGUMENT = "INVALID_ARGUMENT"

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
"""KV cache dtypes a transfer carries, by name, and their item size."""


class TransferRejected(Exception):
    """A transfer the receiver refuses as a whole. `field` names what mismatched ("layout.head_dim",
    "block_ids", "block_digests[3]", ...); `code` is the grpc status name the service answers with."""

    def __init__(self, reason: str, field: str, code: str = FAILED_PRECONDITION) -> None:
        super().__init__(f"{field}: {reason}")
        self.reason = reason
        self.field = field
        self.code = code


@dataclass(frozen=True)
class KvLayoutSpec:
    """What a block's bytes mean; sender and receiver must agree on every field."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    model_fingerprint: str

    @classmethod
    def from_cache(cls, kv_cache, model_fingerprint: str) -> KvLayoutSpec:
        """The layout of a cache tensor (anything with torch's `shape` and `dtype`)."""
        # kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        shape, dtype = tuple(kv_cache.shape), _dtype_name(kv_cache.dtype)
        if len(shape) != 6 or shape[1] != 2 or dtype not in DTYPE_BYTES:
            raise ValueError(f"kv_cache must be [L, 2, num_blocks, block_size, Hkv, D] in {list(DTYPE_BYTES)}, "
                             f"got {shape} {kv_cache.dtype}")
        num_layers, _, _, block_size, num_kv_heads, head_dim = shape
        return cls(num_layers, num_kv_heads, head_dim, block_size, dtype, model_fingerprint)

    @property
    def block_elems(self) -> int:
        """Elements of one block across all layers, K and V."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    def block_bytes(self, codec: str) -> int:
        """Bytes of one block record on the wire (see the module docstring)."""
        if codec == "raw":
            if self.dtype not in DTYPE_BYTES:
                raise ValueError(f"dtype must be one of {list(DTYPE_BYTES)}, got {self.dtype!r}")
            return self.block_elems * DTYPE_BYTES[self.dtype]
        if codec == "int8":
            return self.block_elems + self.num_layers * 2 * self.num_kv_heads * 4
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")

    def check_cache(self, kv_cache) -> None:
        """ValueError unless kv_cache has this layout (any number of blocks)."""
        want = (self.num_layers, 2, None, self.block_size, self.num_kv_heads, self.head_dim)
        if (len(kv_cache.shape) != 6 or any(w is not None and w != g for w, g in zip(want, kv_cache.shape))
                or _dtype_name(kv_cache.dtype) != self.dtype):
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match layout {self}")

    def first_mismatch(self, other: KvLayoutSpec) -> str | None:
        """Name of the first field whose value differs, or None."""
        for f in fields(self):
            if getattr(self, f.name) != getattr(other, f.name):
                return f.name
        return None


@dataclass(frozen=True)
class TransferManifest:
    """The head of a transfer (mirror of pdserve.v1.KvManifest)."""
    request_id: str
    handle: str
    layout: KvLayoutSpec
    block_ids: tuple[int, ...]  # destination ids on the receiver, in send order
    block_digests: tuple[bytes, ...]  # one per block, same order
    codec: str
    transport: str
    shm_name: str
    payload_bytes: int
    sender_kv_heads: tuple[range, ...] = ()
    """A tensor-parallel sender's KV heads per rank; () for one rank holding every head (see payload_slices)."""
    # --- streamed transfers (issue 16) ---
    digests_in_trailer: bool = False
    """block_digests is empty: the digests follow the data in the trailer (grpc, or shm with cache_segment)."""
    # --- zero-copy same-host transfers (issue 16): blocks copied straight out of the sender's cache ---
    cache_segment: str = ""
    """The sender's KV cache segment (kvstore.shm_cache); "" for every other data path."""
    src_block_ids: tuple[int, ...] = ()
    """Blocks of that cache to copy, one per block_ids entry."""
    cache_num_blocks: int = 0
    """Blocks of the segment's cache tensor."""
    sender_epoch: str = ""
    """The segment's epoch, as its header holds it."""

    def payload_slices(self) -> tuple[range, ...]:
        """The KV heads of each payload slice, in payload order (one slice of every head without sender ranks).
        The manifest must have passed validate_manifest."""
        if not self.sender_kv_heads:
            return (range(self.layout.num_kv_heads),)
        return tuple(w.kv_heads for w in payload_slices(self.sender_kv_heads))


def validate_manifest(manifest: TransferManifest, expected_layout: KvLayoutSpec, block_ids: Sequence[int],
                      num_cache_blocks: int) -> None:
    """Raise TransferRejected naming the first field that makes `manifest` unacceptable. `block_ids`: the
    destination ids the receiver set aside, in order, inside its cache of `num_cache_blocks` blocks."""
    if manifest.codec not in CODECS:
        raise TransferRejected(f"unknown codec {manifest.codec!r}, expected one of {CODECS}", "codec",
                               INVALID_ARGUMENT)
    if manifest.transport not in TRANSPORTS:
        raise TransferRejected(f"unknown transport {manifest.transport!r}, expected one of {TRANSPORTS}",
                               "transport", INVALID_ARGUMENT)
    if manifest.cache_segment:
        _check_cache_path(manifest)
    elif (manifest.transport == "shm") != bool(manifest.shm_name):
        raise TransferRejected(f"shm_name {manifest.shm_name!r} with transport {manifest.transport!r}: required "
                               "for shm and only for shm", "shm_name", INVALID_ARGUMENT)
    mismatch = manifest.layout.first_mismatch(expected_layout)
    if mismatch is not None:
        raise TransferRejected(f"sender has {getattr(manifest.layout, mismatch)!r}, receiver expects "
                               f"{getattr(expected_layout, mismatch)!r}", f"layout.{mismatch}")
    outside = [b for b in manifest.block_ids if not 0 <= b < num_cache_blocks]
    if outside:
        raise TransferRejected(f"ids {outside[:8]} outside the receiver's cache of {num_cache_blocks} "
                               "blocks", "block_ids", INVALID_ARGUMENT)
    if tuple(manifest.block_ids) != tuple(block_ids):
        raise TransferRejected(f"{len(manifest.block_ids)} ids {list(manifest.block_ids[:8])}... are not the "
                               f"reservation's {len(block_ids)} ids {list(block_ids[:8])}...",
                               "block_ids", INVALID_ARGUMENT)
    if manifest.sender_kv_heads:
        try:
            check_rank_heads(manifest.sender_kv_heads, expected_layout.num_kv_heads)
            payload_slices(manifest.sender_kv_heads)
        except ValueError as exc:
            raise TransferRejected(str(exc), "sender_kv_heads", INVALID_ARGUMENT) from None
    if manifest.digests_in_trailer:
        _check_streamed(manifest)
    else:
        _check_digests(manifest, manifest.block_digests)
    expected_bytes = len(manifest.block_ids) * expected_layout.block_bytes(manifest.codec)
    if manifest.payload_bytes != expected_bytes:
        raise TransferRejected(f"{manifest.payload_bytes} bytes announced, {len(manifest.block_ids)} {manifest.codec} "
                               f"blocks of this layout are {expected_bytes}", "payload_bytes")


def _check_digests(manifest: TransferManifest, digests: Sequence[bytes]) -> None:
    """One well-formed digest per block of each payload slice (slice by slice)."""
    num_blocks, num_slices = len(manifest.block_ids), len(manifest.payload_slices())
    if len(digests) != num_slices * num_blocks:
        sliced = f" in {num_slices} payload slices" if manifest.sender_kv_heads else ""
        raise TransferRejected(f"{len(digests)} digests for {num_blocks} blocks{sliced}", "block_digests")
    bad = [i for i, d in enumerate(digests) if len(d) != DIGEST_BYTES]
    if bad:
        raise TransferRejected(f"digest {bad[0]} has {len(digests[bad[0]])} bytes, expected {DIGEST_BYTES}",
                               "block_digests")


# --- streamed transfers (issue 16): the digests follow the data, in a trailer ---
def _check_streamed(manifest: TransferManifest) -> None:
    if manifest.transport != "grpc" and not manifest.cache_segment:
        raise TransferRejected(f"digests_in_trailer with transport {manifest.transport!r}: only grpc and the "
                               "shm cache path stream a trailer", "digests_in_trailer", INVALID_ARGUMENT)
    if manifest.block_digests:
        raise TransferRejected(f"{len(manifest.block_digests)} digests in a manifest that announces them in the "
                               "trailer", "block_digests", INVALID_ARGUMENT)


def _check_cache_path(manifest: TransferManifest) -> None:
    """The fields of a zero-copy manifest (cache_segment set); the segment itself is checked when mapped."""
    for ok, field, why in (
            (manifest.transport == "shm", "transport", f"{manifest.transport!r}: the cache path is shm only"),
            (not manifest.shm_name, "shm_name", f"{manifest.shm_name!r} next to cache_segment: one data path"),
            (manifest.codec == "raw", "codec", f"{manifest.codec!r}: the cache path copies raw blocks"),
            (not manifest.sender_kv_heads, "sender_kv_heads", "the cache path is one sender rank"),
            (manifest.digests_in_trailer, "digests_in_trailer", "the cache path sends the digests in the trailer"),
            (len(manifest.src_block_ids) == len(manifest.block_ids), "src_block_ids",
             f"{len(manifest.src_block_ids)} source blocks for {len(manifest.block_ids)} destination blocks"),
            (all(0 <= b < manifest.cache_num_blocks for b in manifest.src_block_ids), "src_block_ids",
             f"ids outside the sender's cache of {manifest.cache_num_blocks} blocks"),
            (bool(manifest.sender_epoch), "sender_epoch", "required with cache_segment")):
        if not ok:
            raise TransferRejected(why, field, INVALID_ARGUMENT)


def check_trailer_digests(manifest: TransferManifest, digests: Sequence[bytes]) -> None:
    """TransferRejected unless the trailer holds one well-formed digest per block (and payload slice)."""
    _check_digests(manifest, digests)


def check_chunk_bytes(chunk_bytes: int) -> None:
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")


def num_chunks(payload_bytes: int, chunk_bytes: int) -> int:
    return -(-payload_bytes // chunk_bytes)

def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")
