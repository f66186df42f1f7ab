"""The Generation service's messages (generation.proto) as the gateway's request path sees them: requests
validated and tokenized into a `GenerationRequest` (gateway.validation, with the proto field paths in every
error), output chunks packed into `GenerateResponse`s. gateway.server's servicer is the one user."""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Sequence

from engine.errors import InvalidRequestError
from engine.tokenizer import Tokenizer
from gateway.request_types import OutputChunk
from gateway.tools import ChatMessage, ToolCall, check_name, parse_tool_choice, parse_tools
from gateway.validation import (GenerationRequest, ModelSpec, RequestFields, draw_seed, validate_messages,
                                validate_prompt)
from protos.convert import finish_reason_to_pb, logprob_to_pb, prompt_logprob_to_pb, sampling_from_pb
from protos.pdserve.v1 import generation_pb2


# ------------------------------------------------------------------------------------------------ requests
def fields_from_pb(pb: generation_pb2.GenerateRequest | generation_pb2.ChatRequest) -> RequestFields:
    """What GenerateRequest and ChatRequest share, as plain values (validated by gateway.validation)."""
    sampling = pb.sampling
    try:
        params = sampling_from_pb(sampling)
    except InvalidRequestError as exc:          # structured_output's own checks: the field path in the request
        raise InvalidRequestError(f"sampling.{exc.field}", str(exc).partition(": ")[2]) from None
    return RequestFields(params, tuple(sampling.stop), pb.request_id, pb.model, pb.cache_salt)


def validate_generate(pb: generation_pb2.GenerateRequest, model: ModelSpec, tokenizer: Tokenizer,
                      running: Container[str] = (), seed_source: Callable[[], int] = draw_seed) -> GenerationRequest:
    """A GenerateRequest validated and tokenized (gateway.validation.validate_prompt; no chat template)."""
    kind = pb.WhichOneof("prompt")
    prompt = None if kind is None else pb.text if kind == "text" else list(pb.token_ids.ids)
    return validate_prompt(fields_from_pb(pb), prompt, model, tokenizer, running, seed_source)


def validate_chat(pb: generation_pb2.ChatRequest, model: ModelSpec, tokenizer: Tokenizer,
                  running: Container[str] = (), seed_source: Callable[[], int] = draw_seed) -> GenerationRequest:
    """A ChatRequest rendered with the model's chat template, validated and tokenized (validate_messages); its
    tools and tool choice checked as the OpenAI API checks them (gateway.tools)."""
    messages = [ChatMessage(m.role, None if m.tool_calls and not m.content else m.content,
                            tuple(_tool_call_from_pb(f"messages[{i}].tool_calls[{j}]", c)
                                  for j, c in enumerate(m.tool_calls)), m.tool_call_id)
                for i, m in enumerate(pb.messages)]
    try:
        tools = parse_tools([{"type": "function", "function": {
            "name": t.name, "description": t.description or None,
            "parameters": _json_object(f"tools[{i}].parameters_json", t.parameters_json) if t.parameters_json
            else None}} for i, t in enumerate(pb.tools)])
        choice = None
        if pb.HasField("tool_choice"):
            c = pb.tool_choice
            kind = c.WhichOneof("choice")
            raw = {"type": "function", "function": {"name": c.function_name}} if kind == "function_name" else \
                c.mode or None if kind == "mode" else None
            choice = parse_tool_choice(raw, tools, False if c.single_call else None)
    except InvalidRequestError as exc:        # the OpenAI parameter's path -> the proto field's
        field = exc.field.replace(".function.parameters", ".parameters_json").replace(".function.", ".") \
            .replace("tool_choice.name", "tool_choice.function_name").replace("parallel_tool_calls",
                                                                                 "tool_choice.single_call")
        raise InvalidRequestError(field, str(exc).partition(": ")[2]) from None
    return validate_messages(fields_from_pb(pb), messages, model, tokenizer, running, seed_source,
                             tools=tools, tool_choice=choice)


def _json_object(field: str, text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(field, f"is not valid JSON: {exc}") from None


def _tool_call_from_pb(field: str, pb: generation_pb2.ToolCall) -> ToolCall:
    check_name(f"{field}.name", pb.name)
    if not pb.id:
        raise InvalidRequestError(f"{field}.id", "must not be empty")
    if not isinstance(_json_object(f"{field}.arguments_json", pb.arguments_json), dict):
        raise InvalidRequestError(f"{field}.arguments_json", "must be the JSON text of an object")
    return ToolCall(pb.id, pb.name, pb.arguments_json)


# ------------------------------------------------------------------------------------------------ responses
def chunk_to_pb(request_id: str, chunk: OutputChunk, tool_calls: Sequence[ToolCall] = ()
                ) -> generation_pb2.GenerateResponse:
    pb = generation_pb2.GenerateResponse(request_id=request_id, text=chunk.text, token_ids=chunk.token_ids,
                                         logprobs=[logprob_to_pb(lp) for lp in chunk.logprobs],
                                         finish_reason=finish_reason_to_pb(chunk.finish_reason),
                                         choice_index=chunk.choice_index,
                                         tool_calls=[generation_pb2.ToolCall(id=c.id, name=c.name,
                                                                             arguments_json=c.arguments)
                                                     for c in tool_calls],
                                         prompt_logprobs=[prompt_logprob_to_pb(lp)
                                                          for lp in chunk.prompt_logprobs or ()])
    if chunk.usage is not None:
        u = chunk.usage
        pb.usage.CopyFrom(generation_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                               cached_tokens=u.cached_tokens))
    if chunk.timings is not None:
        t = chunk.timings
        pb.timings.CopyFrom(generation_pb2.Timings(queue_ms=t.queue_ms, prefill_ms=t.prefill_ms,
                                                   transfer_ms=t.transfer_ms, ttft_ms=t.ttft_ms,
                                                   transport=t.transport, transfer_bytes=t.transfer_bytes,
                                                   kv_reshard_bytes=t.kv_reshard_bytes,
                                                   kv_reshard_slices=t.kv_reshard_slices))
    return pb
