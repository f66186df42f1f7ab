"""Structured output on xgrammar: specs compiled against a vocabulary, one matcher per sequence, token bitmasks.

xgrammar was chosen over llguidance by measurement (bench/bench_grammar.py, BENCHMARKS.md "Structured output"):
its per-token masks are several times cheaper at batch 1 and 32, which is what every constrained decode step
pays; llguidance compiles faster, but compilation is paid once per schema, off the engine loop, and cached.

    GrammarCompiler   per (tokenizer, vocabulary): `submit(spec)` compiles on the compiler's own thread and
                      returns a Future; results are kept in a bounded LRU keyed by the spec (a frozen dataclass),
                      and concurrent submits of one spec share one compilation. A spec that does not compile
                      fails its future with InvalidRequestError naming `structured_output.<kind>`.
    GrammarState      one sequence's matcher. `sync(output_token_ids)` consumes the tokens it has not seen yet,
                      so a decode worker continuing a request whose first token was sampled on a prefill
                      worker (or a sequence recomputed after preemption) reaches the same state by replay.
    fill_bitmasks     the next-token bitmasks of a batch of states, [n, ceil(vocab / 32)] int32 on the CPU.
    apply_token_bitmask   masked logits (disallowed tokens -inf), out of place, on the logits' device.

A finished grammar allows only the stop tokens given to the compiler (the model's EOS ids), so generation ends
cleanly; max_tokens still bounds the output. xgrammar (and through it transformers) is imported on the
compiler's thread at its first compilation, not at import: most processes never constrain anything and
should not pay seconds of start-up for it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutputSpec
from engine.tokenizer import Tokenizer

DEFAULT_CACHE_ENTRIES = 256
"""Compiled grammars kept per compiler (a compiled JSON schema is typically tens to hundreds of KiB)."""

_BITS = torch.tensor([1 << i if i < 31 else -(1 << 31) for i in range(32)], dtype=torch.int32)  # bit i of an int32


_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")   # "[12:50:40] /project/cpp/x.cc:94: "


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles StructuredOutputSpecs for one tokenizer and model vocabulary; thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...] | None = None,
                 max_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        """`stop_token_ids`: the tokens a finished grammar allows (the model's EOS ids); None: the tokenizer's
        EOS token, read at the first compilation."""
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = None if stop_token_ids is None else list(stop_token_ids)
        self._max_entries = max_entries
        self._cache: OrderedDict[StructuredOutputSpec, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._xgr: Any = None
        self._compiler: Any = None
        self.num_compiled = 0
        """Compilations run (cache misses), for tests and metrics."""

    def submit(self, spec: StructuredOutputSpec) -> Future:
        """A Future of the compiled grammar of `spec`: a cached one, one in progress, or a new compilation."""
        spec.validate()
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._executor.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: f.exception() is not None and self._forget(spec, f))
        return future

    def compile(self, spec: StructuredOutputSpec, timeout: float | None = None) -> Any:
        """`submit(spec)` and wait for it (raises InvalidRequestError for a spec that does not compile)."""
        return self.submit(spec).result(timeout)

    def new_state(self, compiled: Any) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(compiled))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _forget(self, spec: StructuredOutputSpec, future: Future) -> None:
        """A failed compilation is not cached: the same spec fails the same way, but cheaply enough, and a
        transient failure (memory) must not stick."""
        with self._lock:
            if self._cache.get(spec) is future:
                del self._cache[spec]

    def _compile(self, spec: StructuredOutputSpec) -> Any:
        compiler = self._get_compiler()
        self.num_compiled += 1
        field = f"structured_output.{spec.kind}"
        try:
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(spec.schema, any_whitespace=False, strict_mode=True)
            if spec.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if spec.kind == "regex":
                return compiler.compile_regex(spec.pattern)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_ebnf(spec.choices))
            return compiler.compile_grammar(spec.grammar_text)
        except (RuntimeError, ValueError) as exc:   # xgrammar reports bad input as RuntimeError / ValueError
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            message = _XGRAMMAR_LOG_PREFIX.sub("", lines[0])
            raise InvalidRequestError(field, f"does not compile: {message}") from None

    def _get_compiler(self) -> Any:
        """Built on the compile thread on first use (seconds: imports transformers, scans the vocabulary)."""
        if self._compiler is None:
            import transformers
            import xgrammar

            hf = transformers.PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
            stop_token_ids = self._stop_token_ids
            if stop_token_ids is None and self._tokenizer.eos_token_id is not None:
                stop_token_ids = [self._tokenizer.eos_token_id]
            info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                           stop_token_ids=stop_token_ids or None)
            # xgrammar's own cache is off: ours is bounded by entries and shares in-flight compilations.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            self._xgr = xgrammar
        return self._compiler


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """The matcher of one sequence. Not thread-safe: only the engine loop thread uses it."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self.num_consumed = 0
        """Output tokens consumed so far (a prefix of the sequence's output_token_ids)."""

    def sync(self, output_token_ids: list[int]) -> None:
        """Consume output_token_ids[num_consumed:]. Raises InvalidRequestError at a token the grammar rejects
        (a first token sampled elsewhere without the constraint, or a corrupted replay)."""
        for token_id in output_token_ids[self.num_consumed:]:
            if not self._matcher.accept_token(token_id):
                raise InvalidRequestError("structured_output",
                                          f"output token {token_id} at position {self.num_consumed} does not "
                                          "match the constraint")
            self.num_consumed += 1

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return self._matcher.is_terminated()

    @property
    def matcher(self) -> Any:
        return self._matcher


def fill_bitmasks(states: list[GrammarState], vocab_size: int) -> torch.Tensor:
    """-> [len(states), bitmask_words(vocab_size)] int32 on the CPU; bit t of row i set = token t allowed."""
    bitmask = torch.full((len(states), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for i, state in enumerate(states):
        state.matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits: [n, vocab] float; bitmask: [n, ceil(vocab/32)] int32 (any device) -> new logits, disallowed -inf.

    Pure torch, so it runs wherever the logits are (CPU, CUDA); out of place, since logits made under
    torch.inference_mode must not be written outside it.
    """
    vocab = logits.shape[1]
    bitmask = bitmask.to(logits.device)
    allowed = (bitmask.unsqueeze(-1) & _BITS.to(logits.device)).ne(0).flatten(1)[:, :vocab]   # [n, vocab]
    return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
