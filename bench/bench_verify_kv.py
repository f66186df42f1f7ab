"""Benchmark of the decode worker's --verify-kv: what checking received KV costs next to computing it.

    python bench/bench_verify_kv.py [--prompt-tokens 128 512 1024] [--repeats 3] [--threads 2]

The default model (SmolLM2-135M-Instruct) in one engine, as a decode worker runs it (float32 on CPU, bfloat16 on
CUDA). For each prompt length the engine prefills the prompt with its blocks held (the KV a prefill worker would
send), then engine.kv_verify.verify_received_kv checks those blocks as the decode worker does at commit:

    off      no check (the cost of the transfer alone)
    sample   layer 0's K/V of SAMPLE_BLOCKS random blocks (embed, norm, projections, RoPE of their tokens)
    full     the whole prompt's forward pass into a scratch cache, every layer of every block compared

"prefill ms" is the engine's own prefill of the prompt (what disaggregation moves off the decode worker); the
"% of prefill" columns are each check's cost relative to it. Median of --repeats after a warm-up run. Prints a
markdown table and writes it to --out (default bench/results/verify_kv.md).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.kv_verify import SAMPLE_BLOCKS, verify_received_kv  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    """Median wall time of `fn` over `repeats` runs, after one untimed warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "verify_kv.md")
    args = parser.parse_args()

    llm = LLM(model="default", progress=False, num_threads=args.threads, enable_prefix_caching=False,
              max_model_len=max(args.prompt_tokens) + 16, kv_cache_memory=512 << 20)
    engine = llm.engine
    model, kv_cache = engine.runner.model, engine.runner.kv_cache
    vocab = engine.model_config.vocab_size
    rows = []
    for n, num_tokens in enumerate(args.prompt_tokens):
        prompt = [(1000 + 7919 * i) % vocab for i in range(num_tokens)]
        params = SamplingParams(max_tokens=1, temperature=0.0)

        def prefill(tag: str) -> list[int]:
            seq = engine.add_request(tag, prompt, params, hold_blocks=True)
            while engine.has_unfinished():
                engine.step()
            return seq

        runs = iter(range(10**9))
        prefill_ms = median_ms(lambda: engine.abort(prefill(f"p{n}-{next(runs)}").request_id), args.repeats)
        seq = prefill(f"held-{n}")
        block_ids = list(seq.block_ids)
        times = {mode: median_ms(lambda mode=mode: verify_received_kv(model, kv_cache, prompt, 0, block_ids, mode),
                                 args.repeats) for mode in ("off", "sample", "full")}
        engine.abort(seq.request_id)
        rows.append((num_tokens, len(block_ids), prefill_ms, times))
        print(f"{num_tokens} tokens: prefill {prefill_ms:.1f} ms, sample {times['sample']:.2f} ms, "
              f"full {times['full']:.1f} ms", flush=True)

    device = str(kv_cache.device)
    lines = [f"# --verify-kv cost ({datetime.date.today()}, {platform.processor() or platform.machine()}, "
             f"{device}, {kv_cache.dtype}, {torch.get_num_threads()} threads)", "",
             f"sample checks layer 0 of {SAMPLE_BLOCKS} random blocks; full recomputes the prompt. Median of "
             f"{args.repeats}.", "",
             "| prompt tokens | blocks | prefill ms | off ms | sample ms | sample % of prefill | full ms | "
             "full % of prefill |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for num_tokens, num_blocks, prefill_ms, t in rows:
        lines.append(f"| {num_tokens} | {num_blocks} | {prefill_ms:.1f} | {t['off']:.3f} | {t['sample']:.2f} | "
                     f"{100 * t['sample'] / prefill_ms:.1f} | {t['full']:.1f} | {100 * t['full'] / prefill_ms:.0f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
