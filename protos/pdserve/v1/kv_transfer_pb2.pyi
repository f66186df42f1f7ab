from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "model_fingerprint")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    model_fingerprint: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class KvManifest(_message.Message):
    __slots__ = ("request_id", "handle", "layout", "block_ids", "block_digests", "codec", "transport", "shm_name", "payload_bytes", "sender_kv_heads", "digests_in_trailer", "cache_segment", "src_block_ids", "cache_num_blocks", "sender_epoch")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENDER_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_IN_TRAILER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SENDER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    handle: str
    layout: KvLayout
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_digests: _containers.RepeatedScalarFieldContainer[bytes]
    codec: str
    transport: str
    shm_name: str
    payload_bytes: int
    sender_kv_heads: _containers.RepeatedCompositeFieldContainer[KvRankHeads]
    digests_in_trailer: bool
    cache_segment: str
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_num_blocks: int
    sender_epoch: str
    def __init__(self, request_id: _Optional[str] = ..., handle: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_digests: _Optional[_Iterable[bytes]] = ..., codec: _Optional[str] = ..., transport: _Optional[str] = ..., shm_name: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., sender_kv_heads: _Optional[_Iterable[_Union[KvRankHeads, _Mapping]]] = ..., digests_in_trailer: _Optional[bool] = ..., cache_segment: _Optional[str] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., cache_num_blocks: _Optional[int] = ..., sender_epoch: _Optional[str] = ...) -> None: ...

class KvRankHeads(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class KvTrailer(_message.Message):
    __slots__ = ("block_digests",)
    BLOCK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    block_digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("manifest", "data", "trailer")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    manifest: KvManifest
    data: bytes
    trailer: KvTrailer
    def __init__(self, manifest: _Optional[_Union[KvManifest, _Mapping]] = ..., data: _Optional[bytes] = ..., trailer: _Optional[_Union[KvTrailer, _Mapping]] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("bytes", "num_blocks", "reshard_bytes", "reshard_slices")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESHARD_SLICES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    num_blocks: int
    reshard_bytes: int
    reshard_slices: int
    def __init__(self, bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., reshard_bytes: _Optional[int] = ..., reshard_slices: _Optional[int] = ...) -> None: ...
