"""Benchmark of the two grammar engines pdserve could build structured output on: xgrammar and llguidance.

    python bench/bench_grammar.py [--repeats 5] [--threads 2] [--out bench/results/grammar.json]

With the default model's tokenizer (SmolLM2, 49152 tokens), for each engine:

    tokenizer ms   building the engine's view of the vocabulary (once per model)
    compile ms     a JSON schema to a matcher ready for its first mask (per schema; cache disabled), median
    mask ms        per generated token, the bitmask of every sequence in a batch of 1 and of 32, each sequence
                   walking a valid document token by token (the batched fill each engine offers, then accepting
                   the sampled token), median over the tokens of the document
    apply ms       the bitmask applied to [batch, vocab] float32 logits with torch (the same for both engines)

Needs `pip install xgrammar llguidance` (only the winner is a pdserve dependency). Prints a markdown table and
writes the figures to --out as JSON, with the CPU model. On a loaded machine the figures are noisy: rerun on a
quiet one for numbers to publish.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.gguf_loader import load_gguf_tokenizer  # noqa: E402
from engine.grammar import apply_token_bitmask  # noqa: E402
from engine.model_fetch import fetch_default_model  # noqa: E402
from pdserve.bench.roofline import cpu_model  # noqa: E402

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "member": {"type": "boolean"}},
        "required": ["name", "age", "member"], "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "title": {"type": "string", "maxLength": 80},
            "status": {"enum": ["open", "closed", "pending"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
            "owner": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                      "required": ["name", "email"], "additionalProperties": False},
            "scores": {"type": "array", "items": {"type": "number"}},
        },
        "required": ["id", "title", "status", "tags", "owner", "scores"], "additionalProperties": False,
    },
}
DOCUMENTS = {
    "flat": {"name": "Ada Lovelace", "age": 36, "member": True},
    "nested": {"id": 1234, "title": "Grammar engines on a CPU: which mask is cheaper per token?",
               "status": "pending", "tags": ["bench", "json", "schema", "cpu"],
               "owner": {"name": "Grace Hopper", "email": "grace@example.com"},
               "scores": [0.5, 12.25, -3.0, 7.125, 99.0]},
}


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tokenizer, threads: int) -> None:
        import transformers
        import xgrammar as xgr
        self.xgr = xgr
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size,
                                                       stop_token_ids=[tokenizer.eos_token_id])
        self.threads = threads
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self.vocab_size = tokenizer.vocab_size

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema))
        matcher = self.xgr.GrammarMatcher(compiled)
        mask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask, 0)
        return compiled

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers, token_id: int) -> None:
        for m in matchers:
            assert m.accept_token(token_id)


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tokenizer, threads: int) -> None:
        import llguidance
        import llguidance.torch
        self.ll = llguidance
        self.lltorch = llguidance.torch
        self.tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                          eos_token=tokenizer.eos_token_id)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.vocab_size = tokenizer.vocab_size

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.ll.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        self.lltorch.fill_next_token_bitmask(matcher, self.bitmask(1), 0)
        return grammar

    def matchers(self, grammar, n: int):
        return [self.ll.LLMatcher(self.tok, grammar) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.lltorch.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            self.lltorch.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.lltorch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)],
                                                     bitmask)

    def accept(self, matchers, token_id: int) -> None:
        for m in matchers:
            assert m.consume_token(token_id), m.get_error()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The sampler's own masking (pure torch, out of place), whichever engine filled the bitmask."""
    return apply_token_bitmask(logits, bitmask)


def bench_engine(engine, tokenizer, batches: list[int], repeats: int) -> dict:
    result: dict = {"compile_ms": {}, "mask_ms": {}, "accept_ms": {}, "apply_ms": {}}
    for name, schema in SCHEMAS.items():
        result["compile_ms"][name] = statistics.median(timed_ms(lambda s=schema: engine.compile(s))
                                                       for _ in range(repeats))
    schema, doc = SCHEMAS["nested"], DOCUMENTS["nested"]
    token_ids = tokenizer.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)
    compiled = engine.compile(schema)
    for batch in batches:
        matchers = engine.matchers(compiled, batch)
        bitmask = engine.bitmask(batch)
        logits = torch.randn(batch, tokenizer.vocab_size)
        fill, accept, apply = [], [], []
        for token_id in token_ids:
            fill.append(timed_ms(lambda m=matchers, b=bitmask: engine.fill(m, b)))
            allowed = apply_bitmask(logits[:1], bitmask[:1])
            assert torch.isfinite(allowed[0, token_id]), f"{engine.name} masked out a valid token"
            apply.append(timed_ms(lambda x=logits, b=bitmask: apply_bitmask(x, b)))
            accept.append(timed_ms(lambda m=matchers, t=token_id: engine.accept(m, t)))
        result["mask_ms"][batch] = statistics.median(fill)
        result["accept_ms"][batch] = statistics.median(accept)
        result["apply_ms"][batch] = statistics.median(apply)
    result["document_tokens"] = len(token_ids)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 8))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "grammar.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = load_gguf_tokenizer(fetch_default_model(progress=False))
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "threads": args.threads, "vocab_size": tokenizer.vocab_size, "engines": {}}
    for cls in (XGrammarEngine, LLGuidanceEngine):
        start = time.perf_counter()
        engine = cls(tokenizer, args.threads)
        figures = {"tokenizer_ms": (time.perf_counter() - start) * 1e3}
        figures.update(bench_engine(engine, tokenizer, args.batches, args.repeats))
        report["engines"][cls.name] = figures

    print(f"CPU: {report['cpu']}, {args.threads} threads, vocab {tokenizer.vocab_size}, "
          f"document {report['engines']['llguidance']['document_tokens']} tokens")
    header = ["engine", "tokenizer ms"] + [f"compile {n} ms" for n in SCHEMAS]
    for b in args.batches:
        header += [f"mask b={b} ms/token", f"accept b={b} ms"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, f in report["engines"].items():
        cells = [name, f"{f['tokenizer_ms']:.0f}"] + [f"{f['compile_ms'][n]:.1f}" for n in SCHEMAS]
        for b in args.batches:
            cells += [f"{f['mask_ms'][b]:.3f}", f"{f['accept_ms'][b]:.3f}"]
        print("| " + " | ".join(cells) + " |")
    apply = report["engines"]["llguidance"]["apply_ms"]
    print("apply bitmask to logits (torch, ms): " + ", ".join(f"b={b}: {apply[b]:.3f}" for b in args.batches))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
