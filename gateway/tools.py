"""Tool calling, request side (pure): the `tools` and `tool_choice` of a chat request, the chat history's tool
calls and results, how they reach the chat template, and the constraint that enforces a forced choice.

    tools           [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]:
                    names match NAME_PATTERN and are unique; `parameters` is a JSON Schema object (checked with
                    jsonschema), default an object with no properties
    tool_choice     "auto" (default with tools), "none" (the tools are not shown to the model), "required" (at
                    least one call), or {"type": "function", "function": {"name": one of the tools}}
    parallel_tool_calls
                    true (default) or false: at most one call, enforced for "required" and a named function;
                    refused with "auto" (nothing would enforce it)

Rendering. A chat template that reads a `tools` variable (Qwen2/2.5/3, Llama 3.1+, Hermes models) gets the tools
as transformers passes them, [{"type": "function", "function": {...}}], and the history as it is: assistant
messages with `tool_calls` (arguments as objects) and `tool` messages with `tool_call_id`. A template without
one (SmolLM2's) gets DEFAULT_TOOL_PROMPT, Hermes-style, added to the system message, assistant tool calls written
as `<tool_call>` blocks and tool results as `<tool_response>` blocks in a user turn, so the Hermes parser
(gateway.tool_parsers) reads the model's calls back and `auto` works on any model.

Forced choices are enforced with a JSON Schema constraint (engine.structured), as vLLM does: "required" -> an
array of {"name", "parameters"} over the tools (REQUIRED_ITEM_KEYS); a named function -> its parameters schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutputSpec
from gateway.json_fields import check_known
from gateway.json_fields import json_kind as _kind

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""Function names OpenAI accepts."""
MAX_TOOLS = 128
"""Most tools one request may declare (OpenAI's limit)."""
TOOL_CHOICE_MODES = ("auto", "none", "required")
_TOOL_FIELDS = frozenset({"type", "function"})
_FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}

DEFAULT_TOOL_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>")
"""The system prompt added for a chat template without a tools section (`{tools}`: one JSON object per line,
each {"type": "function", "function": {...}}); the Hermes format, which the hermes parser reads back."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str = ""
    parameters: str = json.dumps(_EMPTY_PARAMETERS)
    """Its JSON Schema as JSON text (a frozen dataclass holds no dict)."""

    def to_template(self) -> dict:
        """As transformers passes a tool to a chat template (and as OpenAI's `tools` spells it)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made (or made earlier, in the history)."""

    id: str
    name: str
    arguments: str
    """JSON text of the arguments object, as OpenAI's `function.arguments`."""


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"
    """One of TOOL_CHOICE_MODES, or "function" for a named one."""
    function: str = ""
    """The named function (mode "function")."""
    parallel: bool = True
    """More than one call allowed (parallel_tool_calls)."""

    @property
    def forced(self) -> bool:
        """The output must be tool calls (enforced by `constraint`)."""
        return self.mode in ("required", "function")


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat history, as both public APIs accept it."""

    role: str
    content: str | None
    """None only for an assistant message that has tool_calls."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Assistant messages: the calls it made."""
    tool_call_id: str = ""
    """Tool messages: the call this is the result of."""


# ------------------------------------------------------------------------------------------------ validation
def check_name(field: str, name: Any) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidRequestError(field, f"must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}")
    return name


def check_parameters(field: str, parameters: Any) -> str:
    """A JSON Schema object -> its JSON text; InvalidRequestError naming `field` when it is not a schema."""
    if not isinstance(parameters, dict):
        raise InvalidRequestError(field, f"must be a JSON Schema object, got {_kind(parameters)}")
    try:
        jsonschema.validators.validator_for(parameters, default=jsonschema.Draft202012Validator) \
            .check_schema(parameters)
        text = json.dumps(parameters, ensure_ascii=False)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{p!r}]" for p in exc.path)
        raise InvalidRequestError(field, f"is not a valid JSON Schema: {exc.message}"
                                         f"{' at ' + where if where else ''}") from None
    except RecursionError:
        raise InvalidRequestError(field, "is nested too deep") from None
    if parameters.get("type", "object") != "object":
        raise InvalidRequestError(field, f"must describe an object (type \"object\"), got type "
                                         f"{parameters['type']!r:.80}")
    return text


def parse_tools(raw: Any) -> tuple[Tool, ...]:
    """OpenAI's `tools` -> Tools; InvalidRequestError naming the field (tools[1].function.name, ...)."""
    if raw is None or raw == []:
        return ()
    if not isinstance(raw, list):
        raise InvalidRequestError("tools", f"must be a list of tools, got {_kind(raw)}")
    if len(raw) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools, got {len(raw)}")
    tools, names = [], set()
    for i, tool in enumerate(raw):
        field = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(field, f"must be an object, got {_kind(tool)}")
        check_known(tool, _TOOL_FIELDS, f"{field}.")
        if tool.get("type") != "function":
            raise InvalidRequestError(f"{field}.type", f"must be \"function\", got {tool.get('type')!r:.80}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(f"{field}.function", f"must be an object, got {_kind(function)}")
        check_known(function, _FUNCTION_FIELDS, f"{field}.function.")
        name = check_name(f"{field}.function.name", function.get("name"))
        if name in names:
            raise InvalidRequestError(f"{field}.function.name", f"{name!r} is declared twice")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(f"{field}.function.description", f"must be a string, got {_kind(description)}")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise InvalidRequestError(f"{field}.function.strict", f"must be true or false, got "
                                                                 f"{_kind(function['strict'])}")
        parameters = function.get("parameters")
        tools.append(Tool(name, description or "", check_parameters(
            f"{field}.function.parameters", _EMPTY_PARAMETERS if parameters is None else parameters)))
    return tuple(tools)


def parse_tool_choice(raw: Any, tools: Sequence[Tool], parallel_tool_calls: Any = None) -> ToolChoice:
    """OpenAI's `tool_choice` (and `parallel_tool_calls`) checked against the declared tools."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls", f"must be true or false, got {_kind(parallel_tool_calls)}")
    parallel = parallel_tool_calls is not False
    if raw is None:
        choice = ToolChoice("auto" if tools else "none", parallel=parallel)
    elif isinstance(raw, str):
        if raw not in TOOL_CHOICE_MODES:
            raise InvalidRequestError("tool_choice", f"must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                                                     f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                                                     f"got {raw!r:.80}")
        choice = ToolChoice(raw, parallel=parallel)
    elif isinstance(raw, dict):
        check_known(raw, _TOOL_FIELDS, "tool_choice.")
        if raw.get("type") != "function":
            raise InvalidRequestError("tool_choice.type", f"must be \"function\", got {raw.get('type')!r:.80}")
        function = raw.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError("tool_choice.function", f"must be an object with a name, got {_kind(function)}")
        check_known(function, frozenset({"name"}), "tool_choice.function.")
        name = check_name("tool_choice.function.name", function.get("name"))
        if name not in {t.name for t in tools}:
            raise InvalidRequestError("tool_choice.function.name", f"{name!r} is not one of the tools"
                                      + (f" ({', '.join(t.name for t in tools)})" if tools else " (none given)"))
        choice = ToolChoice("function", name, parallel)
    else:
        raise InvalidRequestError("tool_choice", f"must be a string or an object, got {_kind(raw)}")
    if choice.mode == "required" and not tools:
        raise InvalidRequestError("tool_choice", "\"required\" needs tools")
    if not parallel and choice.mode == "auto":
        raise InvalidRequestError("parallel_tool_calls", "false is enforced only with tool_choice \"required\" or "
                                                         "a named function")
    return choice


def check_history(messages: Sequence[ChatMessage]) -> None:
    """Tool results answer a call made earlier in the history; InvalidRequestError names the message."""
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        call_ids.update(call.id for call in message.tool_calls)
        if message.role == "tool" and message.tool_call_id not in call_ids:
            raise InvalidRequestError(f"messages[{i}].tool_call_id",
                                      f"{message.tool_call_id!r:.80} answers no tool call of an earlier assistant "
                                      "message")


# ------------------------------------------------------------------------------------------------ rendering
def _arguments_object(call: ToolCall) -> Any:
    """Templates write arguments with `| tojson`: an object, not its text (vLLM passes the same)."""
    return json.loads(call.arguments)


def template_messages(messages: Sequence[ChatMessage], tools: Sequence[Tool], native: bool) -> list[dict]:
    """The dicts the chat template renders. `native`: the template reads `tools` itself (it gets the messages
    with their tool fields); else the Hermes-style rendering of the module doc."""
    if native:
        out = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": _arguments_object(c)}}
                                   for c in m.tool_calls]
            if m.role == "tool":
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out
    out: list[dict] = []
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        content = m.content or ""
        if m.tool_calls:
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c.name, "arguments": _arguments_object(c)},
                                                          ensure_ascii=False) + "\n</tool_call>"
                              for c in m.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m.role, "content": content})
    for d in out:
        d.pop("_tool_results", None)
    if tools:
        prompt = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t.to_template(), ensure_ascii=False)
                                                            for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ------------------------------------------------------------------------------------------------ enforcement
REQUIRED_ITEM_KEYS = ("name", "parameters")
"""Keys of each call in the array a "required" choice is constrained to."""


def constraint(choice: ToolChoice, tools: Sequence[Tool]) -> StructuredOutputSpec | None:
    """The JSON Schema a forced choice constrains the output to; None for "auto" and "none"."""
    if choice.mode == "function":
        tool = next(t for t in tools if t.name == choice.function)
        return StructuredOutputSpec.json_schema(tool.parameters)
    if choice.mode != "required":
        return None
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]},
                                                "parameters": json.loads(t.parameters)},
              "required": list(REQUIRED_ITEM_KEYS), "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else
                              {"anyOf": items}}
    if not choice.parallel:
        schema["maxItems"] = 1
    return StructuredOutputSpec.json_schema(schema)
