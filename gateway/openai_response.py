"""OpenAI response objects for one request, from its parsed body (gateway.openai_protocol.OpenAIRequest) and
the `OutputChunk`s its choices produce: streamed chunk objects, the usage chunk, or the whole response at the end
(pure: JSON values out; no aiohttp, grpc or protobuf).

    completions         text_completion objects: choices[i].text, logprobs in the legacy form (tokens,
                        token_logprobs, top_logprobs, text_offset), echo and prompt_logprobs in the choice
    chat                chat.completion(.chunk) objects: the assistant message (or role-first deltas), logprobs as
                        content entries with bytes, tool_calls (each choice's text through its own tool call
                        parser), prompt_logprobs in the response
Impossible tokens' logprobs are reported as -9999.0 (JSON has no -Infinity), as vLLM does.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

from engine.sequence import FinishReason, PromptLogprob, TokenLogprob
from engine.tokenizer import Tokenizer
from gateway.openai_protocol import OpenAIRequest
from gateway.request_types import OutputChunk, Usage
from gateway.tool_parsers import CallStart, Content, ToolCallParser


def _finite(logprob: float) -> float:
    """JSON has no -Infinity: impossible tokens get -9999.0, as vLLM reports them."""
    return logprob if math.isfinite(logprob) else -9999.0


def usage_object(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


class ResponseBuilder:
    """OpenAI objects for one request: the chunk objects of each streamed chunk, or one response at the end.
    Chunks carry their choice's index in the response (gateway.http_front numbers a batch's prompts prompt-major).

    With tools, each choice's text goes through a tool call parser of its own: content deltas carry the text
    outside the calls, each call streams as OpenAI's `tool_calls` deltas (index, id, type and function.name
    first, then function.arguments fragments), and a choice whose calls ended it finishes with "tool_calls".

    Prompt logprobs come with the first chunk of each prompt's choice 0; with echo (completions) every choice of
    that prompt starts with its prompt and their logprobs."""

    def __init__(self, parsed: OpenAIRequest, tokenizer: Tokenizer, created: int | None = None) -> None:
        self.parsed = parsed
        self._tokenizer = tokenizer
        self._created = int(time.time()) if created is None else created
        self._sent_role: set[int] = set()
        self._text_offset: dict[int, int] = {}
        self._parsers: dict[int, ToolCallParser] = {}
        """Streams with tools: each choice's parser, by index."""
        self._echoed: set[int] = set()
        self._prompt_logprobs: dict[int, tuple[PromptLogprob, ...]] = {}     # by prompt

    def stream_objects(self, chunk: OutputChunk) -> list[dict]:
        """The `data:` objects for `chunk` (none when it carries nothing a client sees)."""
        p, index = self.parsed, chunk.choice_index
        chunk = self._generated(chunk)
        prompt_i = index // p.request.sampling.n
        if chunk.prompt_logprobs is not None:
            self._prompt_logprobs[prompt_i] = chunk.prompt_logprobs
        echo = p.echo is not None and index not in self._echoed
        if echo:
            self._echoed.add(index)
            chunk = dataclasses.replace(chunk, text=p.echo[prompt_i] + chunk.text)
        logprobs = self._logprobs(chunk.logprobs, index, self._prompt_logprobs.get(prompt_i) if echo else None,
                                  prompt_i) if p.logprobs else None
        finish = chunk.finish_reason.value if chunk.finish_reason is not None else None
        if not p.chat:
            if not (chunk.text or logprobs or finish):
                return []
            choice = {"index": index, "text": chunk.text, "logprobs": logprobs, "finish_reason": finish}
            obj = self._chunk_object(choice)
            self._add_prompt_logprobs(obj, choice, chunk.prompt_logprobs)
            return [obj]
        spec = p.request.tool_parser
        if spec is not None and index not in self._parsers:
            self._parsers[index] = spec.new()
        parser = self._parsers.get(index)
        deltas = _deltas(parser, chunk.text, finish is not None)
        if finish is not None:
            finish = _finish_reason(parser, finish)
        if index not in self._sent_role:
            if deltas and "tool_calls" in deltas[0] and "content" not in deltas[0]:
                deltas[0] = {"role": "assistant", "content": None, **deltas[0]}
            else:
                deltas[:1] = [{"role": "assistant", "content": "", **(deltas[0] if deltas else {})}]
            self._sent_role.add(index)
        elif not deltas and (logprobs or finish):
            deltas = [{}]
        objects = [self._chunk_object({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})
                   for delta in deltas]
        if objects:
            objects[0]["choices"][0]["logprobs"] = logprobs
            objects[-1]["choices"][0]["finish_reason"] = finish
            self._add_prompt_logprobs(objects[0], objects[0]["choices"][0], chunk.prompt_logprobs)
        return objects

    def _chunk_object(self, choice: dict) -> dict:
        obj = self._envelope("chat.completion.chunk" if self.parsed.chat else "text_completion", [choice])
        if self.parsed.include_usage:
            obj["usage"] = None
        return obj

    def usage_chunk(self, usage: Usage) -> dict:
        """The last streamed object with stream_options.include_usage: usage and no choices."""
        obj = self._envelope("chat.completion.chunk" if self.parsed.chat else "text_completion", [])
        obj["usage"] = usage_object(self._usage(usage))
        return obj

    def response(self, chunks: Sequence[OutputChunk]) -> dict:
        """The whole (non-streamed) response; the chunk with usage is the request's last. With best_of, the
        parsed.n candidates of each prompt with the highest cumulative logprob, best first."""
        p = self.parsed
        chunks = [self._generated(c) for c in chunks]
        by_choice: dict[int, list[OutputChunk]] = {}
        for c in chunks:
            by_choice.setdefault(c.choice_index, []).append(c)
        per_prompt = p.request.sampling.n                    # candidates generated per prompt
        choices = []
        obj = self._envelope("chat.completion" if p.chat else "text_completion", choices)
        for prompt_i in range(len(p.requests)):
            candidates = [by_choice[i] for i in range(prompt_i * per_prompt, (prompt_i + 1) * per_prompt)
                          if i in by_choice]
            prompt_logprobs = next((c.prompt_logprobs for cs in candidates for c in cs
                                    if c.prompt_logprobs is not None), None)
            if per_prompt > p.n:
                candidates.sort(key=lambda cs: -sum(lp.logprob for c in cs for lp in c.logprobs))
            for rank, cs in enumerate(candidates[:p.n]):
                choices.append(self._choice(prompt_i * p.n + rank, cs, prompt_i, prompt_logprobs))
                self._add_prompt_logprobs(obj, choices[-1], prompt_logprobs)
        usage = next((c.usage for c in chunks if c.usage is not None), None)
        obj["usage"] = usage_object(self._usage(usage)) if usage is not None else None
        return obj

    def _choice(self, index: int, chunks: Sequence[OutputChunk], prompt_i: int = 0,
                prompt_logprobs: Sequence[PromptLogprob] | None = None) -> dict:
        p = self.parsed
        text = (p.echo[prompt_i] if p.echo is not None else "") + "".join(c.text for c in chunks)
        logprobs = self._logprobs([lp for c in chunks for lp in c.logprobs], index,
                                  prompt_logprobs if p.echo is not None else None, prompt_i) if p.logprobs else None
        reason = next((c.finish_reason for c in reversed(chunks) if c.finish_reason is not None), None)
        finish = reason.value if reason is not None else None
        if p.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if p.request.tool_parser is not None:
                parser = p.request.tool_parser.new()
                content, calls = parser.parse(text)
                message["content"] = content
                if calls:
                    message["tool_calls"] = [{"id": c.id, "type": "function",
                                              "function": {"name": c.name, "arguments": c.arguments}}
                                             for c in calls]
                    finish = _finish_reason(parser, finish) if finish is not None else None
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _generated(self, chunk: OutputChunk) -> OutputChunk:
        """`chunk` as the client sees it: with max_tokens 0 (score_only), without the token the workers made."""
        if not self.parsed.score_only:
            return chunk
        finish = FinishReason.LENGTH if chunk.finish_reason is not None else None
        return dataclasses.replace(chunk, text="", token_ids=(), logprobs=(), finish_reason=finish)

    def _usage(self, usage: Usage) -> Usage:
        return dataclasses.replace(usage, completion_tokens=0) if self.parsed.score_only else usage

    def _add_prompt_logprobs(self, obj: dict, choice: dict,
                             prompt_logprobs: Sequence[PromptLogprob] | None) -> None:
        """vLLM's prompt_logprobs: in the choice (completions) or the response (chat), where they came."""
        num_top = self.parsed.prompt_logprobs
        if num_top is None or prompt_logprobs is None:
            return
        positions: list[dict | None] = [None]
        for lp in prompt_logprobs:
            entry = {str(lp.token_id): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                        "decoded_token": self._token(lp.token_id)}}
            for rank, (token_id, logprob) in enumerate(lp.top[:num_top], start=1):
                entry.setdefault(str(token_id), {"logprob": _finite(logprob), "rank": rank,
                                                 "decoded_token": self._token(token_id)})
            positions.append(entry)
        (obj if self.parsed.chat else choice)["prompt_logprobs"] = positions

    def _envelope(self, kind: str, choices: list) -> dict:
        return {"id": self.parsed.request.request_id, "object": kind, "created": self._created,
                "model": self.parsed.model, "choices": choices}

    def _token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, logprobs: Sequence[TokenLogprob], index: int = 0,
                  prompt: Sequence[PromptLogprob] | None = None, prompt_i: int = 0) -> dict:
        """Choice `index`'s logprobs object; completions with echo: `prompt` (tokens 1..n-1 of prompt `prompt_i`)
        first, after the prompt's first token, whose logprob and top_logprobs are null."""
        if self.parsed.chat:
            def entry(token_id: int, logprob: float) -> dict:
                token = self._token(token_id)
                return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}

            return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                                for lp in logprobs]}
        num_top = self.parsed.request.sampling.logprobs or 0     # prompt_logprobs may have computed more
        scored = [(lp, lp.top[:num_top]) for lp in prompt or ()] + [(lp, lp.top) for lp in logprobs]
        entries = [(lp.token_id, _finite(lp.logprob), {self._token(t): _finite(v) for t, v in top})
                   for lp, top in scored]
        if prompt is not None:
            entries.insert(0, (self.parsed.requests[prompt_i].prompt_token_ids[0], None, None))
        tokens = [self._token(token_id) for token_id, _, _ in entries]
        offsets = []
        offset = self._text_offset.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._text_offset[index] = offset
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [top for _, _, top in entries], "text_offset": offsets}


def _deltas(parser: ToolCallParser | None, text: str, last: bool) -> list[dict]:
    """Chat deltas of one choice's new text: content, and with tools the tool_calls of OpenAI's stream."""
    if parser is None:
        return [{"content": text}] if text else []
    events = parser.feed(text) + (parser.finish() if last else [])
    deltas: list[dict] = []
    for event in events:
        if isinstance(event, Content):
            if deltas and set(deltas[-1]) == {"content"}:
                deltas[-1]["content"] += event.text
            else:
                deltas.append({"content": event.text})
        elif isinstance(event, CallStart):
            deltas.append({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                           "function": {"name": event.name, "arguments": ""}}]})
        else:
            deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
    return deltas


def _finish_reason(parser: ToolCallParser | None, finish: str) -> str:
    """A choice that stopped after tool calls finishes with "tool_calls"."""
    return "tool_calls" if finish == "stop" and parser is not None and parser.num_calls else finish
