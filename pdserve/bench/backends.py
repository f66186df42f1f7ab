"""Request functions: send one `BenchRequest`, stream the answer, and record when each piece of output arrived.

Every backend asks for greedy decoding (temperature 0), exactly `max_tokens` new tokens (EOS ignored) and
streams; the clock is `time.perf_counter`. A backend is opened inside the event loop that uses it
(`await backend.start()`), then `send` may run concurrently any number of times.

- `PdserveBackend`: the gateway's public gRPC API through `pdserve.client.AsyncClient` (prompt as token ids).
- `OpenAIBackend`: any OpenAI-compatible `/v1/completions` with SSE streaming (llama-server, vLLM, pdserve's
  HTTP front), prompt as a list of token ids, `ignore_eos`, `stream_options.include_usage`; extra body fields
  per server (llama-server: `cache_prompt`, `n_probs`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import BenchRequest


class Backend(ABC):
    """Something that serves completions."""

    name: str = "backend"

    async def start(self) -> None:
        """Open connections (called inside the event loop that will send)."""

    async def close(self) -> None:
        """Release what `start` opened."""

    @abstractmethod
    async def send(self, request: BenchRequest) -> RequestRecord:
        """Run one request to completion; failures are recorded (success False, error set), not raised."""


def new_record(request: BenchRequest) -> RequestRecord:
    return RequestRecord(prompt_len=request.prompt_len, start_s=time.perf_counter(), request_id=request.request_id)


class PdserveBackend(Backend):
    """pdserve's gateway over gRPC."""

    def __init__(self, target: str, *, timeout_s: float | None = 600.0, name: str = "pdserve") -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.name = name
        self._client = None

    async def start(self) -> None:
        from pdserve.client import AsyncClient

        self._client = AsyncClient(self.target, timeout=self.timeout_s)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def send(self, request: BenchRequest) -> RequestRecord:
        from pdserve.client import PdserveError

        assert self._client is not None, "start() the backend first"
        record = new_record(request)
        num_seen = 0
        usage = None
        try:
            stream = self._client.generate(list(request.prompt_ids), max_tokens=request.max_tokens,
                                           temperature=0.0, ignore_eos=True)
            async with stream:
                async for chunk in stream:
                    now = time.perf_counter()
                    if chunk.token_ids:
                        record.chunk_times_s.append(now)
                        num_seen += len(chunk.token_ids)
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if chunk.timings is not None:
                        record.server_timings = dataclasses.asdict(chunk.timings)
        except PdserveError as exc:
            record.error = str(exc)
            return record
        record.output_len = usage.completion_tokens if usage is not None else num_seen
        record.cached_tokens = usage.cached_tokens if usage is not None else None
        record.success = bool(record.chunk_times_s)
        if not record.success:
            record.error = "the stream ended without output"
        return record


class OpenAIBackend(Backend):
    """An OpenAI-compatible server's streaming `/v1/completions`."""

    def __init__(self, base_url: str, *, model: str = "default", extra_body: Mapping[str, Any] | None = None,
                 timeout_s: float = 600.0, name: str = "openai") -> None:
        self.url = base_url.rstrip("/") + ("/completions" if base_url.rstrip("/").endswith("/v1")
                                           else "/v1/completions")
        self.model = model
        self.extra_body = dict(extra_body or {})
        self.timeout_s = timeout_s
        self.name = name
        self._session = None

    async def start(self) -> None:
        import aiohttp

        # One connection per request: servers may close a keep-alive connection after an SSE stream
        # (llama-server does), and reusing it fails the next request.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                              connector=aiohttp.TCPConnector(limit=0, force_close=True))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        return {"model": self.model, "prompt": list(request.prompt_ids), "max_tokens": request.max_tokens,
                "temperature": 0.0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}, **self.extra_body}

    async def send(self, request: BenchRequest) -> RequestRecord:
        import aiohttp

        assert self._session is not None, "start() the backend first"
        record = new_record(request)
        usage: dict[str, Any] | None = None
        try:
            async with self._session.post(self.url, json=self.payload(request)) as response:
                if response.status != 200:
                    record.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                    return record
                async for line in response.content:
                    now = time.perf_counter()
                    event = parse_sse_line(line)
                    if event is None:
                        continue
                    if event == "[DONE]":
                        break
                    if "error" in event:
                        record.error = f"server error: {json.dumps(event['error'])[:300]}"
                        return record
                    if carries_output(event):
                        record.chunk_times_s.append(now)
                    usage = event.get("usage") or usage
        except (aiohttp.ClientError, TimeoutError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            return record
        record.output_len = int(usage["completion_tokens"]) if usage else len(record.chunk_times_s)
        details = (usage or {}).get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens")
        record.success = bool(record.chunk_times_s)
        if not record.success:
            record.error = "the stream ended without output"
        return record


def parse_sse_line(line: bytes) -> dict[str, Any] | str | None:
    """The JSON of an SSE `data:` line, "[DONE]" for the end marker, None for anything else."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return "[DONE]"
    return json.loads(data)


def carries_output(event: dict[str, Any]) -> bool:
    """Whether a completions chunk delivers generated tokens: it has text, or is a streamed piece (no
    finish_reason yet). A final chunk with only a finish_reason or only usage does not."""
    choices = event.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    return bool(choice.get("text")) or choice.get("finish_reason") is None
