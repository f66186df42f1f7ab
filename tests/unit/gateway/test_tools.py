"""Tool calling, request side and response objects: `tools` / `tool_choice` / history validation naming the field,
rendering through a template with a tools section and through the default tool prompt, the constraint of a forced
choice (checked with jsonschema against outputs), and the exact OpenAI objects, whole and streamed."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine.errors import InvalidRequestError
from engine.sequence import FinishReason
from gateway.openai_protocol import parse_chat, parse_messages
from gateway.openai_response import ResponseBuilder
from gateway.request_types import OutputChunk, Usage
from gateway.generation_pb import validate_chat
from gateway.tools import (DEFAULT_TOOL_PROMPT, ChatMessage, Tool, ToolCall, ToolChoice, constraint,
                           parse_tool_choice, parse_tools, template_messages)
from gateway.validation import ModelSpec, render_chat
from protos.pdserve.v1 import generation_pb2
from word_tokenizer import WORDS, word_tokenizer

QWEN_TEMPLATE = Path(__file__).parents[2] / "data" / "qwen2_5_tools.jinja"
"""Qwen2.5-Instruct's chat template: it reads `tools`, assistant `tool_calls` and `tool` messages."""

PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MODEL = ModelSpec(name="tiny", max_model_len=4096, vocab_size=len(WORDS), fingerprint="fp")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "hello"}]
HISTORY = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer(PLAIN)


def chat(tokenizer, messages=USER, **body):
    return parse_chat({"messages": messages, **body}, MODEL, tokenizer, seed_source=lambda: 1)


def param_of(tokenizer, messages=USER, **body) -> str:
    with pytest.raises(InvalidRequestError) as info:
        chat(tokenizer, messages, **body)
    return info.value.field


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("body, param", [
    (dict(tools={"type": "function"}), "tools"),
    (dict(tools=[{"type": "retrieval"}]), "tools[0].type"),
    (dict(tools=[{"type": "function", "function": "f"}]), "tools[0].function"),
    (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "x" * 65}}]), "tools[0].function.name"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]),
     "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": 3}}}}]),
     "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "examples": []}}]), "tools[0].function.examples"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": json.loads(
        '{"properties": {"a": ' * 300 + "{}" + "}}" * 300)}}]), "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]), "tools[0].function.strict"),
    (dict(tools=[WEATHER], tool_choice="any"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice=3), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
     "tool_choice.function.name"),
    (dict(tools=[WEATHER], tool_choice={"type": "function"}), "tool_choice.function"),
    (dict(tools=[WEATHER], tool_choice={"type": "tool", "function": {"name": "get_weather"}}), "tool_choice.type"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice.function.name"),
    (dict(tools=[WEATHER], parallel_tool_calls=False), "parallel_tool_calls"),
    (dict(tools=[WEATHER], parallel_tool_calls="no"), "parallel_tool_calls"),
])
def test_bad_tools_and_tool_choice_are_named(tokenizer, body, param):
    assert param_of(tokenizer, **body) == param


@pytest.mark.parametrize("index, change, param", [
    (1, {"tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                          "arguments": "{city: Paris}"}}]},
     "messages[1].tool_calls[0].function.arguments"),
    (1, {"tool_calls": [{"id": "call_1", "function": {"name": "get_weather", "arguments": "[1]"}}]},
     "messages[1].tool_calls[0].function.arguments"),
    (1, {"tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
     "messages[1].tool_calls[0].id"),
    (1, {"tool_calls": [{"id": "c", "type": "code", "function": {"name": "get_weather", "arguments": "{}"}}]},
     "messages[1].tool_calls[0].type"),
    (1, {"tool_calls": []}, "messages[1].content"),                 # content null needs calls
    (2, {"tool_call_id": None}, "messages[2].tool_call_id"),
    (2, {"tool_call_id": "call_9"}, "messages[2].tool_call_id"),    # answers no call
    (2, {"content": None}, "messages[2].content"),
])
def test_bad_history_is_named(tokenizer, index, change, param):
    messages = [dict(m) for m in HISTORY]
    messages[index].update(change)
    assert param_of(tokenizer, messages, tools=[WEATHER]) == param


def test_tool_choice_defaults_and_what_the_model_is_shown(tokenizer):
    tools = parse_tools([WEATHER, TIME])
    assert tools[1] == Tool("get_time", "", '{"type": "object", "properties": {}}')
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, ()) == ToolChoice("none")
    assert parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools, False) == \
        ToolChoice("function", "get_time", parallel=False)
    auto = chat(tokenizer, tools=[WEATHER])
    assert auto.request.tool_parser.kind == "hermes" and auto.request.sampling.structured_output is None
    none = chat(tokenizer, tools=[WEATHER], tool_choice="none")
    assert none.request.tool_parser is None
    assert none.request.prompt_token_ids == chat(tokenizer).request.prompt_token_ids   # the tools are not shown


# ------------------------------------------------------------------------------------------------ rendering
def rendered(tokenizer, messages, tools=()) -> str:
    return render_chat(parse_messages(messages), tokenizer, None, parse_tools(list(tools)))


def test_a_template_without_tools_gets_the_default_prompt_and_hermes_history():
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "hello"),
                ChatMessage("assistant", None, (ToolCall("c1", "get_weather", '{"city": "Paris"}'),
                                                ToolCall("c2", "get_time", "{}"))),
                ChatMessage("tool", "sunny", tool_call_id="c1"), ChatMessage("tool", "noon", tool_call_id="c2")]
    tools = parse_tools([WEATHER, TIME])
    out = template_messages(messages, tools, native=False)
    prompt = DEFAULT_TOOL_PROMPT.format(tools=json.dumps(WEATHER) + "\n" + json.dumps(
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}))
    assert out == [
        {"role": "system", "content": "Be brief.\n\n" + prompt},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                         '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                                         '</tool_call>'},
        {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n"
                                    "</tool_response>"}]
    assert template_messages(messages[1:2], tools, native=False)[0] == {"role": "system", "content": prompt}


def test_a_template_with_a_tools_section_gets_the_tools_and_the_history_as_transformers_passes_them():
    template = QWEN_TEMPLATE.read_text()
    tokenizer = word_tokenizer(template)
    assert tokenizer.supports_tools and not word_tokenizer(PLAIN).supports_tools
    text = rendered(tokenizer, HISTORY, [WEATHER])
    assert text.startswith("<|im_start|>system\nYou are Qwen") and json.dumps(WEATHER) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n' \
           '<|im_start|>assistant\n' in text


def test_the_history_renders_through_a_plain_template(tokenizer):
    text = rendered(tokenizer, HISTORY, [WEATHER])
    assert text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                         '"Paris"}}\n</tool_call><|im_end|><|im_start|>user\n<tool_response>\nsunny\n'
                         '</tool_response><|im_end|><|im_start|>assistant\n')
    assert "<tools>" in text


# ------------------------------------------------------------------------------------------------ enforcement
def test_required_constrains_to_an_array_of_calls_of_the_tools():
    tools = parse_tools([WEATHER, TIME])
    schema = json.loads(constraint(ToolChoice("required"), tools).schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "send", "parameters": {}}],
                [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(constraint(ToolChoice("required", parallel=False), tools).schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    named = constraint(ToolChoice("function", "get_weather"), tools)
    assert json.loads(named.schema) == WEATHER["function"]["parameters"]
    assert constraint(ToolChoice("auto"), tools) is None


def test_forced_choices_reach_the_sampling_and_pick_their_parser(tokenizer):
    required = chat(tokenizer, tools=[WEATHER, TIME], tool_choice="required")
    assert required.request.sampling.structured_output.kind == "json_schema"
    assert required.request.tool_parser.kind == "required"
    named = chat(tokenizer, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 parallel_tool_calls=False)
    assert json.loads(named.request.sampling.structured_output.schema) == WEATHER["function"]["parameters"]
    assert (named.request.tool_parser.kind, named.request.tool_parser.function) == ("named", "get_weather")


# ------------------------------------------------------------------------------------------------ responses
def chunks(*texts):
    *first, last = texts
    return [OutputChunk(t, (1,)) for t in first] + [OutputChunk(last, (1,), finish_reason=FinishReason.STOP,
                                                                usage=Usage(5, len(texts), 0))]


CALL_TEXT = ["Sure.", "\n<tool_call>\n", '{"name": "get_weather", "arguments": ', '{"city": "Paris"}}',
             "\n</tool_call>", ""]


def test_a_response_with_calls_has_tool_calls_and_finishes_with_tool_calls(tokenizer):
    parsed = chat(tokenizer, tools=[WEATHER])
    body = ResponseBuilder(parsed, tokenizer, created=7).response(chunks(*CALL_TEXT))
    [choice] = body["choices"]
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) == 29
    assert call == {"id": call["id"], "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert (choice["message"]["content"], choice["finish_reason"]) == ("Sure.", "tool_calls")
    plain = ResponseBuilder(parsed, tokenizer).response(chunks("It is ", "sunny."))["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "It is sunny."}
    assert plain["finish_reason"] == "stop"


def test_a_malformed_call_is_answered_as_content_whole_and_streamed(tokenizer):
    texts = ["<tool_call>\n", '{"name": "get_weather", "arguments": {city: Paris}}', "\n</tool_call>"]
    whole = ResponseBuilder(chat(tokenizer, tools=[WEATHER]), tokenizer).response(chunks(*texts))["choices"][0]
    assert whole["message"] == {"role": "assistant", "content": "".join(texts)}
    assert whole["finish_reason"] == "stop"
    builder = ResponseBuilder(chat(tokenizer, tools=[WEATHER], stream=True), tokenizer)
    deltas = [o["choices"][0]["delta"] for c in chunks(*texts) for o in builder.stream_objects(c)]
    assert "".join(d.get("content") or "" for d in deltas) == "".join(texts)
    assert not any("tool_calls" in d for d in deltas)


def test_a_stream_sends_openai_tool_call_deltas(tokenizer):
    parsed = chat(tokenizer, tools=[WEATHER], stream=True)
    builder = ResponseBuilder(parsed, tokenizer, created=7)
    objects = [o for c in chunks(*CALL_TEXT) for o in builder.stream_objects(c)]
    deltas = [o["choices"][0]["delta"] for o in objects]
    call_id = deltas[1]["tool_calls"][0]["id"]
    assert deltas == [
        {"role": "assistant", "content": "Sure."},
        {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]},
        {}]                                             # the last chunk: nothing new but the finish reason
    assert [o["choices"][0]["finish_reason"] for o in objects] == [None, None, None, "tool_calls"]


def test_a_named_stream_starts_with_the_call_and_streams_its_arguments(tokenizer):
    parsed = chat(tokenizer, tools=[WEATHER], stream=True,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    builder = ResponseBuilder(parsed, tokenizer, created=7)
    objects = [o for c in chunks('{"city"', ': "Paris"}') for o in builder.stream_objects(c)]
    deltas = [o["choices"][0]["delta"] for o in objects]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"] is None
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]] == ['{"city"', ': "Paris"}']
    assert objects[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ------------------------------------------------------------------------------------------------ gRPC
def test_grpc_chat_takes_tools_choice_and_history(tokenizer):
    pb = generation_pb2.ChatRequest(
        messages=[generation_pb2.ChatMessage(role="user", content="hello"),
                  generation_pb2.ChatMessage(role="assistant", tool_calls=[generation_pb2.ToolCall(
                      id="call_1", name="get_weather", arguments_json='{"city": "Paris"}')]),
                  generation_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="call_1")],
        tools=[generation_pb2.Tool(name="get_weather", parameters_json=json.dumps(
            WEATHER["function"]["parameters"]))],
        tool_choice=generation_pb2.ToolChoice(mode="required", single_call=True))
    req = validate_chat(pb, MODEL, tokenizer)
    assert req.tool_parser.kind == "required"
    assert json.loads(req.sampling.structured_output.schema)["maxItems"] == 1
    assert req.prompt_token_ids == chat(tokenizer, HISTORY, tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}}]).request.prompt_token_ids
    for bad, param in [(generation_pb2.Tool(name="f", parameters_json="{"), "tools[0].parameters_json"),
                       (generation_pb2.Tool(name="f f"), "tools[0].name"),
                       (generation_pb2.Tool(name="f", parameters_json='{"type": "array"}'), "tools[0].parameters_json")]:
        with pytest.raises(InvalidRequestError) as info:
            validate_chat(generation_pb2.ChatRequest(messages=pb.messages[:1], tools=[bad]), MODEL, tokenizer)
        assert info.value.field == param
    unknown = generation_pb2.ChatRequest(messages=pb.messages[:1], tools=pb.tools,
                                         tool_choice=generation_pb2.ToolChoice(function_name="g"))
    with pytest.raises(InvalidRequestError) as info:
        validate_chat(unknown, MODEL, tokenizer)
    assert info.value.field == "tool_choice.function_name"
