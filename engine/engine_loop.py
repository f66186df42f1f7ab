"""Runs an `LLMEngine` on one thread and lets other threads (gRPC handlers) use it safely.

The engine is not thread-safe, so only the loop thread touches it. Other threads:
- `call(fn)` runs `fn(engine)` on the loop thread between two steps and returns its result (or raises);
- `open_stream(request_id, fn)` does the same and registers a `RequestStream` first, which then receives
  every `StepOutput` of that request (of each of its choices when n > 1, `out.seq.choice_index`) until its
  last choice finishes; closing the stream early aborts the request, every choice of it.

Between steps the loop also runs `on_idle(engine)` hooks at most every `housekeeping_interval_s` (lease
expiry, publishing KV events to the prefix index, load reports), and step hooks after every step that ran
the model (metrics). A request that fails alone in a step
(its sampling raised) ends its stream with RequestFailedError while the others go on; if the step itself
raises (the forward pass), every open stream gets the error and the loop keeps serving (the failed
requests are aborted so their blocks are freed). One choice of an n > 1 request failing fails the request:
its other choices are aborted. A tensor-parallel rank that fails (TensorParallelError) ends the process at
once with status EXIT_RANK_FAILED: the ranks are gone, and open RPCs see UNAVAILABLE.
After `stop()`, `call` and `open_stream` raise LoopStopped.

CPU threads: torch's OpenMP thread count is per calling thread, so the loop thread sets the engine's
`num_threads` itself (set_thread_torch_threads: so that no other thread's count replaces it). Build an engine the loop will step with `build_engine`, on a thread that then ends: a
thread that has run a multi-threaded torch op keeps its OpenMP worker threads, and with more of them than
CPUs libgomp stops spin-waiting between parallel regions, which made every matmul of the loop thread about
1.4x slower (2 threads, batch-1 decode) when the process's main thread had loaded the model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

import torch

from engine.config import EngineConfig
from engine.errors import RequestFailedError
from engine.llm_engine import LLMEngine, StepOutput
from engine.parallel.ranks import TensorParallelError
from engine.sequence import FinishReason

log = logging.getLogger(__name__)
T = TypeVar("T")
EXIT_RANK_FAILED = 70
"""Exit status of a worker whose tensor-parallel rank failed."""
_END = object()


class LoopStopped(RuntimeError):
    """The engine loop stopped (worker shutting down) before this call or request could complete."""


class RequestStream:
    """The outputs of one request, in order. Iterate to consume; `close()` aborts the request if running."""

    def __init__(self, loop: EngineLoop, request_id: str) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: queue.Queue = queue.Queue()
        self.finished = False

    def _put(self, item) -> None:
        self._queue.put(item)

    def get(self, timeout: float | None = None) -> StepOutput | None:
        """Next output; None when the request has finished. Raises queue.Empty on timeout, or the step's error."""
        if self.finished:
            return None
        item = self._queue.get(timeout=timeout)
        if item is _END:
            self.finished = True
            return None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return item

    def __iter__(self) -> Iterator[StepOutput]:
        while (out := self.get()) is not None:
            yield out

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            with contextlib.suppress(LoopStopped):  # shutting down: engine and blocks go away with the loop
                self._loop.abort(self.request_id)


def set_thread_torch_threads(num_threads: int) -> None:
    """Make `num_threads` the OpenMP team size of torch ops run on the calling thread, whatever other threads set.

    torch.set_num_threads(n) sets the calling thread's count and a process-wide one, and a thread takes the
    process-wide count at its first parallel op (a thread-local lazy init). So a thread that had only set its
    count took whatever another thread set last before its first op: the decode worker's loop thread set 2,
    the gRPC handler threads created afterwards set 1, and the loop then stepped every batch on one thread
    (measured: no OpenMP worker thread in the process, one CPU busy). torch.get_num_threads() runs that lazy
    init now; the second set_num_threads makes the count this thread's own for good."""
    torch.set_num_threads(num_threads)
    torch.get_num_threads()
    torch.set_num_threads(num_threads)


def use_engine_threads(engine: LLMEngine) -> None:
    """On the thread that will step `engine`: give torch the engine's num_threads (module docstring)."""
    if engine.config.num_threads is not None:
        set_thread_torch_threads(engine.config.num_threads)


def build_engine(config: EngineConfig, **kwargs) -> LLMEngine:
    """`LLMEngine(config, **kwargs)` built on a short-lived thread (module docstring: CPU threads)."""
    result: dict[str, object] = {}

    def build() -> None:
        try:
            result["engine"] = LLMEngine(config, **kwargs)
        except BaseException as exc:  # re-raised on the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=build, name="engine-build")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["engine"]


class EngineLoop:
    def __init__(self, engine: LLMEngine, housekeeping_interval_s: float = 0.05) -> None:
        self.engine = engine
        self.housekeeping_interval_s = housekeeping_interval_s
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._idle_hooks: list[Callable[[LLMEngine], None]] = []
        self._step_hooks: list[Callable[[LLMEngine, float], None]] = []
        self._activity_hook: Callable[[bool], None] | None = None
        self._stop = threading.Event()
        self._submit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._next_housekeeping = 0.0

    # --- other threads --------------------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; callers still waiting on it (commands, streams) get LoopStopped instead of hanging."""
        with self._submit_lock:
            self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].set_exception(LoopStopped("the engine loop has stopped"))
        for stream in list(self._streams.values()):
            stream._put(LoopStopped("the engine loop stopped before the request finished"))
        self._streams.clear()

    def add_housekeeping(self, hook: Callable[[LLMEngine], None]) -> None:
        """Run `hook(engine)` on the loop thread every housekeeping interval (register before start)."""
        self._idle_hooks.append(hook)

    def add_step_hook(self, hook: Callable[[LLMEngine, float], None]) -> None:
        """Run `hook(engine, seconds)` on the loop thread after each step that ran the model, with its duration
        (register before start; engine.last_step says what it computed)."""
        self._step_hooks.append(hook)

    def set_activity_hook(self, hook: Callable[[bool], None]) -> None:
        """Run `hook(True)` on the loop thread right before each step, and `hook(False)` once the engine has no
        work left after steps (register before start; engine.cpu_share's CPU lending)."""
        self._activity_hook = hook

    def call(self, fn: Callable[[LLMEngine], T], timeout: float | None = None) -> T:
        future: Future = Future()
        self._submit((fn, future, None))
        return future.result(timeout)

    def _submit(self, item) -> None:
        with self._submit_lock:  # never enqueue after stop() drained the queue
            if self._stop.is_set():
                raise LoopStopped("the engine loop has stopped")
            self._commands.put(item)

    def open_stream(self, request_id: str, fn: Callable[[LLMEngine], object]) -> RequestStream:
        """Register a stream for `request_id`, then run `fn(engine)` (which adds or starts that request).
        `fn` may return StepOutputs (a list) that already finish choices of the request; they go to the stream."""
        stream = RequestStream(self, request_id)
        future: Future = Future()
        self._submit((fn, future, stream))
        future.result()
        return stream

    def abort(self, request_id: str) -> bool:
        return self.call(lambda engine: self._abort(engine, request_id))

    # --- loop thread ----------------------------------------------------------------------------------------
    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._put(_END)
        return engine.abort(request_id)

    def _run(self) -> None:
        use_engine_threads(self.engine)
        progressed = active = False
        while not self._stop.is_set():
            # Wait for commands when idle, and also when the last step could schedule nothing (e.g. every free
            # block is held by reservations): spinning would only burn the core until something changes.
            self._run_commands(block=not progressed)
            if self._stop.is_set():
                break
            progressed = False
            if self.engine.has_unfinished():
                if self._activity_hook is not None:
                    self._run_hooks([self._activity_hook], True)
                    active = True
                steps_before = self.engine.num_steps
                self._step()
                progressed = self.engine.num_steps > steps_before
            if active and not self.engine.has_unfinished():
                self._run_hooks([self._activity_hook], False)
                active = False
            self._housekeeping()

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self.housekeeping_interval_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future, stream = item
            if stream is not None:
                self._streams[stream.request_id] = stream
            try:
                result = fn(self.engine)
            except BaseException as exc:  # handed to the caller, never kills the loop
                if stream is not None:
                    self._streams.pop(stream.request_id, None)
                future.set_exception(exc)
            else:
                if stream is not None and isinstance(result, list):
                    self._dispatch([out for out in result if isinstance(out, StepOutput)])
                future.set_result(result)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        steps_before, started = self.engine.num_steps, time.perf_counter()
        try:
            outputs = self.engine.step()
        except TensorParallelError:
            # A rank died or timed out: the ranks are gone, this worker cannot step again. Exiting at once
            # gives every open RPC UNAVAILABLE (the gateway retries elsewhere) and the launcher sees the exit.
            log.critical("a tensor-parallel rank failed; the worker exits with status %d", EXIT_RANK_FAILED,
                         exc_info=True)
            logging.shutdown()
            os._exit(EXIT_RANK_FAILED)
        except Exception as exc:
            log.exception("engine step failed; failing its %d open requests", len(self._streams))
            for request_id, stream in list(self._streams.items()):
                self.engine.abort(request_id)
                stream._put(exc)
            self._streams.clear()
            return
        self._dispatch(outputs)
        if self.engine.num_steps != steps_before:
            self._run_hooks(self._step_hooks, self.engine, time.perf_counter() - started)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            request_id = out.seq.group_id
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if out.seq.finish_reason is FinishReason.ERROR:
                stream._put(RequestFailedError(f"request {request_id!r} failed: {out.seq.error}"))
                del self._streams[request_id]
                self.engine.abort(request_id)        # its other choices, if any
                continue
            stream._put(out)
            if out.request_finished:
                stream._put(_END)
                del self._streams[request_id]

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now < self._next_housekeeping:
            return
        self._next_housekeeping = now + self.housekeeping_interval_s
        self._run_hooks(self._idle_hooks, self.engine)

    @staticmethod
    def _run_hooks(hooks: list[Callable], *args) -> None:
        for hook in hooks:
            try:
                hook(*args)
            except Exception:
                log.exception("hook %r failed", hook)
