"""Tool call parsers on outputs as the model families write them: whole and streamed in every split, which must
agree; malformed calls come back as content, never an error."""
from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tool_parsers import (CallArguments, CallStart, Content, HermesParser, Llama3JsonParser, NamedParser,
                                  ParserSpec, RequiredParser, collect, detect_parser)
from gateway.tools import ToolCall, ToolChoice, parse_tools

QWEN_TEMPLATE = Path(__file__).parents[2] / "data" / "qwen2_5_tools.jinja"
"""Qwen2.5-Instruct's chat template: it reads `tools`, assistant `tool_calls` and `tool` messages."""

NAMES = ("get_weather", "get_time")


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(parser_cls, text, *args):
    return parser_cls(*args, new_id=ids()).parse(text)


def streamed(parser_cls, pieces, *args):
    parser = parser_cls(*args, new_id=ids())
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    return events


def splits(text: str, seed: int):
    """`text` cut at random places (some pieces empty), as a detokenizer streams it."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), 12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


PARIS = '{"city": "Paris"}'
HERMES_OUTPUTS = [
    # Qwen2.5 / SmolLM2 with the default prompt: a call alone, the JSON on its own line
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", PARIS)]),
    # text first, then two parallel calls
    (('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
      '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
     "Let me check both.", [("get_weather", PARIS), ("get_time", '{"zone": "CET"}')]),
    # Hermes-2-Pro writes "arguments" as JSON text sometimes, and unicode
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Zürich\\"}"}</tool_call>',
     None, [("get_weather", '{"city": "Zürich"}')]),
    # EOS before the closing tag, JSON whole
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", "{}")]),
    # no arguments key
    ('<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", "{}")]),
]
HERMES_CONTENT = [
    "The weather in Paris is mild; 1 < 2 and <tool is not a tag.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',                     # cut by max_tokens
    '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>',        # not JSON
    '<tool_call>{"name": "send_email", "arguments": {}}</tool_call>',                       # not a declared tool
    '<tool_call>["get_weather"]</tool_call> and text',
    "ends with a partial tag <tool_ca",
]


@pytest.mark.parametrize("text, content, calls", HERMES_OUTPUTS)
def test_hermes_reads_calls_and_the_content_outside_them(text, content, calls):
    got_content, got_calls = parse(HermesParser, text, NAMES)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [f"call_{i}" for i in range(len(calls))]


@pytest.mark.parametrize("text", HERMES_CONTENT)
def test_hermes_returns_what_is_not_a_call_as_content_unchanged(text):
    assert parse(HermesParser, text, NAMES) == (text, [])


@pytest.mark.parametrize("text", [t for t, _, _ in HERMES_OUTPUTS] + HERMES_CONTENT +
                         ['Sure.  \n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>  \nDone.'])
@pytest.mark.parametrize("seed", range(4))
def test_hermes_stream_in_any_split_reassembles_to_the_whole_parse_and_never_leaks_markup(text, seed):
    whole = parse(HermesParser, text, NAMES)
    events = streamed(HermesParser, splits(text, seed), NAMES)
    assert collect(events) == whole
    if whole[1]:
        assert not any("tool_call>" in e.text for e in events if isinstance(e, Content))
    one_char = streamed(HermesParser, list(text), NAMES)
    assert collect(one_char) == whole


def test_hermes_streams_content_before_the_call_without_waiting_for_the_end():
    parser = HermesParser(NAMES, new_id=ids())
    assert parser.feed("Checking the weather") == [Content("Checking the weather")]
    assert parser.feed(" now.\n<tool") == [Content(" now.")]          # the whitespace waits: a call may follow
    assert parser.feed('_call>{"name": "get_weather", "arguments": {"city": "Paris"}}') == []
    assert parser.feed("</tool_call>") == [CallStart(0, "call_0", "get_weather"), CallArguments(0, PARIS)]
    assert parser.finish() == []
    assert parser.num_calls == 1


def test_text_between_calls_is_content_without_the_surrounding_whitespace():
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\nand then\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n')
    content, calls = parse(HermesParser, text, NAMES)
    assert content == "and then" and [c.name for c in calls] == ["get_time", "get_weather"]


LLAMA3_OUTPUTS = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", PARIS)]),
    (('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
      '{"name": "get_time", "parameters": {"zone": "CET"}}'), [("get_weather", PARIS), ("get_time", '{"zone": "CET"}')]),
    ('  {"name": "get_time", "arguments": {}}\n', [("get_time", "{}")]),
]


@pytest.mark.parametrize("text, calls", LLAMA3_OUTPUTS)
def test_llama3_json_reads_whole_answer_calls(text, calls):
    content, got = parse(Llama3JsonParser, text, NAMES)
    assert content is None and [(c.name, c.arguments) for c in got] == calls
    assert collect(streamed(Llama3JsonParser, splits(text, 1), NAMES)) == (content, got)


@pytest.mark.parametrize("text", [
    "It is sunny in Paris.",
    '{"name": "get_weather", "parameters": {"city": "Paris"}',                 # cut short
    '{"name": "get_weather", "parameters": {"city": "Paris"}} and some words',
    '{"city": "Paris"}',                                                          # JSON, not a call
    '{"name": "book_flight", "parameters": {}}',
])
def test_llama3_json_returns_anything_else_as_content(text):
    assert parse(Llama3JsonParser, text, NAMES) == (text, [])
    assert collect(streamed(Llama3JsonParser, splits(text, 2), NAMES)) == (text, [])


def test_llama3_json_streams_plain_answers_at_once():
    parser = Llama3JsonParser(NAMES)
    assert parser.feed("  ") == []
    assert parser.feed("It is") == [Content("  It is")]
    assert parser.feed(" sunny") == [Content(" sunny")]


def test_required_reads_the_constrained_array_and_keeps_a_truncated_one_as_content():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    content, calls = parse(RequiredParser, text, NAMES)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", PARIS), ("get_time", "{}")]
    assert parse(RequiredParser, text[:30], NAMES) == (text[:30], [])


def test_json_nested_past_the_decoder_is_content_for_every_parser():
    deep = '{"name": "get_time", "arguments": ' + '{"a": ' * 5000 + "1" + "}" * 5001
    for parser_cls, text in [(HermesParser, f"<tool_call>{deep}</tool_call>"), (Llama3JsonParser, deep),
                             (RequiredParser, "[" * 5000)]:
        assert parse(parser_cls, text, NAMES) == (text, [])


def test_named_streams_the_arguments_as_they_come():
    parser = NamedParser("get_weather", new_id=ids())
    assert parser.feed(" ") == []
    assert parser.feed('{"city"') == [CallStart(0, "call_0", "get_weather"), CallArguments(0, '{"city"')]
    assert parser.feed(': "Paris"} \n') == [CallArguments(0, ': "Paris"}')]
    assert parser.feed("\n") == [] and parser.finish() == []
    assert collect(streamed(NamedParser, splits(' {"city": "Paris"}\n', 3), "get_weather")) == \
        (None, [ToolCall("call_0", "get_weather", PARIS)])


def test_spec_picks_the_parser_of_the_choice():
    tools = parse_tools([{"type": "function", "function": {"name": n}} for n in NAMES])
    assert ParserSpec.of(ToolChoice("auto"), tools, "llama3_json") == ParserSpec("llama3_json", NAMES)
    assert isinstance(ParserSpec.of(ToolChoice("required"), tools, "hermes").new(), RequiredParser)
    named = ParserSpec.of(ToolChoice("function", "get_time"), tools, "hermes")
    assert named == ParserSpec("named", NAMES, "get_time") and isinstance(named.new(), NamedParser)


SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                    "{% endif %}")
LLAMA31_EXCERPT = ('{%- if tools is not none %}{{- "Given the following functions, please respond with a JSON for a '
                   'function call with its proper arguments that best answers the given prompt.\\n\\n" }}'
                   '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                   'its value}.\' }}{%- endif %}{{- "<|python_tag|>" }}<|eot_id|>')


def test_the_parser_is_detected_from_the_chat_template():
    qwen = QWEN_TEMPLATE.read_text()
    assert [detect_parser(t) for t in (SMOLLM2_TEMPLATE, qwen, LLAMA31_EXCERPT, None)] == \
        ["hermes", "hermes", "llama3_json", "hermes"]


def test_arguments_are_json_text_of_the_object():
    _, calls = parse(HermesParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
                                   '"days": [1, 2]}}</tool_call>', NAMES)
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": [1, 2]}


PIECES = ["<tool_call>", "</tool_call>", "<tool", "_call>", '{"name": "get_time", "arguments": {"a": 1}}', '{"name": "x"',
          ", ", "}", " ", "\n", "text", "<|python_tag|>", '{"name": "get_weather", "parameters": {}}', ";", "[", "]"]


@settings(max_examples=200, deadline=None, database=None)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=12), cuts=st.lists(st.integers(0, 300), max_size=6))
def test_every_parser_streams_what_it_parses_whole_and_keeps_text_without_calls(parts, cuts):
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    for parser_cls, args in [(HermesParser, (NAMES,)), (Llama3JsonParser, (NAMES,)), (RequiredParser, (NAMES,))]:
        whole = parse(parser_cls, text, *args)
        assert collect(streamed(parser_cls, pieces, *args)) == whole
        if not whole[1]:
            assert whole[0] == text
