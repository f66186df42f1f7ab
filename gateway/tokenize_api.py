"""vLLM's /tokenize and /detokenize bodies (pure: JSON values in and out; no aiohttp).

    tokenize    {"prompt": a string} or {"messages": [...], "chat_template_kwargs"?: {...}, "tools"?: [...]}, with an
                optional "model" -> {"tokens": [ids], "count": n, "max_model_len": m}. Text is tokenized as /v1/completions
                tokenizes it, messages rendered and tokenized as /v1/chat/completions does (generation prompt
                included), so the ids are the prompt a generation request would get. A prompt longer than the
                context is counted, not refused.
    detokenize  {"tokens": [ids], "model"?} -> {"prompt": text} (special tokens kept)

Errors are InvalidRequestError naming the field ("prompt", "messages[0].role", "tokens", ...); an unknown field is
refused, as in gateway.openai_protocol; `model` must be the served one (ModelNotFound, HTTP 404).
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from engine.errors import InvalidRequestError
from engine.tokenizer import Tokenizer
from gateway.openai_protocol import check_known, parse_messages, parse_template_kwargs
from gateway.tools import parse_tools
from gateway.validation import ModelNotFound, ModelSpec, render_chat

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "chat_template_kwargs", "tools"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def tokenize(body: Any, model: ModelSpec, tokenizer: Tokenizer, running: Container[str] = ()) -> dict:
    """A /tokenize body -> its response object."""
    body = _body(body, TOKENIZE_FIELDS, model)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise InvalidRequestError("prompt", "send exactly one of prompt (a string) and messages")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt", "must be a string")
        token_ids = tokenizer.encode(prompt)
    else:
        tools = parse_tools(body.get("tools"))
        text = render_chat(parse_messages(messages), tokenizer, parse_template_kwargs(body.get("chat_template_kwargs")),
                           tools)
        token_ids = tokenizer.encode(text)
    return {"tokens": token_ids, "count": len(token_ids), "max_model_len": model.max_model_len}


def detokenize(body: Any, model: ModelSpec, tokenizer: Tokenizer, running: Container[str] = ()) -> dict:
    """A /detokenize body -> its response object."""
    body = _body(body, DETOKENIZE_FIELDS, model)
    token_ids = body.get("tokens")
    if not isinstance(token_ids, list):
        raise InvalidRequestError("tokens", "must be a list of token ids")
    for i, token_id in enumerate(token_ids):
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < model.vocab_size:
            raise InvalidRequestError("tokens", f"tokens[{i}] = {token_id!r} is not a token id in "
                                                f"[0, {model.vocab_size})")
    return {"prompt": tokenizer.decode(token_ids, skip_special_tokens=False)}


def _body(body: Any, known: frozenset[str], model: ModelSpec) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    check_known(body, known)
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise InvalidRequestError("model", "must be a string")
    if name is not None and not model.accepts(name):
        raise ModelNotFound("model", f"{name!r} is not served here; the served model is {model.name!r}")
    return body
