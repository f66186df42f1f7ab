"""Python client of the public API (`pdserve.v1.Generation`, served by the gateway).

    with Client("127.0.0.1:50051") as client:
        for chunk in client.chat([{"role": "user", "content": "Hi!"}], max_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)
        print(client.complete("The capital of France is", max_tokens=8).text)
        weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        done = client.complete_chat(messages, tools=[weather], tool_choice="required")  # done.tool_calls

    async with AsyncClient("127.0.0.1:50051") as client:
        async for chunk in client.generate([1, 2, 3], max_tokens=8):
            ...

Security: `api_key` is sent as `authorization: Bearer <key>` metadata on every call; `tls=True` (or a
`ca_cert` PEM bundle, implying it) talks TLS to the gateway, verified against that bundle or the system's roots:

    Client("gw.example.com:50051", api_key=key, ca_cert="ca.pem")

Protobuf stops here: results are plain dataclasses. Options left out are not sent, so the server's documented
defaults apply (see `GenerateOptions`). Every RPC failure is raised as `PdserveError` with its gRPC status code.
Closing a stream (`close()`, leaving its `with` block, or dropping it) cancels the call; the gateway then
aborts the request on its workers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import grpc

from engine.structured import StructuredOutputSpec
from protos.convert import structured_to_pb
from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

if TYPE_CHECKING:
    from typing_extensions import Unpack

DEFAULT_TARGET = "127.0.0.1:50051"

FinishReason = Literal["stop", "length", "abort"]
_FINISH_FROM_PB: dict[int, FinishReason | None] = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None, common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_ABORT: "abort"}
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


class PdserveError(Exception):
    """A failed call: `code` is the gRPC status (INVALID_ARGUMENT names the bad field in `message`)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @property
    def retryable(self) -> bool:
        """True for overload (RESOURCE_EXHAUSTED) and no healthy worker (UNAVAILABLE): try again later."""
        return self.code in _RETRYABLE

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> PdserveError:
        code = error.code() if callable(getattr(error, "code", None)) else None
        details = error.details() if callable(getattr(error, "details", None)) else None
        return cls(code or grpc.StatusCode.UNKNOWN, details or str(error))


class GenerateOptions(TypedDict, total=False):
    """Keyword options of every generate/chat/complete call; one left out is not sent (server default)."""

    max_tokens: int  # most tokens to generate (server default 16)
    temperature: float  # 0 = greedy (server default 1.0)
    top_p: float  # nucleus mass in (0, 1]
    top_k: int  # keep the k most likely tokens; 0 disables
    min_p: float  # drop tokens below min_p x the top token's probability
    seed: int | None  # seed of the request's random stream; None draws one
    stop: Sequence[str]  # strings that end generation (not part of the output)
    stop_token_ids: Sequence[int]  # token ids that end generation (kept in the output)
    ignore_eos: bool  # keep generating past end-of-sequence tokens
    logprobs: int | None  # return each token's logprob plus this many alternatives (0..20); None disables
    repetition_penalty: float  # CTRL-style, > 0; 1 = off
    presence_penalty: float  # OpenAI-style, in [-2, 2]
    frequency_penalty: float  # OpenAI-style, in [-2, 2]
    structured_output: StructuredOutputSpec | None  # constrain the output (engine.structured); None leaves it free
    min_tokens: int  # EOS, stop tokens and stop strings have no effect until this many tokens were generated
    logit_bias: Mapping[int, float]  # token id -> bias in [-100, 100] added to its logit
    prompt_logprobs: int | None  # each prompt token's logprob (after the first) plus this many alternatives
    cache_salt: str  # requests share cached prefix blocks only with requests of the same salt
    request_id: str  # caller-chosen id; empty lets the gateway assign one
    model: str  # served model name from list_models(); empty means the default


class ChatOptions(GenerateOptions, total=False):
    """`chat` / `complete_chat` options: GenerateOptions plus tool calling (OpenAI's shapes)."""

    tools: Sequence[Mapping[str, Any]]  # [{"type": "function", "function": {"name", "description", "parameters"}}]
    tool_choice: str | Mapping[str, Any]  # "auto", "none", "required" or {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool  # False: at most one call (with "required" or a named function)


_REQUEST_OPTIONS = ("cache_salt", "request_id", "model")
_SAMPLING_OPTIONS = frozenset(GenerateOptions.__annotations__) - set(_REQUEST_OPTIONS)
_TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls")


# ------------------------------------------------------------------------------------------------ results
@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    """(token_id, logprob) alternatives, most likely first."""

    @classmethod
    def from_pb(cls, pb: common_pb2.TokenLogprob) -> TokenLogprob:
        return cls(pb.token_id, pb.logprob, tuple((t.token_id, t.logprob) for t in pb.top))


@dataclass(frozen=True)
class PromptLogprob:
    """A prompt token's log-probability given the tokens before it, its rank (1 = the most likely token) and the
    most likely alternatives at its position."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]

    @classmethod
    def from_pb(cls, pb: common_pb2.PromptTokenLogprob) -> PromptLogprob:
        lp = TokenLogprob.from_pb(pb.logprob)
        return cls(lp.token_id, lp.logprob, pb.rank, lp.top)


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV came from a prefix cache instead of being computed."""

    @classmethod
    def from_pb(cls, pb: generation_pb2.Usage) -> Usage:
        return cls(pb.prompt_tokens, pb.completion_tokens, pb.cached_tokens)


@dataclass(frozen=True)
class Timings:
    """Where a request's time went, in milliseconds from its arrival at the gateway."""

    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    ttft_ms: float
    transport: str
    """KV transport used: "shm", "grpc", or "local" (the decode worker prefilled)."""
    transfer_bytes: int
    kv_reshard_bytes: int = 0
    """KV bytes the transfer's re-sharding plan handed the decode worker's tensor-parallel ranks (0 when local)."""
    kv_reshard_slices: int = 0
    """The plan's (prefill rank, decode rank) slices: 1 when neither worker is tensor parallel, 0 when local."""

    @classmethod
    def from_pb(cls, pb: generation_pb2.Timings) -> Timings:
        return cls(pb.queue_ms, pb.prefill_ms, pb.transfer_ms, pb.ttft_ms, pb.transport, pb.transfer_bytes,
                   pb.kv_reshard_bytes, pb.kv_reshard_slices)


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model made (chat with tools)."""

    id: str
    name: str
    arguments: str
    """The arguments object as JSON text."""

    @classmethod
    def from_pb(cls, pb: generation_pb2.ToolCall) -> ToolCall:
        return cls(pb.id, pb.name, pb.arguments_json)


@dataclass(frozen=True)
class Chunk:
    """One streamed piece of a completion; the last one has finish_reason, usage and timings set (with
    sampling n > 1, each choice's last has its finish_reason and only the request's last has usage)."""

    request_id: str
    text: str
    """New text since the previous chunk (never a partial UTF-8 character)."""
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    """Chat with tools, on the last chunk: the calls the model made (`text` is then the content outside them)."""
    choice_index: int = 0
    prompt_logprobs: tuple[PromptLogprob, ...] = ()
    """With the prompt_logprobs option, on the first chunk: prompt tokens 1..n-1 (the first has none)."""

    @classmethod
    def from_pb(cls, pb: generation_pb2.GenerateResponse) -> Chunk:
        return cls(request_id=pb.request_id, text=pb.text, token_ids=tuple(pb.token_ids),
                   logprobs=tuple(TokenLogprob.from_pb(lp) for lp in pb.logprobs),
                   finish_reason=_FINISH_FROM_PB.get(pb.finish_reason),
                   usage=Usage.from_pb(pb.usage) if pb.HasField("usage") else None,
                   timings=Timings.from_pb(pb.timings) if pb.HasField("timings") else None,
                   tool_calls=tuple(ToolCall.from_pb(c) for c in pb.tool_calls), choice_index=pb.choice_index,
                   prompt_logprobs=tuple(PromptLogprob.from_pb(lp) for lp in pb.prompt_logprobs))


@dataclass(frozen=True)
class Completion:
    """A whole completion: the chunks of one stream joined."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    """None only if the stream ended without a final chunk."""
    usage: Usage | None
    timings: Timings | None
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    """Chat with tools: the calls the model made."""
    prompt_logprobs: tuple[PromptLogprob, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    """A served model."""

    name: str
    max_model_len: int
    fingerprint: str
    """Identity of the weights (same on every worker serving them)."""

    @classmethod
    def from_pb(cls, pb: generation_pb2.ModelInfo) -> ModelInfo:
        return cls(pb.name, pb.max_model_len, pb.fingerprint)


class _Collector:
    def __init__(self) -> None:
        self.request_id = ""
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: tuple[PromptLogprob, ...] = ()
        self.last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self.request_id = self.request_id or chunk.request_id
        self.texts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.prompt_logprobs = self.prompt_logprobs or chunk.prompt_logprobs
        self.last = chunk

    def result(self) -> Completion:
        last = self.last
        return Completion(request_id=self.request_id, text="".join(self.texts), token_ids=tuple(self.token_ids),
                          finish_reason=last.finish_reason if last else None, usage=last.usage if last else None,
                          timings=last.timings if last else None, logprobs=tuple(self.logprobs),
                          tool_calls=last.tool_calls if last else (), prompt_logprobs=self.prompt_logprobs)


def collect(chunks: Iterable[Chunk]) -> Completion:
    """Join a stream of chunks into one Completion."""
    collector = _Collector()
    for chunk in chunks:
        collector.add(chunk)
    return collector.result()


async def acollect(chunks: AsyncIterator[Chunk]) -> Completion:
    """Join an async stream of chunks into one Completion."""
    collector = _Collector()
    async for chunk in chunks:
        collector.add(chunk)
    return collector.result()


# ------------------------------------------------------------------------------------------------ requests
def _sampling_pb(options: Mapping[str, Any]) -> common_pb2.SamplingParams:
    unknown = sorted(set(options) - _SAMPLING_OPTIONS - set(_REQUEST_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected option(s) {', '.join(unknown)}; known: {sorted(GenerateOptions.__annotations__)}")
    sampling = common_pb2.SamplingParams()
    for name in sorted(_SAMPLING_OPTIONS & set(options)):
        value = options[name]
        if value is None:
            continue
        try:
            if name == "structured_output":
                sampling.structured_output.CopyFrom(structured_to_pb(value))
            elif name in ("stop", "stop_token_ids"):
                getattr(sampling, name).extend([value] if isinstance(value, str) else value)
            elif name == "logit_bias":
                sampling.logit_bias.update(value)
            else:
                setattr(sampling, name, value)
        except (TypeError, ValueError) as exc:  # protobuf rejects the type or range (e.g. a negative uint)
            raise PdserveError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {exc}") from None
    return sampling


def generate_request(prompt: str | Sequence[int], options: Mapping[str, Any]) -> generation_pb2.GenerateRequest:
    """The GenerateRequest for a text prompt or a list of token ids."""
    request = generation_pb2.GenerateRequest(sampling=_sampling_pb(options),
                                             **{k: options[k] for k in _REQUEST_OPTIONS if k in options})
    if isinstance(prompt, str):
        request.text = prompt
    else:
        try:
            request.token_ids.ids.extend(prompt)
        except (TypeError, ValueError) as exc:
            raise PdserveError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt: {exc}") from None
    return request


def chat_request(messages: Iterable[Mapping[str, Any]], options: Mapping[str, Any]) -> generation_pb2.ChatRequest:
    """The ChatRequest for OpenAI-style messages: [{"role": "user", "content": "..."}, ...], assistant messages
    with "tool_calls" ([{"id", "function": {"name", "arguments"}}], content then may be None) and "tool" messages
    with "tool_call_id"; `options` may hold ChatOptions' tools."""
    try:
        pb_messages = [generation_pb2.ChatMessage(
            role=m["role"], content=m["content"] or "", tool_call_id=m.get("tool_call_id", ""),
            tool_calls=[generation_pb2.ToolCall(id=c["id"], name=c["function"]["name"],
                                                arguments_json=c["function"]["arguments"])
                        for c in m.get("tool_calls") or ()]) for m in messages]
        tools = [generation_pb2.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                                     parameters_json=json.dumps(t["function"]["parameters"])
                                     if t["function"].get("parameters") is not None else "")
                 for t in options.get("tools") or ()]
    except (KeyError, TypeError, ValueError) as exc:
        raise PdserveError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"messages and tools: each message needs a 'role' and a 'content' string, each tool "
                           f"call and tool a 'function' with a 'name' ({exc!r})") from None
    choice = options.get("tool_choice")
    single = options.get("parallel_tool_calls") is False
    tool_choice = None
    if isinstance(choice, Mapping):
        tool_choice = generation_pb2.ToolChoice(function_name=choice["function"]["name"], single_call=single)
    elif choice is not None or single:
        tool_choice = generation_pb2.ToolChoice(mode=choice or "", single_call=single)
    rest = {k: v for k, v in options.items() if k not in _TOOL_OPTIONS}
    return generation_pb2.ChatRequest(messages=pb_messages, sampling=_sampling_pb(rest), tools=tools,
                                      tool_choice=tool_choice,
                                      **{k: options[k] for k in _REQUEST_OPTIONS if k in options})


# ------------------------------------------------------------------------------------------------ streams
class ChunkStream(Iterator[Chunk]):
    """The chunks of one streaming call. `close()` (or leaving `with`) cancels the call if still running."""

    def __init__(self, call: Any) -> None:
        self._call = call  # a grpc response iterator that is also a grpc.Call
        self._closed = False

    def __iter__(self) -> ChunkStream:
        return self

    def __next__(self) -> Chunk:
        if self._closed:
            raise StopIteration
        try:
            return Chunk.from_pb(next(self._call))
        except grpc.RpcError as exc:
            raise PdserveError.from_rpc_error(exc) from None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._call.cancel()  # no-op once the call has finished

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncChunkStream(AsyncIterator[Chunk]):
    """The chunks of one streaming call (grpc.aio). `aclose()` (or leaving `async with`) cancels the call."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self._closed = False

    def __aiter__(self) -> AsyncChunkStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._closed:
            raise StopAsyncIteration
        try:
            message = await self._call.read()
        except grpc.RpcError as exc:
            raise PdserveError.from_rpc_error(exc) from None
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        return Chunk.from_pb(message)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._call.cancel()

    async def __aenter__(self) -> AsyncChunkStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


# ------------------------------------------------------------------------------------------------ clients
def _credentials(tls: bool, ca_cert: str | None) -> grpc.ChannelCredentials | None:
    if not tls and ca_cert is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(ca_cert).read_bytes() if ca_cert is not None else None)


def _call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class Client:
    """Blocking client. `timeout` (seconds) is the default deadline of every call; None waits forever.
    `api_key`, `tls` and `ca_cert`: see the module doc."""

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = None, *, api_key: str | None = None,
                 tls: bool = False, ca_cert: str | None = None) -> None:
        self.target = target
        self.timeout = timeout
        credentials = _credentials(tls, ca_cert)
        self._channel = grpc.insecure_channel(target) if credentials is None else \
            grpc.secure_channel(target, credentials)
        self._metadata = _call_metadata(api_key)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                 **options: Unpack[GenerateOptions]) -> ChunkStream:
        """Stream the completion of a text prompt (no chat template) or of token ids."""
        request = generate_request(prompt, options)
        return ChunkStream(self._stub.Generate(request, timeout=self._deadline(timeout), metadata=self._metadata))

    def chat(self, messages: Iterable[Mapping[str, Any]], *, timeout: float | None = None,
             **options: Unpack[ChatOptions]) -> ChunkStream:
        """Stream the reply to a conversation, rendered with the model's chat template."""
        request = chat_request(messages, options)
        return ChunkStream(self._stub.Chat(request, timeout=self._deadline(timeout), metadata=self._metadata))

    def complete(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                 **options: Unpack[GenerateOptions]) -> Completion:
        """`generate`, collected."""
        with self.generate(prompt, timeout=timeout, **options) as stream:
            return collect(stream)

    def complete_chat(self, messages: Iterable[Mapping[str, Any]], *, timeout: float | None = None,
                      **options: Unpack[ChatOptions]) -> Completion:
        """`chat`, collected."""
        with self.chat(messages, timeout=timeout, **options) as stream:
            return collect(stream)

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The served models; the first is the default."""
        try:
            response = self._stub.ListModels(generation_pb2.ListModelsRequest(), timeout=self._deadline(timeout),
                                             metadata=self._metadata)
        except grpc.RpcError as exc:
            raise PdserveError.from_rpc_error(exc) from None
        return [ModelInfo.from_pb(m) for m in response.models]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout


class AsyncClient:
    """asyncio client (grpc.aio); create it inside the event loop that uses it. Options as `Client`'s."""

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = None, *, api_key: str | None = None,
                 tls: bool = False, ca_cert: str | None = None) -> None:
        self.target = target
        self.timeout = timeout
        credentials = _credentials(tls, ca_cert)
        self._channel = grpc.aio.insecure_channel(target) if credentials is None else \
            grpc.aio.secure_channel(target, credentials)
        self._metadata = _call_metadata(api_key)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                 **options: Unpack[GenerateOptions]) -> AsyncChunkStream:
        """Stream the completion of a text prompt (no chat template) or of token ids."""
        request = generate_request(prompt, options)
        return AsyncChunkStream(self._stub.Generate(request, timeout=self._deadline(timeout),
                                                    metadata=self._metadata))

    def chat(self, messages: Iterable[Mapping[str, Any]], *, timeout: float | None = None,
             **options: Unpack[ChatOptions]) -> AsyncChunkStream:
        """Stream the reply to a conversation, rendered with the model's chat template."""
        request = chat_request(messages, options)
        return AsyncChunkStream(self._stub.Chat(request, timeout=self._deadline(timeout), metadata=self._metadata))

    async def complete(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                       **options: Unpack[GenerateOptions]) -> Completion:
        """`generate`, collected."""
        async with self.generate(prompt, timeout=timeout, **options) as stream:
            return await acollect(stream)

    async def complete_chat(self, messages: Iterable[Mapping[str, Any]], *, timeout: float | None = None,
                            **options: Unpack[ChatOptions]) -> Completion:
        """`chat`, collected."""
        async with self.chat(messages, timeout=timeout, **options) as stream:
            return await acollect(stream)

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The served models; the first is the default."""
        try:
            response = await self._stub.ListModels(generation_pb2.ListModelsRequest(),
                                                   timeout=self._deadline(timeout), metadata=self._metadata)
        except grpc.RpcError as exc:
            raise PdserveError.from_rpc_error(exc) from None
        return [ModelInfo.from_pb(m) for m in response.models]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout
