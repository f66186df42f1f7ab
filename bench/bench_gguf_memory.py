"""Weight memory of a GGUF per way of loading it, beside the file's tensor bytes, with a batch-1 decode sanity check.

    python bench/bench_gguf_memory.py [--model default] [--tokens 32] [--out bench/figures/gguf_memory.json]

Modes: `keep_quantized_weights=True` (the file's codes kept, engine.gguf_blocks), the default (float32 weights),
`quantization="int8"` and `"int4"` (requantized from the dequantized weights). For each: the loaded model's
weight bytes (DecoderModel.weight_memory_bytes: every tensor its linears, embedding and norms hold), the load
time, and greedy batch-1 decode tokens/s over `--tokens` tokens after a short prompt (one run: a sanity
check, not a speed benchmark; run it on a quiet machine for figures worth comparing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.llm import LLM  # noqa: E402
from engine.model_fetch import resolve_model_path  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.bench.roofline import cpu_model  # noqa: E402

MODES = {"keep_quantized_weights (file's codes)": {"keep_quantized_weights": True}, "default (float32)": {},
         "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench/figures/gguf_memory.json"))
    args = parser.parse_args()
    path = str(resolve_model_path(args.model))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for name, options in MODES.items():
        start = time.perf_counter()
        llm = LLM(model=path, dtype="float32", kv_cache_memory=64 * 2**20, progress=False,
                  num_threads=args.threads, **options)
        load_s = time.perf_counter() - start
        llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        start = time.perf_counter()
        out = llm.generate(["The capital of France is"], params)[0]
        decode_s = time.perf_counter() - start
        engine = llm.engine
        rows.append({"mode": name, "weight_bytes": engine.weight_memory_bytes,
                     "file_tensor_bytes": engine.file_tensor_bytes,
                     "ratio_to_file": engine.weight_memory_bytes / engine.file_tensor_bytes,
                     "load_s": round(load_s, 2), "batch1_tokens_per_s": round(len(out.outputs[0].token_ids) / decode_s, 2)})
        print(f"{name:32s} {engine.weight_memory_bytes / 2**20:8.1f} MiB  ({rows[-1]['ratio_to_file']:.2f}x file)  "
              f"load {load_s:5.1f} s  batch-1 decode {rows[-1]['batch1_tokens_per_s']:6.2f} tok/s")
        del llm, engine
    result = {"model": path, "cpu": cpu_model(), "threads": args.threads, "tokens": args.tokens, "rows": rows,
              "caveat": "one run per mode; decode speed depends on the machine's load"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"file tensors {rows[0]['file_tensor_bytes'] / 2**20:.1f} MiB on {result['cpu']}; wrote {args.out}")


if __name__ == "__main__":
    main()
