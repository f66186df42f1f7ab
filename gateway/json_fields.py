"""Checks on decoded JSON request bodies that every OpenAI-shaped parser shares (pure)."""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError

MAX_FIELD_NAME_CHARS = 64
"""Longer unknown field names are cut in the error's `param`."""


def check_known(obj: dict, known: frozenset[str], prefix: str = "") -> None:
    """Refuse the first field that is set (not null) and not in `known`: pdserve does not implement it. A name
    that is empty, long or not printable UTF-8 is named by its ascii() form (an error object must encode)."""
    for name, value in obj.items():
        if name not in known and value is not None:
            safe = 0 < len(name) <= MAX_FIELD_NAME_CHARS and name.isprintable() and name.isascii()
            shown = name if safe else ascii(name[:MAX_FIELD_NAME_CHARS])
            raise InvalidRequestError(prefix + shown, "is not supported by pdserve")


def json_kind(value: Any) -> str:
    """The JSON type name of a decoded value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"
