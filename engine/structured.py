"""What a request's output must match: the structured-output constraint carried on SamplingParams.

`StructuredOutputSpec` is a frozen, hashable value (it keys the compiled-grammar cache, engine.grammar), built
with one constructor per kind:

    json_schema(schema)   output is JSON valid under `schema` (a dict or its JSON text)
    json_object()         output is any JSON object
    regex(pattern)        output matches `pattern` in full
    choice(options)       output is exactly one of `options`
    grammar(text)         output is derivable from an EBNF (GBNF) grammar whose start rule is `root`

`validate()` checks the shape cheaply and names the field; whether a schema, regex or grammar compiles is checked
by engine.grammar against a tokenizer (the gateway does that before dispatch). This module imports nothing heavy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20
"""Largest schema / regex / grammar text accepted (1 MiB), so one request cannot make compilation unbounded."""


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One constraint on the generated text. Build it with the classmethods; exactly one payload field is set."""

    kind: str
    """One of KINDS."""
    schema: str = ""
    """kind json_schema: the JSON Schema as compact JSON text (key order kept: it is the order of the output's
    properties)."""
    pattern: str = ""
    """kind regex: the regular expression the whole output matches."""
    choices: tuple[str, ...] = ()
    """kind choice: the allowed outputs."""
    grammar_text: str = ""
    """kind grammar: an EBNF grammar in GBNF syntax with a `root` rule."""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutputSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError("structured_output.json_schema", f"is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("structured_output.json_schema",
                                      f"must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", schema=json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def json_object(cls) -> StructuredOutputSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputSpec:
        return cls("regex", pattern=pattern)

    @classmethod
    def choice(cls, options: list[str] | tuple[str, ...]) -> StructuredOutputSpec:
        return cls("choice", choices=tuple(options))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutputSpec:
        return cls("grammar", grammar_text=text)

    def validate(self) -> None:
        """Raise InvalidRequestError naming `structured_output.<kind>` when the payload is malformed."""
        field = f"structured_output.{self.kind}"
        if self.kind not in KINDS:
            raise InvalidRequestError("structured_output.kind", f"must be one of {', '.join(KINDS)}, got {self.kind!r}")
        text = {"json_schema": self.schema, "regex": self.pattern, "grammar": self.grammar_text}.get(self.kind)
        if text is not None:
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(field, "must be a non-empty string")
            if len(text) > MAX_SPEC_CHARS:
                raise InvalidRequestError(field, f"is longer than {MAX_SPEC_CHARS} characters")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.schema)
            except ValueError as exc:
                raise InvalidRequestError(field, f"is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(field, f"must be a JSON object, got {type(schema).__name__}")
        if self.kind == "choice":
            if not self.choices:
                raise InvalidRequestError(field, "must be a non-empty list of strings")
            for i, option in enumerate(self.choices):
                if not isinstance(option, str) or not option:
                    raise InvalidRequestError(f"{field}[{i}]", "must be a non-empty string")
            if sum(len(c) for c in self.choices) > MAX_SPEC_CHARS:
                raise InvalidRequestError(field, f"is longer than {MAX_SPEC_CHARS} characters in all")
        payloads = sum(bool(x) for x in (self.schema, self.pattern, self.choices, self.grammar_text))
        if payloads != (0 if self.kind == "json_object" else 1):
            raise InvalidRequestError(field, "exactly the payload of its own kind must be set")
