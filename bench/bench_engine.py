"""Offline engine throughput vs Hugging Face transformers on the same GGUF, plus the memory-bandwidth roofline.

    python bench/bench_engine.py [--threads 2] [--out bench/results/engine.md]

Measures, in one run on this machine, for pdserve with float32 weights, with int8 weights (`quantization="int8"`),
with int4 weights (`quantization="int4"`) and transformers:
- decode tokens/s at batch 1 and with 32 concurrent sequences (greedy, EOS ignored, 64 new tokens each);
- prefill tokens/s for one 512-token prompt (time to the first token);
- the batch-1 decode roofline: weight bytes read per token / measured memory copy bandwidth.
transformers runs the same token ids with `generate` (static batch of 32, left padding for the batched case).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from pathlib import Path

import torch

from engine.llm import LLM
from engine.loader import load_model
from engine.model_fetch import fetch_default_model
from engine.sampling_params import SamplingParams
from pdserve.bench.roofline import copy_bandwidth

NEW_TOKENS = 64
BATCH = 32
PREFILL_LEN = 512


def prompts_ids(tokenizer, n: int, length: int) -> list[list[int]]:
    text = ("The history of science is the study of the development of science and scientific knowledge, "
            "including both the natural and social sciences. ") * 64
    base = tokenizer.encode(text)
    return [base[i:i + length] for i in range(n)]


def bench_pdserve(llm: LLM) -> dict[str, float]:
    tok = llm.tokenizer
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    results = {}
    llm.generate(prompts_ids(tok, 1, 32), SamplingParams(max_tokens=4, temperature=0.0))  # warm up
    for batch in (1, BATCH):
        ps = prompts_ids(tok, batch, 32)
        llm.engine.kv.pool.clear_cache()
        t = time.perf_counter()
        llm.generate(ps, params)
        results[f"decode_b{batch}"] = batch * NEW_TOKENS / (time.perf_counter() - t)
    p = prompts_ids(tok, 1, PREFILL_LEN)
    llm.engine.kv.pool.clear_cache()
    t = time.perf_counter()
    llm.generate(p, SamplingParams(max_tokens=1, temperature=0.0))
    results["prefill_512"] = PREFILL_LEN / (time.perf_counter() - t)
    return results


def bench_transformers(model_path: Path, tokenizer) -> dict[str, float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                              dtype=torch.float32).eval()
    results = {}
    with torch.inference_mode():
        for batch in (1, BATCH):
            ids = torch.tensor(prompts_ids(tokenizer, batch, 32))
            mask = torch.ones_like(ids)
            model.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=2, do_sample=False)
            t = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False)
            results[f"decode_b{batch}"] = batch * NEW_TOKENS / (time.perf_counter() - t)
        ids = torch.tensor(prompts_ids(tokenizer, 1, PREFILL_LEN))
        t = time.perf_counter()
        model(ids)
        results["prefill_512"] = PREFILL_LEN / (time.perf_counter() - t)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="bench/results/engine.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model_path = fetch_default_model()
    loaded = load_model(model_path, torch.float32, progress=False, keep_quantized=False)  # the float32 row is float
    quantizations = {"float32": None, "int8": "int8", "int4": "int4"}
    engines = {name: LLM(model=str(model_path), dtype="float32", quantization=quantization,
                         kv_cache_memory=512 * 2**20, progress=False, loaded=loaded)
               for name, quantization in quantizations.items()}
    del loaded
    bandwidth = copy_bandwidth()
    weight_bytes = {name: llm.engine.runner.model.decode_weight_bytes() for name, llm in engines.items()}
    roofline = {name: bandwidth / num_bytes for name, num_bytes in weight_bytes.items()}

    ours = {name: bench_pdserve(llm) for name, llm in engines.items()}
    theirs = bench_transformers(model_path, engines["float32"].tokenizer)

    rows = [("decode tok/s, batch 1", "decode_b1"), (f"decode tok/s, {BATCH} sequences", f"decode_b{BATCH}"),
            (f"prefill tok/s, {PREFILL_LEN}-token prompt", "prefill_512")]
    names = [("float32", "pdserve"), ("int8", "pdserve int8"), ("int4", "pdserve int4")]
    lines = [
        f"### Offline engine vs transformers ({datetime.date.today()}, {platform.machine()}, "
        f"{args.threads} threads, torch {torch.__version__}, float32 activations)",
        "",
        f"Command: `python bench/bench_engine.py --threads {args.threads}`",
        "",
        "| metric | " + " | ".join(label for _, label in names) + " | transformers | "
        + " | ".join(f"{label} / tf" for _, label in names) + " |",
        "|---|" + "---:|" * (2 * len(names) + 1),
    ]
    for label, key in rows:
        ts = [ours[name][key] for name, _ in names]
        tf = theirs[key]
        lines.append(f"| {label} | " + " | ".join(f"{t:.1f}" for t in ts) + f" | {tf:.1f} | "
                     + " | ".join(f"{t / tf:.2f}x" for t in ts) + " |")
    lines += [""]
    for name, label in (("float32", "float32 weights"), ("int8", "int8 weights (+ bf16 scales, float32 norms)"),
                        ("int4", "int4 layer weights (+ bf16 group scales and offsets), int8 LM head")):
        lines.append(
            f"Batch-1 decode roofline, {label}: {weight_bytes[name] / 2**20:.0f} MiB read per token, "
            f"copy bandwidth {bandwidth / 1e9:.1f} GB/s -> at most {roofline[name]:.1f} tok/s; "
            f"pdserve reaches {ours[name]['decode_b1'] / roofline[name]:.0%} of it.")
    lines += [""]
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
