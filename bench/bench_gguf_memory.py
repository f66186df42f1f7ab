"""Weight memory and speed of a GGUF per way of loading it, beside the file's tensor bytes.

    python bench/bench_gguf_memory.py [--model default] [--threads 2] [--tokens 32] [--prompt-tokens 512]
        [--repeats 3] [--out bench/figures/gguf_memory.json]

Modes: the default (`keep_quantized_weights`: the file's codes kept, engine.gguf_blocks, run by engine.quant's
Int4Linear / Int8Linear), `keep_quantized_weights=False` (float32 weights, dequantized at load), `quantization="int8"` and
`"int4"`. For each: the loaded model's weight bytes
(DecoderModel.weight_memory_bytes: every tensor its linears, embedding and norms hold) against the file's tensor
bytes, the load time, batch-1 greedy decode ms per token over `--tokens` tokens, and the prefill time of one
`--prompt-tokens`-token prompt (prefix caching off, so every repeat computes it). All engines are loaded first
and measured in interleaved rounds (best of `--repeats`), so a noisy machine hits every mode alike; the ratios
to float32 are the figures to read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from engine.llm import LLM
from engine.model_fetch import resolve_model_path
from engine.sampling_params import SamplingParams
from pdserve.bench.roofline import cpu_model

MODES = {"default (file's codes kept)": {}, "float32 (keep_quantized_weights=False)": {"keep_quantized_weights": False},
         "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}}
PROMPT = "The history of science is the study of the development of science and scientific knowledge. "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench/figures/gguf_memory.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(resolve_model_path(args.model))
    engines, rows = {}, {}
    for name, options in MODES.items():
        start = time.perf_counter()
        llm = LLM(model=path, dtype="float32", kv_cache_memory=128 * 2**20, progress=False,
                  enable_prefix_caching=False, num_threads=args.threads, **options)
        load_s = time.perf_counter() - start
        engine = llm.engine
        engines[name] = llm
        rows[name] = {"mode": name, "weight_bytes": engine.weight_memory_bytes,
                      "file_tensor_bytes": engine.file_tensor_bytes,
                      "ratio_to_file": engine.weight_memory_bytes / engine.file_tensor_bytes,
                      "load_s": round(load_s, 2), "decode_ms_per_token": float("inf"), "prefill_ms": float("inf")}
    tokenizer = next(iter(engines.values())).tokenizer
    prompt_ids = (tokenizer.encode(PROMPT * (args.prompt_tokens // 10 + 1)))[:args.prompt_tokens]
    decode_ids = tokenizer.encode("The capital of France is")
    decode = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for llm in engines.values():
        llm.generate([decode_ids], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    for _ in range(args.repeats):
        for name, llm in engines.items():
            start = time.perf_counter()
            llm.generate([prompt_ids], prefill)
            rows[name]["prefill_ms"] = min(rows[name]["prefill_ms"], (time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            out = llm.generate([decode_ids], decode)[0]
            # The first token is the prompt's prefill (5 tokens): decode steps are the rest.
            ms = (time.perf_counter() - start) * 1e3 / len(out.outputs[0].token_ids)
            rows[name]["decode_ms_per_token"] = min(rows[name]["decode_ms_per_token"], ms)
    base = rows["float32 (keep_quantized_weights=False)"]
    for row in rows.values():
        row["decode_vs_float32"] = row["decode_ms_per_token"] / base["decode_ms_per_token"]
        row["prefill_vs_float32"] = row["prefill_ms"] / base["prefill_ms"]
        print(f"{row['mode']:40s} {row['weight_bytes'] / 2**20:7.1f} MiB ({row['ratio_to_file']:.2f}x file)  "
              f"load {row['load_s']:5.1f} s  decode {row['decode_ms_per_token']:6.1f} ms/token "
              f"({row['decode_vs_float32']:.2f}x float32)  prefill {args.prompt_tokens} tokens "
              f"{row['prefill_ms']:7.0f} ms ({row['prefill_vs_float32']:.2f}x)")
    result = {"model": path, "cpu": cpu_model(), "threads": torch.get_num_threads(), "tokens": args.tokens,
              "prompt_tokens": len(prompt_ids), "repeats": args.repeats, "rows": list(rows.values()),
              "caveat": "best of interleaved repeats; absolute times depend on the machine's load"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"file tensors {base['file_tensor_bytes'] / 2**20:.1f} MiB on {result['cpu']}, "
          f"{result['threads']} threads; wrote {args.out}")


if __name__ == "__main__":
    main()
