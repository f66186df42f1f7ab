"""Public requests -> a validated, tokenized `GenerationRequest` (pure). One set of checks for both public APIs,
on plain values: `RequestFields` plus a prompt (validate_prompt) or (role, content) pairs (validate_messages).
The gRPC servicer reads its messages into them (gateway.server, validate_generate / validate_chat), the OpenAI
HTTP front its JSON (gateway.openai_protocol).

Every rejection is an `engine.errors.InvalidRequestError` whose `field` is the gRPC request's own field path, so the
server maps it to INVALID_ARGUMENT "field: message" (the HTTP front renames it to the OpenAI parameter):

    request_id          longer than MAX_REQUEST_ID_CHARS, not printable, or already running on this gateway
    model               not the served model's name (empty means the default)
    prompt              unset, empty, or too long: prompt tokens >= max_model_len (the context must hold the
                        prompt plus at least one generated token)
    token_ids           an id outside [0, vocab_size)
    messages            empty, too long after the chat template, or the template refused them
    messages[i].role    not one of CHAT_ROLES
    messages[i].tool_call_id
                        a tool result that answers no earlier assistant tool call
    sampling.<name>     a SamplingParams field out of range (SamplingParams.validate), or a float not finite
    sampling.stop[i]    an empty stop string (it would match everywhere); sampling.stop: too many / too long
    cache_salt          longer than MAX_CACHE_SALT_CHARS
    (any text field)    not encodable as UTF-8 (a lone surrogate such as "\ud800")

Integers must fit the proto field they travel in (uint32 max_tokens / top_k / logprobs / stop_token_ids,
seed < 2**63) and floats the proto's float32. A temperature in (0, MIN_TEMPERATURE) is treated as greedy
(temperature 0): dividing logits by it would overflow the sampler's float32 arithmetic (vLLM does the same
below 1e-5).

Prompts that cannot fit are refused before they are tokenized: a token covers at most
ModelSpec.max_bytes_per_token bytes of UTF-8 text (measured over the vocabulary at load, `max_bytes_per_token`),
so a text of B bytes has at least ceil(B / max_bytes_per_token) tokens.

Nothing here imports protobuf, grpc or torch; text prompts and
chat renderings are tokenized as the offline `engine.llm.LLM` does, so the same prompt gives the same ids.
A request without a seed gets one drawn here: prefill and decode workers then sample one random stream.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import uuid
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from gateway.tool_parsers import ParserSpec
from gateway.tools import ChatMessage, Tool, ToolChoice, check_history, constraint, template_messages

MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
CHAT_ROLES = ("system", "user", "assistant", "tool")
DEFAULT_MAX_TOKENS = 16
"""max_tokens when the request leaves it unset (as common.proto documents)."""

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
UINT32_MAX = 2**32 - 1
FLOAT32_MAX = 3.4028234663852886e38
MIN_TEMPERATURE = 1e-5
"""Temperatures in (0, MIN_TEMPERATURE) are treated as greedy (see the module doc)."""


@dataclass(frozen=True)
class ModelSpec:
    """What the gateway knows of the served model (read from its checkpoint; no weights)."""

    name: str
    """Name ListModels reports; requests may also leave `model` empty or use one of `aliases`."""
    max_model_len: int
    """Longest prompt + completion in tokens."""
    vocab_size: int
    """Rows of the embedding: valid token ids are [0, vocab_size)."""
    fingerprint: str
    """Checkpoint identity; workers must register the same one."""
    aliases: frozenset[str] = frozenset()
    """Other names accepted in `model` (e.g. the path or "default" it was started with)."""
    max_bytes_per_token: int | None = None
    """Most UTF-8 bytes of text one token covers (`max_bytes_per_token`); None skips the check before
    tokenizing."""
    tool_call_parser: str = "hermes"
    """How tool calls are read out of the model's free output (one of gateway.tool_parsers.PARSERS)."""

    def accepts(self, model: str) -> bool:
        return model == "" or model == self.name or model in self.aliases


@dataclass(frozen=True)
class GenerationRequest:
    """A request ready for the workers: id, prompt token ids, sampling (seed always set) and the gateway's
    own stop strings."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    """Validated; `seed` is never None."""
    stop: tuple[str, ...] = ()
    """Stop strings, applied by the gateway to the detokenized text (never sent to workers)."""
    cache_salt: str = ""
    include_stop_str_in_output: bool = False
    """The text keeps the stop string that ended it (the gateway's stop strings only)."""
    tool_parser: ParserSpec | None = None
    """Chat with tools: how the gateway reads tool calls out of the output (gateway.tool_parsers); None: the
    output is all content."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class ModelNotFound(InvalidRequestError):
    """`model` names a model this gateway does not serve (HTTP 404; gRPC INVALID_ARGUMENT)."""


def max_bytes_per_token(tokenizer: Tokenizer) -> int | None:
    """A bound on the UTF-8 bytes of input text one token covers, or None when the tokenizer has none.

    BPE: the longest token of the vocabulary (special and added tokens included) as decoded text, plus one (a
    tokenizer may drop a token's leading space when it decodes it alone; a partial UTF-8 sequence decodes to
    U+FFFD, 3 bytes, which only over-estimates), and at least 4 (an unknown-token stands for one character).
    A normalizer may shrink text before it is split (NFC composes up to three code points into one), so with
    one the bound is multiplied by 4. None for models where one token can stand for any amount of text: a
    whole unknown word (WordLevel, WordPiece, Unigram) or a fused run of unknown characters (BPE fuse_unk).
    Takes ~0.1 s for a 50k vocabulary."""
    backend = tokenizer.backend
    model = backend.model
    if type(model).__name__ in ("WordLevel", "WordPiece", "Unigram") or \
            (getattr(model, "unk_token", None) and getattr(model, "fuse_unk", False)):
        return None
    longest = max((len(backend.decode([token_id], skip_special_tokens=False).encode("utf-8", "replace"))
                   for token_id in backend.get_vocab(with_added_tokens=True).values()), default=1)
    return max(longest + 1, 4) * (4 if backend.normalizer is not None else 1)


def _check_text(field: str, text: str) -> int:
    """Refuse text that is not valid Unicode for UTF-8 (lone surrogates); returns its UTF-8 length."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(field, f"is not valid Unicode: {exc.reason} at character {exc.start}") from None


def _check_byte_bound(field: str, text: str, model: ModelSpec, where: str = "") -> None:
    """Refuse, before tokenizing, text whose byte length proves it holds at least max_model_len tokens."""
    num_bytes = _check_text(field, text)
    per_token = model.max_bytes_per_token
    if per_token is not None and -(-num_bytes // per_token) >= model.max_model_len:
        raise InvalidRequestError(field, f"has {num_bytes} bytes{where}, so at least {-(-num_bytes // per_token)} "
                                         f"tokens (a token covers at most {per_token} bytes); the context holds "
                                         f"{model.max_model_len} (prompt plus at least one generated token)")


def new_request_id() -> str:
    """A fresh id for a request that came without one."""
    return f"req-{uuid.uuid4().hex}"


def draw_seed() -> int:
    """A seed in [0, 2**63), the range SamplingParams accepts."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class RequestFields:
    """What GenerateRequest and ChatRequest share besides the prompt, as plain values not yet validated: the
    gRPC messages and the OpenAI HTTP bodies (gateway.openai_protocol) are both read into one."""

    sampling: SamplingParams = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
    """Checked by check_sampling; a None seed is drawn once the whole request is valid."""
    stop: tuple[str, ...] = ()
    request_id: str = ""
    model: str = ""
    cache_salt: str = ""


def check_sampling(params: SamplingParams, stop: Sequence[str], vocab_size: int | None = None) -> None:
    """Raise InvalidRequestError naming the first bad field as "sampling.<name>" (stop strings included)."""
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequestError(f"sampling.{name}", f"must be a number, got {type(value).__name__}")
        if not math.isfinite(value):
            raise InvalidRequestError(f"sampling.{name}", f"must be a finite number, got {value}")
        if abs(value) > FLOAT32_MAX:
            raise InvalidRequestError(f"sampling.{name}", f"must be at most {FLOAT32_MAX:.6g} in magnitude, got {value}")
    for name in ("max_tokens", "top_k", "logprobs", "seed"):
        value = getattr(params, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidRequestError(f"sampling.{name}", f"must be an integer, got {type(value).__name__}")
    for name in ("max_tokens", "top_k", "logprobs"):
        value = getattr(params, name)
        if value is not None and value > UINT32_MAX:
            raise InvalidRequestError(f"sampling.{name}", f"must be at most {UINT32_MAX}, got {value}")
    for token_id in params.stop_token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id <= UINT32_MAX:
            raise InvalidRequestError("sampling.stop_token_ids", f"{token_id!r} is not a token id")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if not s:
            raise InvalidRequestError(f"sampling.stop[{i}]", "must not be empty")
        _check_text(f"sampling.stop[{i}]", s)
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(f"sampling.stop[{i}]",
                                      f"has {len(s)} characters; at most {MAX_STOP_STRING_CHARS}")
    try:
        params.validate(vocab_size)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"sampling.{exc.field}", str(exc).partition(": ")[2]) from exc


def validate_prompt(fields: RequestFields, prompt: str | Sequence[int] | None, model: ModelSpec,
                    tokenizer: Tokenizer, running: Container[str] = (),
                    seed_source: Callable[[], int] = draw_seed) -> GenerationRequest:
    """The checks of validate_generate on plain values: `prompt` is text (tokenized, no chat template), token
    ids, or None (unset)."""
    request_id = _check_common(fields, model, running)
    if prompt is None:
        raise InvalidRequestError("prompt", "must be set: text or token_ids")
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        _check_byte_bound("prompt", prompt, model)
        prompt_token_ids = tokenizer.encode(prompt)
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "tokenizes to no tokens")
    else:
        prompt_token_ids = list(prompt)
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(prompt_token_ids) >= model.max_model_len:
            _check_length("prompt", len(prompt_token_ids), model)
        for i, token_id in enumerate(prompt_token_ids):
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < model.vocab_size:
                raise InvalidRequestError("token_ids", f"token_ids[{i}] = {token_id} is outside the vocabulary "
                                                       f"[0, {model.vocab_size})")
    _check_length("prompt", len(prompt_token_ids), model)
    return _finish(request_id, prompt_token_ids, fields, seed_source)


def validate_messages(fields: RequestFields, messages: Sequence[ChatMessage], model: ModelSpec,
                      tokenizer: Tokenizer, running: Container[str] = (),
                      seed_source: Callable[[], int] = draw_seed,
                      template_kwargs: Mapping[str, Any] | None = None,
                      tools: Sequence[Tool] = (), tool_choice: ToolChoice | None = None) -> GenerationRequest:
    """The checks of validate_chat on plain values: `messages` as gateway.tools.ChatMessage; `template_kwargs` are
    further chat template variables (the OpenAI API's chat_template_kwargs); `tools` and `tool_choice` as
    gateway.tools parses them (the choice checked against the tools already): the tools are shown to the model
    unless the choice is "none", a forced choice constrains the sampling, and the request's tool_parser is set."""
    choice = tool_choice or ToolChoice("auto" if tools else "none")
    enforced = constraint(choice, tools)
    if enforced is not None:
        if fields.sampling.structured_output is not None:
            raise InvalidRequestError("tool_choice", f"{choice.mode if choice.mode == 'required' else 'a named function'}"
                                                     " is enforced with its own constraint; it cannot be combined "
                                                     "with structured output (response_format, ...)")
        fields = dataclasses.replace(fields, sampling=dataclasses.replace(fields.sampling,
                                                                          structured_output=enforced))
    shown = tools if choice.mode != "none" else ()
    request_id = _check_common(fields, model, running)
    text = render_chat(messages, tokenizer, template_kwargs, shown)
    _check_byte_bound("messages", text, model, " after the chat template")
    prompt_token_ids = tokenizer.encode(text)
    _check_length("messages", len(prompt_token_ids), model, " after the chat template")
    req = _finish(request_id, prompt_token_ids, fields, seed_source)
    if shown:
        req = dataclasses.replace(req, tool_parser=ParserSpec.of(choice, shown, model.tool_call_parser))
    return req


def render_chat(messages: Sequence[ChatMessage], tokenizer: Tokenizer,
                template_kwargs: Mapping[str, Any] | None = None, tools: Sequence[Tool] = ()) -> str:
    """`messages` checked (roles, text, tool results answering earlier calls) and rendered with the chat
    template, generation prompt included, tools as gateway.tools.template_messages renders them."""
    if not messages:
        raise InvalidRequestError("messages", "must not be empty")
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}].role", f"must be one of {CHAT_ROLES}, got {message.role!r}")
        if message.content is not None:
            _check_text(f"messages[{i}].content", message.content)
    check_history(messages)
    native = tokenizer.supports_tools
    try:
        return tokenizer.apply_chat_template(template_messages(messages, tools, native), add_generation_prompt=True,
                                             template_kwargs=template_kwargs,
                                             tools=[t.to_template() for t in tools] if native else None)
    except ValueError as exc:
        field, _, detail = str(exc).partition(" ")
        if field.startswith("messages[") and detail:
            raise InvalidRequestError(field, detail) from exc
        raise InvalidRequestError("messages", str(exc)) from exc


def _check_common(fields: RequestFields, model: ModelSpec, running: Container[str]) -> str:
    """Checks request_id, model, cache_salt, sampling in that order; returns the request id (drawn if empty)."""
    request_id = _request_id(fields.request_id, running)
    _check_model(fields.model, model)
    _check_cache_salt(fields.cache_salt)
    check_sampling(fields.sampling, fields.stop, model.vocab_size)
    return request_id


def _request_id(request_id: str, running: Container[str]) -> str:
    if not request_id:
        return new_request_id()
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    if not request_id.isprintable():
        raise InvalidRequestError("request_id", "must be printable characters only")
    if request_id in running:
        raise InvalidRequestError("request_id", f"{request_id!r} is already running")
    return request_id


def _check_model(name: str, model: ModelSpec) -> None:
    if not model.accepts(name):
        raise ModelNotFound("model", f"{name!r} is not served here; the served model is {model.name!r}")


def _check_cache_salt(cache_salt: str) -> None:
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError("cache_salt", f"has {len(cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}")
    _check_text("cache_salt", cache_salt)


def _check_length(field: str, num_tokens: int, model: ModelSpec, where: str = "") -> None:
    if num_tokens >= model.max_model_len:
        raise InvalidRequestError(field, f"has {num_tokens} tokens{where}; the context holds {model.max_model_len} "
                                         "(prompt plus at least one generated token)")


def _finish(request_id: str, prompt_token_ids: list[int], fields: RequestFields,
            seed_source: Callable[[], int]) -> GenerationRequest:
    sampling = fields.sampling
    if sampling.seed is None:
        sampling = dataclasses.replace(sampling, seed=seed_source())
    if 0.0 < sampling.temperature < MIN_TEMPERATURE:
        sampling = dataclasses.replace(sampling, temperature=0.0)
    return GenerationRequest(request_id, tuple(prompt_token_ids), sampling, tuple(fields.stop), fields.cache_salt)
