"""Benchmark of structured output's cost on decoding: TPOT with a JSON schema vs unconstrained, batch 1 and 32.

    python bench/bench_structured.py [--threads 2] [--new-tokens 48] [--repeats 3] [--out bench/results/structured.json]

The default model (SmolLM2-135M-Instruct) in one offline engine, greedy. For each batch size the same chat
prompt runs `batch` times concurrently, either free (EOS ignored) or under a JSON schema whose shortest valid
document is longer than --new-tokens (an array of at least 50 person records), so every sequence decodes all
--new-tokens tokens in both cases and the batch never shrinks. TPOT per request is (E2E - TTFT) / (n - 1), as in
the serving benchmark; the figure is the median over requests and repeats. The schema is compiled before the
timed runs (compilation is cached and off the loop; its cost is bench_grammar.py's "compile ms").

Prints a table and writes the figures, with the CPU model, to --out as JSON. A loaded machine gives noisy
figures: rerun on a quiet one for numbers to publish.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.roofline import cpu_model  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured import StructuredOutputSpec  # noqa: E402

SCHEMA = {
    "type": "array", "minItems": 50,
    "items": {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
              "properties": {"name": {"type": "string", "maxLength": 24},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                             "city": {"enum": ["Paris", "London", "Tokyo", "Lagos", "Lima"]},
                             "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}},
}
MESSAGES = [{"role": "user", "content": "List fifty people as JSON records with name, age, city and tags."}]


def run_batch(llm: LLM, prompt_ids: list[int], params: SamplingParams, batch: int) -> list[float]:
    """TPOT (ms) of each of `batch` concurrent requests."""
    engine = llm.engine
    engine.kv.pool.clear_cache()
    seqs = [engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt_ids, params) for i in range(batch)]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(out.seq.request_id, now)
                last[out.seq.request_id] = now
    tpots = []
    for seq in seqs:
        n = len(seq.output_token_ids)
        assert n == params.max_tokens, f"{seq.request_id} stopped after {n} tokens ({seq.finish_reason})"
        tpots.append((last[seq.request_id] - first[seq.request_id]) / (n - 1) * 1e3)
    return tpots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "structured.json")
    args = parser.parse_args()

    llm = LLM(model="default", progress=False, num_threads=args.threads, kv_cache_memory=256 << 20,
              max_model_len=512)
    prompt_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    spec = StructuredOutputSpec.json_schema(SCHEMA)
    llm.engine.grammars.compile(spec, timeout=120)            # compiled once, before timing
    free = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, structured_output=spec)
    sample = llm.generate(prompt_ids, constrained)[0].outputs[0].text          # warm-up, and a look at the output
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "threads": args.threads, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "prompt_tokens": len(prompt_ids), "constrained_sample": sample, "tpot_ms": {}}
    for batch in args.batches:
        figures = {}
        for name, params in (("free", free), ("json_schema", constrained)):
            tpots = []
            for _ in range(args.repeats):
                tpots += run_batch(llm, prompt_ids, params, batch)
            figures[name] = statistics.median(tpots)
        figures["overhead_pct"] = (figures["json_schema"] / figures["free"] - 1) * 100
        report["tpot_ms"][batch] = figures

    print(f"CPU: {report['cpu']}, {args.threads} threads, {args.new_tokens} new tokens, median of "
          f"{args.repeats} runs; constrained output starts {sample[:60]!r}")
    print("| batch | TPOT free ms | TPOT json_schema ms | overhead |")
    print("|---|---|---|---|")
    for batch, f in report["tpot_ms"].items():
        print(f"| {batch} | {f['free']:.1f} | {f['json_schema']:.1f} | {f['overhead_pct']:+.1f}% |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
