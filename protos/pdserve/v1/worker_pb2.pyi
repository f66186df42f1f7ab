from protos.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "seed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    seed: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., seed: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request", "lease_ms")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    lease_ms: int
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class TransferTarget(_message.Message):
    __slots__ = ("endpoint", "handle", "num_cached_blocks", "block_ids", "host_id")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    handle: str
    num_cached_blocks: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    host_id: str
    def __init__(self, endpoint: _Optional[str] = ..., handle: _Optional[str] = ..., num_cached_blocks: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., host_id: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("target", "lease_expiry_unix_ms", "lease_ms")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    target: TransferTarget
    lease_expiry_unix_ms: int
    lease_ms: int
    def __init__(self, target: _Optional[_Union[TransferTarget, _Mapping]] = ..., lease_expiry_unix_ms: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("request_id", "handle", "lease_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    handle: str
    lease_ms: int
    def __init__(self, request_id: _Optional[str] = ..., handle: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("lease_expiry_unix_ms", "lease_ms")
    LEASE_EXPIRY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_expiry_unix_ms: int
    lease_ms: int
    def __init__(self, lease_expiry_unix_ms: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "target")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    target: TransferTarget
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ..., target: _Optional[_Union[TransferTarget, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "cached_tokens", "computed_tokens", "transfer_bytes", "transfer_ms", "transport", "prefill_ms", "prompt_logprobs", "choice_first_tokens", "reshard_bytes", "reshard_slices")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESHARD_SLICES_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    cached_tokens: int
    computed_tokens: int
    transfer_bytes: int
    transfer_ms: float
    transport: str
    prefill_ms: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptTokenLogprob]
    choice_first_tokens: _containers.RepeatedCompositeFieldContainer[ChoiceFirstToken]
    reshard_bytes: int
    reshard_slices: int
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., transfer_ms: _Optional[float] = ..., transport: _Optional[str] = ..., prefill_ms: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PromptTokenLogprob, _Mapping]]] = ..., choice_first_tokens: _Optional[_Iterable[_Union[ChoiceFirstToken, _Mapping]]] = ..., reshard_bytes: _Optional[int] = ..., reshard_slices: _Optional[int] = ...) -> None: ...

class ChoiceFirstToken(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _common_pb2.TokenLogprob
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "handle", "first_token_id", "first_logprob", "prefill_locally", "choice_first_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    handle: str
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    prefill_locally: bool
    choice_first_tokens: _containers.RepeatedCompositeFieldContainer[ChoiceFirstToken]
    def __init__(self, request_id: _Optional[str] = ..., handle: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., prefill_locally: _Optional[bool] = ..., choice_first_tokens: _Optional[_Iterable[_Union[ChoiceFirstToken, _Mapping]]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "cached_tokens", "prompt_logprobs", "choice_index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptTokenLogprob]
    choice_index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PromptTokenLogprob, _Mapping]]] = ..., choice_index: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "epoch", "num_blocks", "free_blocks", "used_blocks", "running", "waiting", "reserved", "transfer_errors", "preemptions", "tensor_parallel_size", "kv_resharding_bytes", "decode_compile_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ERRORS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_RESHARDING_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    epoch: int
    num_blocks: int
    free_blocks: int
    used_blocks: int
    running: int
    waiting: int
    reserved: int
    transfer_errors: int
    preemptions: int
    tensor_parallel_size: int
    kv_resharding_bytes: int
    decode_compile_seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., epoch: _Optional[int] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., reserved: _Optional[int] = ..., transfer_errors: _Optional[int] = ..., preemptions: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., kv_resharding_bytes: _Optional[int] = ..., decode_compile_seconds: _Optional[float] = ...) -> None: ...
