"""Quality table of the default model in every weight mode: weight memory, perplexity, decode speed.

    python bench/bench_quality.py [--threads 2] [--out-dir bench/results/quality] [--skip-speed]
                                  [--skip-perplexity] [--speed-rounds 3] [--speed-tokens 64]
                                  [--llama-perplexity PATH] [--ctx 512] [--modes float32 int4 int4-native ...]

Modes: float32 (the Q4_1 GGUF dequantized), int8, int4 (the GGUF's Q4_1 codes), int4-native (the same codes
through `cpu_matmul="native"`: activations rounded to int8 per 32 inputs and integer dot products, llama.cpp's
arithmetic for Q4_1, where the default rounds them to bfloat16), int4-kv-bf16 (the same codes over a bfloat16 KV
cache, kv_cache_dtype="bfloat16"), and GPTQ checkpoints written by
`pdserve quantize` from the dequantized GGUF: RTN 4-bit g128, GPTQ 4-bit g128, GPTQ 4-bit g128 act-order
(symmetric, calibrated on bench/data/shakespeare_calibration.txt; their LM head runs int8, as in the int4 mode).
--modes runs a subset (float32, the ratios' base, always runs; GPTQ checkpoints are made only when asked for).
Per mode:
- weight memory: bytes one decode step reads (every layer, final norm, LM head; model.decode_weight_bytes);
- perplexity on bench/data/shakespeare_eval.txt the way llama.cpp's llama-perplexity computes it: the token
  stream cut into chunks of --ctx tokens, the first token of a chunk replaced by BOS when the model adds one,
  each chunk evaluated alone and only its second half scored (positions ctx/2 .. ctx-1);
- decode tokens/s at batch 1 and with 32 sequences (--speed-tokens new tokens each after a 16-token prompt):
  the decode steps only, timed once every sequence has its first token (its prefill is not counted); and
  512-token prefill tokens/s (time to the first token). All modes are loaded together and measured in
  --speed-rounds interleaved rounds (the order rotates each round); the best round per mode and figure is kept,
  so that a busy machine slows every mode alike and the ratios to float32 stay meaningful.
llama-perplexity (bench/build_llama_server.sh builds it) runs on the same GGUF, text and --ctx as the
independent check of the Q4_1 row. Figures go to OUT_DIR/quality.json and quality.md; checkpoints are kept in
OUT_DIR and reused (delete them to requantize).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_engine import BATCH, NEW_TOKENS, PREFILL_LEN, prompts_ids  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.model import AttentionMetadata  # noqa: E402
from engine.model_fetch import fetch_default_model  # noqa: E402
from engine.quantize import QuantizeOptions, quantize_checkpoint  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.bench.roofline import cpu_model  # noqa: E402

EVAL_TEXT = ROOT / "bench/data/shakespeare_eval.txt"
CALIBRATION_TEXT = ROOT / "bench/data/shakespeare_calibration.txt"
LLAMA_PERPLEXITY = ROOT / "bench/peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-perplexity"
GPTQ_MODES = {
    "rtn4-g128": QuantizeOptions(method="rtn", bits=4, group_size=128),
    "gptq4-g128": QuantizeOptions(method="gptq", bits=4, group_size=128),
    "gptq4-g128-act-order": QuantizeOptions(method="gptq", bits=4, group_size=128, act_order=True),
}
LABELS = {"float32": "float32 (Q4_1 dequantized)", "int8": "int8 (per-row, from float32)",
          "int4": "int4 (the GGUF's Q4_1 codes)", "int4-native": "int4, `cpu_matmul=\"native\"` (int8 activations)",
          "int4-kv-bf16": "int4, `kv_cache_dtype=\"bfloat16\"`", "rtn4-g128": "RTN 4-bit g128",
          "gptq4-g128": "GPTQ 4-bit g128", "gptq4-g128-act-order": "GPTQ 4-bit g128 act-order"}
KERNEL_MODES = {"int4-native": {"cpu_matmul": "native"}, "int4-kv-bf16": {"kv_cache_dtype": "bfloat16"}}
"""The int4 mode with another EngineConfig choice."""
SPEED_PROMPT_LEN = 16
SPEED_KEYS = ("decode_b1", f"decode_b{BATCH}", "prefill_512")


def perplexity(llm: LLM, token_ids: list[int], ctx: int, bos_id: int | None) -> tuple[float, int]:
    """(perplexity, tokens scored), llama-perplexity's method (module docstring)."""
    runner = llm.engine.runner
    blocks = -(-ctx // runner.block_size)
    block_ids = torch.arange(runner.num_blocks - blocks, runner.num_blocks, dtype=torch.int32)  # scratch blocks
    slots = (block_ids.long()[:, None] * runner.block_size + torch.arange(runner.block_size)).flatten()[:ctx]
    meta = AttentionMetadata(slot_mapping=slots, block_tables=block_ids[None],
                             seq_lens=torch.tensor([ctx], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, ctx], dtype=torch.int32))
    first, nll, count = ctx // 2, 0.0, 0
    for start in range(0, len(token_ids) - ctx + 1, ctx):
        chunk = list(token_ids[start:start + ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        ids = torch.tensor(chunk)
        hidden = runner.model.forward(ids, torch.arange(ctx), runner.kv_cache, meta)
        logits = runner.model.compute_logits(hidden[first:ctx - 1])                 # [ctx - 1 - first, vocab]
        nll += F.cross_entropy(logits.float(), ids[first + 1:], reduction="sum").item()
        count += ctx - 1 - first
    llm.engine.kv.pool.clear_cache()
    return math.exp(nll / count), count


def decode_speed(llm: LLM, batch: int, new_tokens: int) -> float:
    """Decode tokens/s of `batch` greedy sequences: the steps after every sequence has its first token."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(f"speed-{batch}-{i}", ids, params)
            for i, ids in enumerate(prompts_ids(llm.tokenizer, batch, SPEED_PROMPT_LEN))]
    while not all(seq.output_token_ids for seq in seqs):
        engine.step()
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - t
    assert all(len(seq.output_token_ids) == new_tokens for seq in seqs)
    engine.kv.pool.clear_cache()
    return batch * (new_tokens - 1) / elapsed


def prefill_speed(llm: LLM) -> float:
    """Tokens/s of one PREFILL_LEN-token prompt to its first token (nothing of it cached)."""
    llm.engine.kv.pool.clear_cache()
    t = time.perf_counter()
    llm.generate(prompts_ids(llm.tokenizer, 1, PREFILL_LEN), SamplingParams(max_tokens=1, temperature=0.0))
    elapsed = time.perf_counter() - t
    llm.engine.kv.pool.clear_cache()
    return PREFILL_LEN / elapsed


def speed_rounds(engines: dict[str, LLM], rounds: int, new_tokens: int) -> dict[str, dict]:
    """Mode -> {figure: best tok/s over the rounds, figure + "_rounds": every round's}; interleaved (doc)."""
    for llm in engines.values():  # warm up
        llm.generate(prompts_ids(llm.tokenizer, 1, SPEED_PROMPT_LEN), SamplingParams(max_tokens=4, temperature=0.0))
    samples = {name: {key: [] for key in SPEED_KEYS} for name in engines}
    names = list(engines)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            llm = engines[name]
            figures = {"decode_b1": decode_speed(llm, 1, new_tokens),
                       f"decode_b{BATCH}": decode_speed(llm, BATCH, new_tokens), "prefill_512": prefill_speed(llm)}
            for key, value in figures.items():
                samples[name][key].append(value)
            print(f"round {r + 1}/{rounds} {name}", json.dumps(figures), flush=True)
    return {name: {**{key: max(v) for key, v in s.items()}, **{f"{key}_rounds": v for key, v in s.items()}}
            for name, s in samples.items()}


def load_mode(name: str, model_path: Path, out_dir: Path, loaded, kv_cache_memory: int) -> LLM:
    if name in GPTQ_MODES:  # the LM head (kept float16 in the checkpoint) runs int8, as in the int4 mode
        return LLM(model=str(out_dir / name), dtype="float32", quantization="int8",
                   kv_cache_memory=kv_cache_memory, progress=False)
    if name in KERNEL_MODES:
        return LLM(model=str(model_path), dtype="float32", quantization="int4", kv_cache_memory=kv_cache_memory,
                   progress=False, loaded=loaded, **KERNEL_MODES[name])
    return LLM(model=str(model_path), dtype="float32", quantization=None if name == "float32" else name,
               kv_cache_memory=kv_cache_memory, progress=False, loaded=loaded)


def llama_cpp_perplexity(binary: Path, model: Path, ctx: int, threads: int) -> dict:
    proc = subprocess.run([str(binary), "-m", str(model), "-f", str(EVAL_TEXT), "-c", str(ctx), "-b", str(ctx),
                           "-t", str(threads)], capture_output=True, text=True, timeout=3600)
    match = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", proc.stdout + proc.stderr)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", proc.stdout + proc.stderr)
    if match is None:
        raise RuntimeError(f"llama-perplexity failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"ppl": float(match.group(1)), "stderr": float(match.group(2)),
            "chunks": int(chunks.group(1)) if chunks else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out-dir", default=str(ROOT / "bench/results/quality"))
    parser.add_argument("--ctx", type=int, default=512, help="perplexity chunk length (llama-perplexity -c)")
    parser.add_argument("--llama-perplexity", default=str(LLAMA_PERPLEXITY), help="binary; '' skips it")
    parser.add_argument("--skip-speed", action="store_true", help="only memory and perplexity")
    parser.add_argument("--skip-perplexity", action="store_true", help="only memory and speed")
    parser.add_argument("--speed-tokens", type=int, default=NEW_TOKENS,
                        help="new tokens per sequence in the decode speed runs")
    parser.add_argument("--speed-rounds", type=int, default=3, help="interleaved speed rounds (best one kept)")
    parser.add_argument("--modes", nargs="+", choices=list(LABELS), default=list(LABELS),
                        help="modes to run (float32 always runs: the ratios' base)")
    args = parser.parse_args()
    modes = ["float32"] + [name for name in LABELS if name in args.modes and name != "float32"]
    torch.set_num_threads(args.threads)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    model_path = fetch_default_model()
    text = EVAL_TEXT.read_text(encoding="utf-8")
    quantize_s = {}
    for name, options in GPTQ_MODES.items():
        if name in modes and not (out_dir / name / "config.json").is_file():
            t = time.perf_counter()
            quantize_checkpoint(model_path, out_dir / name, options, CALIBRATION_TEXT.read_text(encoding="utf-8"),
                                progress=False, log=lambda line, name=name: print(f"{name}: {line}", flush=True))
            quantize_s[name] = time.perf_counter() - t

    loaded = load_model(model_path, torch.float32, progress=False, keep_quantized=False)  # the float32 row is float
    results: dict[str, dict] = {name: {"label": LABELS[name]} for name in modes}
    if not args.skip_perplexity:
        for name in modes:
            llm = load_mode(name, model_path, out_dir, loaded, 512 * 2**20)
            tokenizer = llm.tokenizer
            ids = tokenizer.encode(text)
            adds_bos = tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]
            t = time.perf_counter()
            ppl, scored = perplexity(llm, ids, args.ctx, tokenizer.bos_token_id if adds_bos else None)
            results[name] |= {"weight_mib": llm.engine.runner.model.decode_weight_bytes() / 2**20, "ppl": ppl,
                              "tokens_scored": scored, "ppl_s": time.perf_counter() - t}
            print(name, json.dumps(results[name]), flush=True)
            del llm
    if not args.skip_speed:
        engines = {name: load_mode(name, model_path, out_dir, loaded, 256 * 2**20) for name in modes}
        for name, figures in speed_rounds(engines, args.speed_rounds, args.speed_tokens).items():
            results[name] |= {"weight_mib": engines[name].engine.runner.model.decode_weight_bytes() / 2**20,
                              **figures}
        del engines
    del loaded

    peer = None
    if not args.skip_perplexity and args.llama_perplexity and Path(args.llama_perplexity).is_file():
        peer = llama_cpp_perplexity(Path(args.llama_perplexity), model_path, args.ctx, args.threads)
        print("llama-perplexity", json.dumps(peer), flush=True)

    meta = {"date": str(datetime.date.today()), "cpu": cpu_model(), "threads": args.threads,
            "torch": torch.__version__, "ctx": args.ctx, "eval_text": str(EVAL_TEXT.relative_to(ROOT)),
            "calibration_text": str(CALIBRATION_TEXT.relative_to(ROOT)), "quantize_s": quantize_s,
            "speed_tokens": args.speed_tokens, "speed_rounds": args.speed_rounds,
            "speed_prompt_len": SPEED_PROMPT_LEN}
    save(out_dir, meta, results, peer)


def save(out_dir: Path, meta: dict, results: dict[str, dict], peer: dict | None) -> None:
    """Write quality.json and quality.md (the BENCHMARKS.md table) into out_dir, and print the table."""
    (out_dir / "quality.json").write_text(json.dumps({"meta": meta, "modes": results, "llama_perplexity": peer},
                                                     indent=2))
    base = results["float32"]
    with_ppl, with_speed = "ppl" in base, "decode_b1" in base
    header, rule = "| mode | weight MiB read per decode step |", "|---|---:|"
    if with_ppl:
        header, rule = header + " perplexity | vs float32 |", rule + "---:|---:|"
    if with_speed:
        header += (f" decode tok/s b1 | b1 vs float32 | decode tok/s b{BATCH} | b{BATCH} vs float32 |"
                   f" prefill tok/s ({PREFILL_LEN}) |")
        rule += "---:|---:|---:|---:|---:|"
    lines = [f"Measured {meta['date']} on {meta['cpu']}, {meta['threads']} threads, torch {meta['torch']}."]
    if with_ppl:
        lines.append(f"Perplexity over {base['tokens_scored']} tokens of {meta['eval_text']} (chunks of "
                     f"{meta['ctx']}, second halves scored).")
    if with_speed:
        lines.append(f"Speed: best of {meta['speed_rounds']} interleaved rounds; decode steps only, "
                     f"{meta['speed_tokens']} new tokens after a {meta['speed_prompt_len']}-token prompt.")
    lines += ["", header, rule]
    for r in results.values():
        line = f"| {r['label']} | {r['weight_mib']:.1f} |"
        if with_ppl:
            line += f" {r['ppl']:.3f} | {r['ppl'] / base['ppl'] - 1:+.2%} |"
        if with_speed:
            b32 = f"decode_b{BATCH}"
            line += (f" {r['decode_b1']:.1f} | {r['decode_b1'] / base['decode_b1']:.2f}x | {r[b32]:.1f} |"
                     f" {r[b32] / base[b32]:.2f}x | {r['prefill_512']:.1f} |")
        lines.append(line)
    if peer and with_ppl:
        lines += ["", f"llama.cpp llama-perplexity on the same GGUF (Q4_1), text and -c {meta['ctx']}: "
                  f"PPL = {peer['ppl']:.4f} +/- {peer['stderr']:.4f} over {peer['chunks']} chunks; "
                  f"pdserve float32 (exactly those weights): {base['ppl']:.4f} "
                  f"({base['ppl'] / peer['ppl'] - 1:+.2%}), int4 (the same codes): {results['int4']['ppl']:.4f} "
                  f"({results['int4']['ppl'] / peer['ppl'] - 1:+.2%})."]
    (out_dir / "quality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
