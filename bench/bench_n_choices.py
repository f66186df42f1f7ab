"""n=4 choices in one request vs 4 separate requests of the same prompt, through a real cluster.

    python bench/bench_n_choices.py [--trials 5] [--prompt-len 512] [--max-tokens 32] [--out bench/results/n_choices.json]

A local cluster (pdserve.launcher: real redis-server, 1 prefill + 1 decode worker process, in-process gateway,
local prefill disabled so every request is disaggregated) serves, for each trial, a fresh prompt (distinct from
every other trial's, so nothing is a prefix-cache hit across trials) in two ways, alternating which goes first:
- `n=4`: one streamed /v1/completions request with n=4: one prefill, one KV transfer, 4 choices forked on D;
- `4 requests`: 4 streamed requests of the same prompt (n=1, seeds choice_seed(seed, i), so the same 4
  completions), sent at once, as a client wanting 4 samples would.
Sampled (temperature 1), EOS ignored. Per shape: prompt tokens computed (usage prompt_tokens minus
cached_tokens, summed over the requests: the prefill work), TTFT of the first choice and of the last choice to get
its first token, and the total time until every choice finished, each the median over trials.

Prints a table naming the CPU and writes JSON to --out. Figures, not a test: on a loaded machine they move; rerun
on a quiet one.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.model_fetch import fetch_default_model  # noqa: E402
from engine.sampler import choice_seed  # noqa: E402
from pdserve.launcher import LocalCluster, LocalClusterConfig  # noqa: E402
from pdserve.bench.roofline import cpu_model  # noqa: E402

N = 4
SEED = 1234


def make_prompt(tokenizer, trial: int, length: int) -> list[int]:
    words = "river stone lantern orbit maple quartz violet ember harbor cedar falcon meadow".split()
    text = " ".join(f"{words[(trial * 5 + j * 3) % len(words)]}{trial * 977 + j}" for j in range(length))
    return tokenizer.encode(text)[:length]


async def stream(session: aiohttp.ClientSession, url: str, body: dict, start: float) -> dict:
    """One streamed completion: first-token time per choice index, usage, end time (seconds from `start`)."""
    first: dict[int, float] = {}
    usage = None
    async with session.post(url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                if choice["text"]:
                    first.setdefault(choice["index"], time.perf_counter() - start)
    return {"first": first, "usage": usage, "end": time.perf_counter() - start}


async def run_shape(url: str, shape: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()
        if shape == "n=4":
            results = [await stream(session, url, {**body, "n": N, "seed": SEED}, start)]
        else:
            results = await asyncio.gather(*(stream(session, url, {**body, "seed": choice_seed(SEED, i)}, start)
                                             for i in range(N)))
    firsts = [t for r in results for t in r["first"].values()]
    assert len(firsts) == N, firsts
    computed = sum(r["usage"]["prompt_tokens"] - r["usage"]["prompt_tokens_details"]["cached_tokens"]
                   for r in results)
    return {"prompt_tokens_computed": computed, "ttft_first_ms": min(firsts) * 1000,
            "ttft_last_ms": max(firsts) * 1000, "total_ms": max(r["end"] for r in results) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "n_choices.json")
    args = parser.parse_args()

    model_path = fetch_default_model(progress=False)
    tokenizer = load_model(model_path, with_weights=False).tokenizer
    config = LocalClusterConfig(
        num_prefill=1, num_decode=1, port=0, http_port=0, num_cpus=args.num_cpus,
        engine=EngineConfig(model=str(model_path), dtype="float32", kv_cache_memory=256 * 2**20),
        gateway_args=("--local-prefill-threshold", "0"))
    shapes = ("n=4", "4 requests")
    rows: dict[str, list[dict]] = {s: [] for s in shapes}
    with LocalCluster(config) as cluster:
        url = f"{cluster.http_url}/v1/completions"
        asyncio.run(run_shape(url, "n=4", make_prompt(tokenizer, 10_000, 32), 4))     # warm-up, not counted
        for trial in range(args.trials):
            order = shapes if trial % 2 == 0 else shapes[::-1]
            for j, shape in enumerate(order):
                prompt = make_prompt(tokenizer, 2 * trial + j, args.prompt_len)
                rows[shape].append(asyncio.run(run_shape(url, shape, prompt, args.max_tokens)))

    summary = {s: {k: statistics.median(r[k] for r in rows[s]) for k in rows[s][0]} for s in shapes}
    cpu = cpu_model()
    lines = [f"n={N} vs {N} requests ({datetime.date.today()}, {cpu}, {args.trials} trials, prompt "
             f"{args.prompt_len} tokens, {args.max_tokens} new tokens per choice, medians)", "",
             "| shape | prompt tokens computed | TTFT first choice ms | TTFT last choice ms | total ms |",
             "|---|---:|---:|---:|---:|"]
    for s in shapes:
        m = summary[s]
        lines.append(f"| {s} | {m['prompt_tokens_computed']:.0f} | {m['ttft_first_ms']:.0f} | "
                     f"{m['ttft_last_ms']:.0f} | {m['total_ms']:.0f} |")
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu, "date": str(datetime.date.today()), "args": vars(args) | {
        "out": str(args.out)}, "summary": summary, "trials": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
