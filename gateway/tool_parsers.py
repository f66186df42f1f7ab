"""Tool calling, output side (pure): generated text -> content and tool calls, streamed or at once.

A parser is fed the detokenized text as it streams (`feed`) and told when it ends (`finish`); each returns
events: `Content(text)`, `CallStart(index, id, name)` and `CallArguments(index, text)`. The non-streamed answer is
the same parser fed the whole text (`parse`), so a stream's events always reassemble to the non-streamed answer.
Markup of a call never reaches content. Text that looks like a call but is not one (malformed JSON, an unknown
function, a missing name) is content, as generated: never an error.

    hermes        `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text (SmolLM2
                  with DEFAULT_TOOL_PROMPT, Qwen2/2.5/3, Hermes); a block is sent once it closes (or, unclosed, at
                  the end when its JSON is whole). Whitespace between content and a call is dropped.
    llama3_json   Llama 3.1+: the whole answer is `{"name": ..., "parameters": {...}}` (or "arguments"), several
                  separated by ";", optionally after `<|python_tag|>`; anything else is content.
    required      the output of tool_choice "required": a JSON array of {"name", "parameters"} (a grammar makes
                  it so), sent at the end.
    named         the output of a named tool_choice: the arguments object itself, streamed as it comes.

`PARSERS` names the ones a gateway can be told to use (`--tool-call-parser`); `detect_parser` picks one from the
chat template; `ParserSpec` says which one reads a request's output.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.tools import Tool, ToolCall, ToolChoice

PARSERS = ("hermes", "llama3_json")
"""Parsers of free ("auto") output, by the name `--tool-call-parser` takes."""


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = Content | CallStart | CallArguments


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def detect_parser(chat_template: str | None) -> str:
    """The parser for a model's chat template: llama3_json for Llama 3.1+'s (`<|python_tag|>` or its JSON call
    format), else hermes (the `<tool_call>` templates, and templates with no tools section, which get the Hermes
    default prompt)."""
    template = chat_template or ""
    if "<|python_tag|>" in template or ('"parameters": ' in template and "<|eot_id|>" in template):
        return "llama3_json"
    return "hermes"


def _call_of(obj: Any, tool_names: Collection[str], arguments_key: Sequence[str]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None when it is not a call to a declared tool."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in tool_names:
        return None
    for key in arguments_key:
        if key in obj:
            arguments = obj[key]
            if isinstance(arguments, str):          # some models write the arguments as JSON text
                try:
                    arguments = json.loads(arguments)
                except (ValueError, RecursionError):   # RecursionError: JSON nested too deep
                    return None
            return (obj["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None
    return obj["name"], "{}"


class ToolCallParser(ABC):
    """Base: numbers the calls it emits; subclasses implement `feed` and `finish`."""

    def __init__(self, tool_names: Collection[str], new_id: Callable[[], str] = new_call_id) -> None:
        self._tool_names = frozenset(tool_names)
        self._new_id = new_id
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Events of the next piece of streamed text."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """Events of what the stream's end settles (held-back text, an unclosed call)."""

    def _call(self, name: str, arguments: str) -> list[Event]:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        events: list[Event] = [CallStart(index, self._new_id(), name)]
        if arguments:
            events.append(CallArguments(index, arguments))
        return events

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output -> (content, calls); content None when it is empty and there are calls."""
        return collect(self.feed(text) + self.finish())


def collect(events: Sequence[Event]) -> tuple[str | None, list[ToolCall]]:
    """Events -> (content, calls), as a client reassembles a stream."""
    content = "".join(e.text for e in events if isinstance(e, Content))
    starts = [e for e in events if isinstance(e, CallStart)]
    arguments = {s.index: "" for s in starts}
    for e in events:
        if isinstance(e, CallArguments):
            arguments[e.index] += e.text
    calls = [ToolCall(s.id, s.name, arguments[s.index]) for s in starts]
    return (content or None) if calls else content, calls


class HermesParser(ToolCallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: Collection[str], new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tool_names, new_id)
        self._buffer = ""
        """Content not yet sent (a trailing part that may start a call), or the body of an open call."""
        self._in_call = False
        self._held_space = ""
        """Whitespace before an open call: dropped when the call is one, sent when it is not."""
        self._after_call = False
        """Whitespace right after a call is dropped."""

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if self._in_call:
                end = self._buffer.find(self.CLOSE)
                if end < 0:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self.CLOSE):]
                self._in_call = False
                events += self._close(body, closed=True)
                continue
            if self._after_call:
                stripped = self._buffer.lstrip()
                if not stripped:
                    self._buffer = ""
                    return events
                self._buffer, self._after_call = stripped, False
            start = self._buffer.find(self.OPEN)
            if start >= 0:
                before = self._buffer[:start]
                content = before.rstrip()
                if content:
                    events.append(Content(content))
                self._held_space = before[len(content):]
                self._buffer = self._buffer[start + len(self.OPEN):]
                self._in_call = True
                continue
            keep = self._partial_open()
            sendable = self._buffer[:len(self._buffer) - keep]
            content = sendable.rstrip()          # trailing whitespace waits: a call may follow it
            if content:
                events.append(Content(content))
            self._buffer = self._buffer[len(content):]
            return events

    def _partial_open(self) -> int:
        """Length of the longest suffix of the buffer that is a proper prefix of OPEN."""
        for n in range(min(len(self.OPEN) - 1, len(self._buffer)), 0, -1):
            if self.OPEN.startswith(self._buffer[-n:]):
                return n
        return 0

    def _close(self, body: str, closed: bool) -> list[Event]:
        try:
            call = _call_of(json.loads(body), self._tool_names, ("arguments", "parameters"))
        except (ValueError, RecursionError):   # RecursionError: JSON nested too deep
            call = None
        if call is None:
            markup = self.OPEN + body + (self.CLOSE if closed else "")
            text, self._held_space = self._held_space + markup, ""
            return [Content(text)]
        self._held_space = ""
        self._after_call = True
        return self._call(*call)

    def finish(self) -> list[Event]:
        if self._in_call:
            self._in_call = False
            events = self._close(self._buffer, closed=False)
            self._buffer = ""
            return events
        text, self._buffer = ("" if self._after_call else self._buffer), ""
        return [Content(text)] if text else []


class Llama3JsonParser(ToolCallParser):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, tool_names: Collection[str], new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tool_names, new_id)
        self._buffer = ""
        self._mode = ""
        """"" undecided (only whitespace or part of the python tag so far), "calls", or "content"."""

    def feed(self, text: str) -> list[Event]:
        if self._mode == "content":
            return [Content(text)] if text else []
        self._buffer += text
        if self._mode == "":
            head = self._buffer.lstrip()
            if head.startswith(("{", self.PYTHON_TAG)):
                self._mode = "calls"
            elif head and not self.PYTHON_TAG.startswith(head):
                self._mode, text, self._buffer = "content", self._buffer, ""
                return [Content(text)]
        return []

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        if self._mode != "calls":
            return [Content(text)] if text else []
        calls = self._decode(text.strip().removeprefix(self.PYTHON_TAG).strip())
        if calls is None:
            return [Content(text)]
        return [event for call in calls for event in self._call(*call)]

    def _decode(self, text: str) -> list[tuple[str, str]] | None:
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(text):
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):   # RecursionError: JSON nested too deep
                return None
            call = _call_of(obj, self._tool_names, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            rest = text[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return None
            pos = len(text) - len(rest)
        return calls or None


class RequiredParser(ToolCallParser):
    """tool_choice "required": the JSON array of {"name", "parameters"} a grammar produced."""

    def __init__(self, tool_names: Collection[str], new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tool_names, new_id)
        self._buffer = ""

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return []

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):   # RecursionError: JSON nested too deep
            items = None
        calls = [_call_of(item, self._tool_names, ("parameters",)) for item in items] \
            if isinstance(items, list) else [None]
        if not calls or None in calls:                # cut short by max_tokens: what was generated, as content
            return [Content(text)] if text else []
        return [event for call in calls for event in self._call(*call)]


class NamedParser(ToolCallParser):
    """A named tool_choice: the output is that function's arguments, streamed as they come."""

    def __init__(self, name: str, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__((name,), new_id)
        self._name = name
        self._started = False
        self._space = ""
        """Trailing whitespace not yet sent: the arguments are sent without surrounding whitespace."""

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self._started:
            text = text.lstrip()
            if not text:
                return events
            events += self._call(self._name, "")
            self._started = True
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if body:
            events.append(CallArguments(0, body))
        return events

    def finish(self) -> list[Event]:
        return []


@dataclass(frozen=True)
class ParserSpec:
    """Which parser reads one request's output, and the tools it may call."""

    kind: str
    """One of PARSERS, "required" or "named"."""
    tool_names: tuple[str, ...]
    function: str = ""
    """kind "named": the function."""

    @classmethod
    def of(cls, choice: ToolChoice, tools: Sequence[Tool], auto_parser: str) -> ParserSpec:
        """The parser of a request's tool choice; `auto_parser` (one of PARSERS) reads free output."""
        names = tuple(t.name for t in tools)
        if choice.mode == "function":
            return cls("named", names, choice.function)
        return cls("required" if choice.mode == "required" else auto_parser, names)

    def new(self, new_id: Callable[[], str] = new_call_id) -> ToolCallParser:
        """A fresh parser (one per choice of a response)."""
        if self.kind == "hermes":
            return HermesParser(self.tool_names, new_id)
        if self.kind == "llama3_json":
            return Llama3JsonParser(self.tool_names, new_id)
        if self.kind == "required":
            return RequiredParser(self.tool_names, new_id)
        if self.kind == "named":
            return NamedParser(self.function, new_id)
        raise ValueError(f"unknown tool call parser {self.kind!r}; one of {PARSERS}")
