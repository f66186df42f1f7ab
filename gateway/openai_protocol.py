"""OpenAI-compatible request bodies -> validated `GenerationRequest`s (pure: JSON values in; no aiohttp, grpc or
protobuf). The response objects of a parsed request are gateway.openai_response's.

Parsing checks JSON types here, then hands plain values to gateway.validation, the checks the gRPC API applies,
so both APIs accept and refuse the same requests. Every rejection is an InvalidRequestError whose `field` is the
OpenAI parameter (the error object's `param`): "temperature", "max_tokens", "prompt", "messages[1].role", ...

    model               the served name or an alias; missing means the served model
    prompt              /v1/completions: a string, a list of token ids, or a list of strings or of token-id lists
                        (a batch: each prompt runs as its own request; choices are indexed prompt-major,
                        index = prompt_i * n + choice_j; a bad prompt is refused naming "prompt[i]"), at most
                        MAX_PROMPTS
    messages            /v1/chat/completions: [{"role": "system"|"developer"|"user"|"assistant"|"tool",
                        "content": a string or a list of {"type": "text", "text": ...} parts}]; "developer" is
                        rendered as "system"; assistant messages may carry "tool_calls" ([{"id", "type":
                        "function", "function": {"name", "arguments": JSON object text}}], content then may be
                        null), tool messages "tool_call_id" (and "name")
    tools, tool_choice, parallel_tool_calls
                        chat: tool calling (gateway.tools, gateway.tool_parsers)
    max_tokens          completions: default 16; chat (or max_completion_tokens, the same limit; both given must
                        agree): default the rest of the context
    temperature, top_p, top_k, min_p, seed, presence_penalty, frequency_penalty, repetition_penalty, stop (a
    string or a list), stop_token_ids, ignore_eos, cache_salt
                        as in the gRPC SamplingParams (top_k -1 disables too, as in vLLM)
    include_stop_str_in_output
                        the text keeps the stop string that ended it
    chat_template_kwargs
                        chat: further variables for the chat template (an object)
    logprobs            completions: alternatives per token (an int); chat: a bool, with top_logprobs (an int)
    echo                completions: each choice's text starts with its prompt; with logprobs, the logprobs
                        start with the prompt's tokens (the first one's logprob and top_logprobs null), as OpenAI's
                        legacy completions. max_tokens 0 (with echo only) scores the prompt, generating nothing
    prompt_logprobs     vLLM's: an int in [0, 20]; completions: each choice's prompt_logprobs, chat: the
                        response's prompt_logprobs, [null, {"<token id>": {"logprob", "rank", "decoded_token"}},
                        ...] with the prompt token and its top alternatives (streams: in the first chunk)
    logit_bias          {"<token id>": bias in [-100, 100]}; ids outside the vocabulary are refused
    min_tokens          EOS and stop_token_ids are suppressed until this many tokens were generated, and stop
                        strings only match in the text after them (vLLM); at most max_tokens
    stream, stream_options.include_usage
    n                   choices per prompt, 1..MAX_CHOICES (the prompt is computed once; the choices fork on its
                        KV; with a seed, choice i is reproducible). Greedy n > 1 gives identical choices.
    best_of             completions: candidates per prompt, n..MAX_CHOICES, generated as n = best_of; the n with
                        the highest cumulative logprob are returned, best first (usage counts every candidate's
                        tokens). Not with stream, as in OpenAI. Chat: 1 only.
    response_format, structured_outputs, guided_json, guided_regex, guided_choice, guided_grammar
                        structured output, at most one of them (gateway.structured_request); the grammar is
                        compiled before dispatch (gateway.frontend), a spec that does not compile names its field
    suffix, functions
                        refused unless empty or false (echo on chat too); function_call: "none" only
    user, metadata, store
                        accepted without effect (NO_EFFECT_FIELDS)
Any other field (vLLM's guided_decoding_backend, priority, ...; an unknown key of a message or of
stream_options) is refused, naming it: nothing is silently ignored. JSON null means unset.

Prompt logprobs (echo with logprobs, prompt_logprobs) are computed on the whole prompt: such a request reuses no
prefix-cached blocks (usage.prompt_tokens_details.cached_tokens is 0), so no position lacks its logits.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_CHOICES, SamplingParams
from engine.tokenizer import Tokenizer
from gateway.json_fields import MAX_FIELD_NAME_CHARS, check_known
from gateway.json_fields import json_kind as _kind
from gateway.structured_request import FIELDS as STRUCTURED_FIELDS
from gateway.structured_request import parse_structured_output, rename_error
from gateway.tools import ChatMessage, ToolCall, check_name, parse_tool_choice, parse_tools
from gateway.validation import (DEFAULT_MAX_TOKENS, GenerationRequest, ModelSpec, RequestFields, draw_seed,
                                validate_messages, validate_prompt)

_REFUSED = {"suffix": "suffix",
            "functions": "function calling (the legacy API; use tools)"}
"""Fields refused unless empty or false."""
_COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "cache_salt", "logprobs", "stream",
    "stream_options", "n", "best_of", "include_stop_str_in_output", "echo", "suffix", "logit_bias", "functions",
    "prompt_logprobs", "min_tokens", *STRUCTURED_FIELDS})
NO_EFFECT_FIELDS = frozenset({"user", "metadata", "store"})
"""Accepted and ignored: they describe the request to OpenAI's own bookkeeping, not what is generated."""
COMPLETION_FIELDS = _COMMON_FIELDS | NO_EFFECT_FIELDS | {"prompt"}
CHAT_FIELDS = _COMMON_FIELDS | NO_EFFECT_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "function_call", "chat_template_kwargs"}
MAX_PROMPTS = 64
"""Most prompts in one batched /v1/completions request."""
_MESSAGE_FIELDS = frozenset({"role", "content"})
_ASSISTANT_FIELDS = _MESSAGE_FIELDS | {"tool_calls"}
_TOOL_MESSAGE_FIELDS = _MESSAGE_FIELDS | {"tool_call_id", "name"}
_TOOL_CALL_FIELDS = frozenset({"id", "type", "function"})
_TOOL_CALL_FUNCTION_FIELDS = frozenset({"name", "arguments"})
_STREAM_OPTIONS = frozenset({"include_usage"})
_ROLE_ALIASES = {"developer": "system"}
_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})
"""Set by the gateway itself; chat_template_kwargs may not override them."""


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed, validated OpenAI request and how to answer it."""

    request: GenerationRequest
    chat: bool
    """/v1/chat/completions (else /v1/completions)."""
    model: str
    """The model name responses carry (the request's, else the served name)."""
    stream: bool = False
    include_usage: bool = False
    """Streams end with a chunk that has usage and no choices (stream_options.include_usage)."""
    logprobs: bool = False
    """Choices carry log-probabilities."""
    structured_param: str = ""
    """The parameter that carried request.sampling.structured_output (errors about it name this field)."""
    more: tuple[GenerationRequest, ...] = ()
    """The other prompts of a batched /v1/completions, in order (`request` is the first)."""
    n: int = 1
    """Choices per prompt in the response (request.sampling.n is best_of when that is larger)."""
    echo: tuple[str, ...] | None = None
    """Completions with echo: each prompt's text, which its choices' texts start with (its tokens start their
    logprobs when `logprobs`)."""
    score_only: bool = False
    """max_tokens 0 with echo: the one token the workers generate is dropped (no completion tokens)."""
    prompt_logprobs: int | None = None
    """vLLM's prompt_logprobs: alternatives per prompt position in the response's prompt_logprobs."""

    @property
    def requests(self) -> tuple[GenerationRequest, ...]:
        return (self.request, *self.more)


def parse_completion(body: Any, model: ModelSpec, tokenizer: Tokenizer, running: Container[str] = (),
                     seed_source: Callable[[], int] = draw_seed) -> OpenAIRequest:
    """A /v1/completions body -> OpenAIRequest; InvalidRequestError names the bad parameter."""
    body = _object(body, COMPLETION_FIELDS)
    echo = bool(_bool(body, "echo"))
    score_only = echo and _is_int(body.get("max_tokens")) and body["max_tokens"] == 0
    if score_only:                                       # the workers always sample one token: it is dropped
        body = {**body, "max_tokens": 1}
    fields, max_tokens_param, structured_param = _fields(body, model, chat=False)
    if echo and fields.sampling.logprobs is not None:    # the prompt's logprobs start the choices' logprobs
        fields = dataclasses.replace(fields, sampling=dataclasses.replace(
            fields.sampling, prompt_logprobs=max(fields.sampling.logprobs, fields.sampling.prompt_logprobs or 0)))
    prompts = _prompts(body.get("prompt"))
    reqs = []
    for i, prompt in enumerate(prompts):
        try:
            reqs.append(validate_prompt(fields, prompt, model, tokenizer, running, seed_source))
        except InvalidRequestError as exc:
            renamed = _renamed(exc, max_tokens_param, structured_param, chat=False)
            if len(prompts) > 1 and renamed.field == "prompt":
                renamed = type(renamed)(f"prompt[{i}]", str(renamed).partition(": ")[2])
            raise renamed from exc
    n = _int(body, "n") or 1
    best_of = _int(body, "best_of")
    if best_of is not None and best_of != n:
        if not n <= best_of <= MAX_CHOICES:
            raise InvalidRequestError("best_of", f"must be in [n, {MAX_CHOICES}] (n is {n}), got {best_of}")
        if _bool(body, "stream"):
            raise InvalidRequestError("best_of", "cannot be used with stream (the best choices are known only "
                                                 "at the end)")
        # Candidates are ranked by cumulative logprob: they need their logprobs, dropped unless asked for.
        sampling = dataclasses.replace(reqs[0].sampling, n=best_of,
                                       logprobs=reqs[0].sampling.logprobs if reqs[0].sampling.logprobs is not None
                                       else 0)
        reqs = [dataclasses.replace(r, sampling=dataclasses.replace(sampling, seed=r.sampling.seed)) for r in reqs]
    first = reqs[0]
    # Batched prompts run as requests of their own, under ids derived from the first one's.
    more = tuple(dataclasses.replace(r, request_id=f"{first.request_id}-{i}") for i, r in enumerate(reqs[1:], 1))
    parsed = _parsed(body, first, model, chat=False, logprobs=fields.sampling.logprobs is not None,
                     structured_param=structured_param)
    texts = tuple(p if isinstance(p, str) else tokenizer.decode(list(p), skip_special_tokens=False)
                  for p in prompts) if echo else None
    return dataclasses.replace(parsed, more=tuple(dataclasses.replace(r, include_stop_str_in_output=
                                                                      parsed.request.include_stop_str_in_output)
                                                  for r in more), n=n, echo=texts, score_only=score_only)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a /v1/completions `prompt`: one (a string, token ids) or a batch (a list of either)."""
    if prompt is None:
        raise InvalidRequestError("prompt", "is required: a string or a list of token ids")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise InvalidRequestError("prompt", f"must be a string or a list of token ids, got {_kind(prompt)}")
    if not prompt:
        raise InvalidRequestError("prompt", "must not be empty")
    if not isinstance(prompt[0], (str, list)):           # token ids (a batch starts with a string or a list)
        if not all(_is_int(p) for p in prompt):
            raise InvalidRequestError("prompt", "must be a string or a list of token ids (integers)")
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequestError("prompt", f"has {len(prompt)} prompts; at most {MAX_PROMPTS}")
    for i, p in enumerate(prompt):
        if isinstance(p, list):
            if not all(_is_int(t) for t in p):
                raise InvalidRequestError(f"prompt[{i}]", "must be a list of token ids (integers)")
        elif not isinstance(p, str):
            raise InvalidRequestError(f"prompt[{i}]", f"must be a string or a list of token ids, got {_kind(p)}")
    return prompt


def parse_chat(body: Any, model: ModelSpec, tokenizer: Tokenizer, running: Container[str] = (),
               seed_source: Callable[[], int] = draw_seed) -> OpenAIRequest:
    """A /v1/chat/completions body -> OpenAIRequest (messages rendered with the model's chat template)."""
    body = _object(body, CHAT_FIELDS)
    if body.get("echo") not in (None, False):
        raise InvalidRequestError("echo", "is supported on /v1/completions only")
    fields, max_tokens_param, structured_param = _fields(body, model, chat=True)
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools, body.get("parallel_tool_calls"))
    if choice.forced and not structured_param:       # a tool schema that does not compile names the tool's field
        structured_param = "tools" if choice.mode == "required" else \
            f"tools[{[t.name for t in tools].index(choice.function)}].function.parameters"
    messages = parse_messages(body.get("messages"))
    template_kwargs = parse_template_kwargs(body.get("chat_template_kwargs"))
    try:
        req = validate_messages(fields, messages, model, tokenizer, running, seed_source, template_kwargs, tools,
                                choice)
    except InvalidRequestError as exc:
        raise _renamed(exc, max_tokens_param, structured_param, chat=True) from exc
    if _int(body, max_tokens_param) is None:                 # the rest of the context, as OpenAI and vLLM
        req = dataclasses.replace(req, sampling=dataclasses.replace(
            req.sampling, max_tokens=model.max_model_len - req.num_prompt_tokens))
    return _parsed(body, req, model, chat=True, logprobs=fields.sampling.logprobs is not None,
                   structured_param=structured_param)


# ------------------------------------------------------------------------------------------------ parsing
def _object(body: Any, known: frozenset[str]) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequestError("body", f"must be a JSON object, got {_kind(body)}")
    check_known(body, known)
    return body


def parse_template_kwargs(raw: Any) -> dict | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequestError("chat_template_kwargs", f"must be an object, got {_kind(raw)}")
    for name in raw:
        if name in _TEMPLATE_VARIABLES:
            raise InvalidRequestError(f"chat_template_kwargs.{name}", "is set by the gateway")
    return raw


def _fields(body: dict, model: ModelSpec, chat: bool) -> tuple[RequestFields, str, str]:
    """The sampling and common fields (not yet validated beyond JSON types), the max_tokens parameter's name and
    the structured-output parameter's ("" without one)."""
    if chat and _int(body, "best_of") not in (None, 1):
        raise InvalidRequestError("best_of", "is a /v1/completions parameter; chat supports only 1")
    n = _int(body, "n")
    for name, what in _REFUSED.items():
        if body.get(name) not in (None, False, "", [], {}):
            raise InvalidRequestError(name, f"{what} is not supported")
    if body.get("function_call") not in (None, "none"):
        raise InvalidRequestError("function_call", "the legacy function calling API is not supported; use tools "
                                                   "and tool_choice")
    structured_output, structured_param = parse_structured_output(body)
    max_tokens_param = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _int(body, max_tokens_param)
    if chat and max_tokens_param == "max_completion_tokens":
        legacy = _int(body, "max_tokens")
        if legacy is not None and legacy != max_tokens:
            raise InvalidRequestError("max_completion_tokens", f"is {max_tokens} but max_tokens is {legacy}; "
                                                               "they are the same limit, send one")
    if chat:
        top_logprobs = _int(body, "top_logprobs")
        if top_logprobs is not None and not _bool(body, "logprobs"):
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        logprobs = (top_logprobs or 0) if _bool(body, "logprobs") else None
    else:
        logprobs = _int(body, "logprobs")
    top_k = _int(body, "top_k")
    min_tokens = _int(body, "min_tokens")
    sampling = SamplingParams(
        # Chat without a limit: a valid placeholder here, the rest of the context once the prompt is known.
        max_tokens=max_tokens if max_tokens is not None else model.max_model_len if chat else DEFAULT_MAX_TOKENS,
        temperature=_number(body, "temperature", 1.0),
        top_k=0 if top_k in (None, -1) else top_k,
        top_p=_number(body, "top_p", 1.0),
        min_p=_number(body, "min_p", 0.0),
        seed=_int(body, "seed"),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        stop_token_ids=tuple(_int_list(body, "stop_token_ids")),
        ignore_eos=bool(_bool(body, "ignore_eos")),
        logprobs=logprobs,
        structured_output=structured_output,
        n=1 if n is None else n,
        min_tokens=0 if min_tokens is None else min_tokens,
        logit_bias=_logit_bias(body),
        prompt_logprobs=_int(body, "prompt_logprobs"),
    )
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    elif stop is None:
        stop = []
    elif not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequestError("stop", "must be a string or a list of strings")
    fields = RequestFields(sampling, tuple(stop), model=_str(body, "model") or "",
                           cache_salt=_str(body, "cache_salt") or "")
    return fields, max_tokens_param, structured_param


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """{"<token id>": bias} -> sorted (id, bias) pairs; the ids' range and the biases' are checked by
    SamplingParams.validate (the vocabulary is known there)."""
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise InvalidRequestError("logit_bias", f"must be an object of token id strings to numbers, got {_kind(raw)}")
    pairs = []
    for key, bias in raw.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            shown = key if len(key) <= MAX_FIELD_NAME_CHARS and key.isprintable() else ascii(key[:MAX_FIELD_NAME_CHARS])
            raise InvalidRequestError("logit_bias", f"keys must be token ids (decimal strings), got {shown!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidRequestError("logit_bias", f"the bias of token {key} must be a number, got {_kind(bias)}")
        if isinstance(bias, int) and abs(bias) > 100:      # also keeps float() off integers past its range
            raise InvalidRequestError("logit_bias", f"the bias of token {key} must be in [-100, 100]")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def parse_messages(raw: Any) -> list[ChatMessage]:
    if raw is None:
        raise InvalidRequestError("messages", "is required")
    if not isinstance(raw, list):
        raise InvalidRequestError("messages", f"must be a list of messages, got {_kind(raw)}")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}]", f"must be an object with role and content, "
                                                        f"got {_kind(message)}")
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidRequestError(f"messages[{i}].role", f"must be a string, got {_kind(role)}")
        role = _ROLE_ALIASES.get(role, role)
        check_known(message, _ASSISTANT_FIELDS if role == "assistant" else _TOOL_MESSAGE_FIELDS if role == "tool"
                    else _MESSAGE_FIELDS, f"messages[{i}].")
        tool_calls = _tool_calls(message.get("tool_calls"), f"messages[{i}].tool_calls")
        content = message.get("content")
        if isinstance(content, list):
            texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError(f"messages[{i}].content", "only text parts ({\"type\": \"text\", "
                                                                    "\"text\": ...}) are supported")
            content = "\n".join(texts)
        elif not isinstance(content, str) and not (content is None and tool_calls):
            raise InvalidRequestError(f"messages[{i}].content", f"must be a string or a list of text parts, "
                                                                f"got {_kind(content)}")
        tool_call_id = ""
        if role == "tool":
            tool_call_id = message.get("tool_call_id")
            if not isinstance(tool_call_id, str) or not tool_call_id:
                raise InvalidRequestError(f"messages[{i}].tool_call_id", "is required for a tool message: the id "
                                                                         "of the call it answers")
            _str(message, "name", f"messages[{i}].name")
        messages.append(ChatMessage(role, content, tool_calls, tool_call_id))
    return messages


def _tool_calls(raw: Any, field: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls`."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise InvalidRequestError(field, f"must be a list of tool calls, got {_kind(raw)}")
    calls = []
    for j, call in enumerate(raw):
        where = f"{field}[{j}]"
        if not isinstance(call, dict):
            raise InvalidRequestError(where, f"must be an object, got {_kind(call)}")
        check_known(call, _TOOL_CALL_FIELDS, where + ".")
        if call.get("type", "function") != "function":
            raise InvalidRequestError(f"{where}.type", f"must be \"function\", got {call.get('type')!r:.80}")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequestError(f"{where}.id", "must be a non-empty string")
        function = call.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(f"{where}.function", f"must be an object, got {_kind(function)}")
        check_known(function, _TOOL_CALL_FUNCTION_FIELDS, f"{where}.function.")
        name = check_name(f"{where}.function.name", function.get("name"))
        arguments = function.get("arguments")
        try:
            decoded = json.loads(arguments) if isinstance(arguments, str) else None
        except (ValueError, RecursionError):
            decoded = None
        if not isinstance(decoded, dict):
            raise InvalidRequestError(f"{where}.function.arguments", "must be the JSON text of an object")
        calls.append(ToolCall(call_id, name, arguments))
    return tuple(calls)


def _parsed(body: dict, req: GenerationRequest, model: ModelSpec, chat: bool, logprobs: bool,
            structured_param: str = "") -> OpenAIRequest:
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidRequestError("stream_options", "is allowed only with stream: true")
        if not isinstance(options, dict):
            raise InvalidRequestError("stream_options", f"must be an object, got {_kind(options)}")
        check_known(options, _STREAM_OPTIONS, "stream_options.")
    include_usage = bool(_bool(options or {}, "include_usage", "stream_options.include_usage"))
    if _bool(body, "include_stop_str_in_output"):
        req = dataclasses.replace(req, include_stop_str_in_output=True)
    return OpenAIRequest(req, chat, _str(body, "model") or model.name, stream, include_usage, logprobs,
                         structured_param, n=req.sampling.n, prompt_logprobs=_int(body, "prompt_logprobs"))


def _renamed(exc: InvalidRequestError, max_tokens_param: str, structured_param: str, chat: bool
             ) -> InvalidRequestError:
    """A validation error with the OpenAI parameter's name instead of the gRPC field path."""
    name = exc.field.removeprefix("sampling.")
    if name.startswith("structured_output"):
        return rename_error(InvalidRequestError(name, str(exc).partition(": ")[2]), structured_param)
    if name.startswith("stop["):
        name = "stop"
    elif name == "token_ids":
        name = "prompt"
    elif name == "max_tokens":
        name = max_tokens_param
    elif name == "logprobs" and chat:
        name = "top_logprobs"
    return type(exc)(name, str(exc).partition(": ")[2])             # keeps ModelNotFound (HTTP 404)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and not _is_int(value):
        raise InvalidRequestError(name, f"must be an integer, got {_kind(value)}")
    return value


def _int_list(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise InvalidRequestError(name, "must be a list of integers")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(name, f"must be a number, got {_kind(value)}")
    return float(value)


def _bool(body: dict, name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(param or name, f"must be true or false, got {_kind(value)}")
    return value


def _str(body: dict, name: str, param: str | None = None) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(param or name, f"must be a string, got {_kind(value)}")
    return value


# ------------------------------------------------------------------------------------------------ responses
