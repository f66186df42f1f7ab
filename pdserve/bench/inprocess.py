"""Systems measured inside this process: pdserve's engine (one process, no RPC) and Hugging Face transformers.

`EngineBackend` steps an `LLMEngine` on its own thread and takes requests from the event loop, so it runs
under the same arrivals and concurrency limits as the servers; a token's time is when the step that made it
returned (what a server would send at once). `run_transformers` cannot take requests while it generates:
it runs the workload in static batches (all requests arrive at t0, the next batch starts when the previous
ends), timing every decoding step with a streamer.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from pdserve.bench.backends import Backend, new_record
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import BenchRequest

_NOTHING = object()


class EngineBackend(Backend):
    """pdserve's `LLMEngine` in this process."""

    def __init__(self, engine: Any, name: str = "pdserve engine") -> None:
        self.engine = engine
        self.name = name
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: dict[str, tuple[RequestRecord, asyncio.Future]] = {}
        self._ids = 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="bench-engine", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    async def send(self, request: BenchRequest) -> RequestRecord:
        assert self._loop is not None, "start() the backend first"
        record = new_record(request)
        done = self._loop.create_future()
        self._inbox.put((request, record, done))
        await done
        return record

    def _finish(self, record: RequestRecord, done: asyncio.Future, error: str = "") -> None:
        record.error = error
        record.success = not error and bool(record.chunk_times_s)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    def _run(self) -> None:
        from engine.engine_loop import use_engine_threads
        from engine.sampling_params import SamplingParams

        engine = self.engine
        use_engine_threads(engine)
        while True:
            block = not engine.has_unfinished()
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                item = _NOTHING
            while item is not _NOTHING:
                if item is None:
                    for request_id, (record, done) in self._running.items():
                        engine.abort(request_id)
                        self._finish(record, done, "closed")
                    return
                request, record, done = item
                self._ids += 1
                request_id = f"bench-{self._ids}"
                params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
                try:
                    engine.add_request(request_id, list(request.prompt_ids), params)
                except Exception as exc:  # rejected (overload, bad input): recorded, the loop goes on
                    self._finish(record, done, f"{type(exc).__name__}: {exc}")
                else:
                    self._running[request_id] = (record, done)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = _NOTHING
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                for request_id, (record, done) in self._running.items():
                    engine.abort(request_id)
                    self._finish(record, done, f"step failed: {type(exc).__name__}: {exc}")
                self._running.clear()
                continue
            now = time.perf_counter()
            for out in outputs:
                entry = self._running.get(out.seq.request_id)
                if entry is None:
                    continue
                record, done = entry
                if out.new_token_ids:
                    record.chunk_times_s.append(now)
                    record.output_len += len(out.new_token_ids)
                if out.finished:
                    record.cached_tokens = out.seq.num_cached_tokens
                    del self._running[out.seq.request_id]
                    self._finish(record, done)


class _StepClock:
    """A transformers streamer that notes when each decoding step's tokens exist (the first `put` is the
    prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        if self._seen_prompt:
            self.times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


def load_transformers_model(gguf_path: str, num_threads: int) -> Any:
    """The GGUF's weights in a transformers causal LM (dequantized to float32 by transformers)."""
    from pathlib import Path

    import torch
    import transformers

    torch.set_num_threads(num_threads)
    path = Path(gguf_path)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def run_transformers(model: Any, requests: Sequence[BenchRequest], batch_size: int,
                     pad_token_id: int = 0) -> tuple[list[RequestRecord], float]:
    """Generate every request greedily in static batches of `batch_size` (left padding), exactly max_tokens
    new tokens each (EOS suppressed until then). Returns the records and the run's duration."""
    import torch

    records = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(requests), batch_size):
            batch = requests[first:first + batch_size]
            width = max(r.prompt_len for r in batch)
            ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, request in enumerate(batch):
                ids[row, width - request.prompt_len:] = torch.tensor(request.prompt_ids)
                mask[row, width - request.prompt_len:] = 1
            new_tokens = max(r.max_tokens for r in batch)
            clock = _StepClock()
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=pad_token_id, streamer=clock)
            for request in batch:
                times = clock.times[:request.max_tokens]
                records.append(RequestRecord(prompt_len=request.prompt_len, start_s=t0, chunk_times_s=times,
                                             output_len=len(times), success=bool(times),
                                             request_id=request.request_id))
    return records, time.perf_counter() - t0
