"""The structured-output fields of an OpenAI request body -> one `StructuredOutputSpec` (pure: JSON values in).

    response_format      {"type": "text"} (no constraint), {"type": "json_object"}, or
                         {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
                         (without "schema": any JSON object; the output always conforms, strict or not)
    structured_outputs   vLLM's: exactly one of {"json": schema, "regex", "choice": [...], "grammar": EBNF,
                         "json_object": true}
    guided_json, guided_regex, guided_choice, guided_grammar
                         vLLM's older names of the same

At most one of them may constrain a request; two -> InvalidRequestError naming the second. A malformed value
names its own parameter ("response_format.json_schema.schema", "guided_choice[1]", ...); `rename_error` gives
an engine error about `structured_output.<kind>` (shape checks, compilation) the name of the parameter that
carried the spec, so the client sees the field it sent.
"""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutputSpec
from gateway.json_fields import check_known, json_kind

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""The body fields read here, in the order they are checked."""
_JSON_SCHEMA_FIELDS = frozenset({"name", "schema", "strict", "description"})
_STRUCTURED_OUTPUTS_FIELDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
                              "json_object": "json_object"}


def parse_structured_output(body: dict) -> tuple[StructuredOutputSpec | None, str]:
    """The request's constraint and the parameter that carried it ("" when there is none)."""
    found: list[tuple[StructuredOutputSpec, str]] = []
    for name in FIELDS:
        value = body.get(name)
        if value is None:
            continue
        parsed = _PARSERS[name](value)
        if parsed is None:
            continue
        if found:
            raise InvalidRequestError(name, f"cannot be combined with {found[0][1].split('.')[0]}: "
                                            "send one structured-output constraint")
        found.append(parsed)
    return found[0] if found else (None, "")


def rename_error(exc: InvalidRequestError, param: str) -> InvalidRequestError:
    """`structured_output.<kind>[...]: message` -> `<param>[...]: message`; other errors unchanged."""
    if not exc.field.startswith("structured_output"):
        return exc
    index = exc.field.find("[")
    return InvalidRequestError(param + (exc.field[index:] if index >= 0 else ""), str(exc).partition(": ")[2])


def _response_format(value: Any) -> tuple[StructuredOutputSpec, str] | None:
    if not isinstance(value, dict):
        raise InvalidRequestError("response_format", f"must be an object, got {json_kind(value)}")
    kind = value.get("type")
    known = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in known:
        raise InvalidRequestError("response_format.type", "must be \"text\", \"json_object\" or \"json_schema\", "
                                                          f"got {kind!r}")
    check_known(value, known[kind], "response_format.")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec.json_object(), "response_format"
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format.json_schema", f"must be an object, got {json_kind(spec)}")
    check_known(spec, _JSON_SCHEMA_FIELDS, "response_format.json_schema.")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("response_format.json_schema.name", "is required: a non-empty string")
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise InvalidRequestError("response_format.json_schema.strict", f"must be true or false, "
                                                                         f"got {json_kind(spec.get('strict'))}")
    schema = spec.get("schema")
    if schema is None:
        return StructuredOutputSpec.json_object(), "response_format.json_schema"
    return _json_schema(schema, "response_format.json_schema.schema")


def _structured_outputs(value: Any) -> tuple[StructuredOutputSpec, str] | None:
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs", f"must be an object, got {json_kind(value)}")
    check_known(value, frozenset(_STRUCTURED_OUTPUTS_FIELDS), "structured_outputs.")
    set_keys = [k for k in _STRUCTURED_OUTPUTS_FIELDS if value.get(k) not in (None, False)]
    if len(set_keys) > 1:
        raise InvalidRequestError(f"structured_outputs.{set_keys[1]}",
                                  f"cannot be combined with structured_outputs.{set_keys[0]}")
    if not set_keys:
        raise InvalidRequestError("structured_outputs", "set one of json, regex, choice, grammar, json_object")
    key = set_keys[0]
    param = f"structured_outputs.{key}"
    if key == "json":
        return _json_schema(value[key], param)
    if key == "json_object":
        if value[key] is not True:
            raise InvalidRequestError(param, f"must be true, got {json_kind(value[key])}")
        return StructuredOutputSpec.json_object(), param
    if key == "choice":
        return _choice(value[key], param)
    return _string(value[key], param, StructuredOutputSpec.regex if key == "regex" else StructuredOutputSpec.grammar)


def _json_schema(schema: Any, param: str) -> tuple[StructuredOutputSpec, str]:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(param, f"is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(param, f"must be a JSON Schema object, got {json_kind(schema)}")
    return StructuredOutputSpec.json_schema(schema), param


def _choice(options: Any, param: str) -> tuple[StructuredOutputSpec, str]:
    if not isinstance(options, list) or not options:
        raise InvalidRequestError(param, "must be a non-empty list of strings")
    for i, option in enumerate(options):
        if not isinstance(option, str):
            raise InvalidRequestError(f"{param}[{i}]", f"must be a string, got {json_kind(option)}")
    return StructuredOutputSpec.choice(options), param


def _string(value: Any, param: str, make) -> tuple[StructuredOutputSpec, str]:
    if not isinstance(value, str):
        raise InvalidRequestError(param, f"must be a string, got {json_kind(value)}")
    return make(value), param


_PARSERS = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": lambda v: _json_schema(v, "guided_json"),
    "guided_regex": lambda v: _string(v, "guided_regex", StructuredOutputSpec.regex),
    "guided_choice": lambda v: _choice(v, "guided_choice"),
    "guided_grammar": lambda v: _string(v, "guided_grammar", StructuredOutputSpec.grammar),
}
