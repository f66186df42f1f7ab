"""Where a batch-1 decode step's time goes on CPU, per weight encoding (float32, int8, int4), and what the
compiled decode step (engine.compiled_step) saves against the eager one.

    python bench/bench_decode_step.py [--threads 2] [--tokens 64] [--out bench/results/decode_step.md]
        [--compiled-batch-sizes 1,32] [--quantizations float32,int8,int4] [--repeats 30] [--no-breakdown]
        [--eager-only] [--llama-server PATH]

Encodings (ENCODINGS): float32, int8 / int4 on torch's kernels, int8-native / int4-native
(EngineConfig.cpu_matmul="native", kernels.cpu_matmul on int8 activations) and int8-native-bf16 /
int4-native-bf16 ("native-bf16", the default: the same library on bfloat16 activations). --eager-only skips compiling: the table then has the eager steps only, each batch-1 row
as a ratio to llama-server's (measured before and after pdserve's rows, the best of both).

Compiled table: one engine per weight encoding, compiled for each of --compiled-batch-sizes at start-up (the
seconds are reported); then, per batch size, a decode step of that many sequences at a 128-token context is run
--repeats times through the compiled graph and through the eager `run_step`, interleaved, on the same engine and
KV cache. Reported: the fastest and the median step of each in ms per token (thread CPU time, which a loaded
machine disturbs less than wall time; wall time for the fastest step too) and as a % of the roofline: the weight
bytes one step reads (`DecoderModel.decode_weight_bytes`) at the copy bandwidth (pdserve.bench.roofline),
shared by the step's tokens. The logits of both paths are compared (greedy tokens must agree). With
--llama-server PATH (the binary or its build directory), llama-server decodes --tokens tokens of the same prompt
token ids on the same GGUF with --threads threads, best of --repeats // 5 + 1 requests (its own
predicted_per_token_ms, wall time: compare with the wall column).

Breakdown table:

Wraps the model's kernel calls (`kernels.rms_norm`, `rotary_embedding`, `write_kv`, `paged_attention`, `silu_mul`:
native C or torch's, as kernels.dispatch picks them; PDSERVE_KERNEL_BACKEND=torch pins torch's) and every
linear's `forward` with a wall-clock timer, generates `--tokens` greedy tokens for one short prompt after a
warm-up, and prints the milliseconds per token of each (the LM head, an int8 `logits` call, is counted in
"LM head", not in "linear layers"), and the native decoder's one call a step ("native layers": where it runs, the
kernels and linears inside it are not timed one by one); "other" is the rest of the step (embedding, the runner's
batch building, sampling). Each
engine is built and stepped on one thread, as a worker does. The timers add a few microseconds per call.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import torch

import engine.quant as quant
import kernels
from engine.llm import LLM
from engine.model_fetch import fetch_default_model
from engine.sampling_params import SamplingParams
from engine.step_batch import StepBatch, run_step
from kernels import cpu_ops
from pdserve.bench.peers import LlamaServer, LlamaServerConfig, find_llama_server
from pdserve.bench.roofline import copy_bandwidth, cpu_model
from pdserve.cli_args import parse_int_list

KERNELS = ("rms_norm", "rotary_embedding", "write_kv", "paged_attention", "silu_mul")
ENCODINGS = {"default": {},
             "float32": {"keep_quantized_weights": False},
             "int8": {"quantization": "int8", "keep_quantized_weights": True, "cpu_matmul": "torch"},
             "int4": {"quantization": "int4", "keep_quantized_weights": True, "cpu_matmul": "torch"},
             "int8-native": {"quantization": "int8", "keep_quantized_weights": True, "cpu_matmul": "native"},
             "int4-native": {"quantization": "int4", "keep_quantized_weights": True, "cpu_matmul": "native"},
             "int8-native-bf16": {"quantization": "int8", "keep_quantized_weights": True, "cpu_matmul": "native-bf16"},
             "int4-native-bf16": {"quantization": "int4", "keep_quantized_weights": True, "cpu_matmul": "native-bf16"}}
"""Weight encodings by label: LLM keyword arguments (default: the engine's defaults, the GGUF's codes kept and
"native-bf16"; int8 / int4: torch's kernels; -native:
EngineConfig.cpu_matmul="native", int8 activations; -native-bf16: "native-bf16", bfloat16 activations); float32
dequantizes the GGUF at load, the quantized ones keep its codes."""


class Timers:
    """Wall-clock seconds by label; a timed call inside another one counts only for the outer one."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self._inside = False

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            if self._inside:
                return fn(*args, **kwargs)
            self._inside = True
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self._inside = False

        setattr(owner, name, timed)


def measure(encoding: dict, num_tokens: int, timers: Timers) -> dict[str, float]:
    llm = LLM(progress=False, **encoding)
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([ids], params)  # warm-up
    llm.engine.kv.pool.clear_cache()
    timers.seconds.clear()
    start = time.perf_counter()
    llm.generate([ids], params)
    total = time.perf_counter() - start
    per_token = {label: s / num_tokens * 1e3 for label, s in timers.seconds.items()}
    per_token["step"] = total / num_tokens * 1e3
    per_token["other"] = per_token["step"] - sum(v for k, v in per_token.items() if k != "step")
    return per_token


CONTEXT_TOKENS = 128
PROMPT = "The history of science is the study of the development of science"


def decode_batch(num_seqs: int, block_size: int, context: int = CONTEXT_TOKENS) -> StepBatch:
    """A decode step of `num_seqs` sequences of `context` tokens each, in disjoint blocks from block 0."""
    per_seq = -(-context // block_size)
    tables = [[s * per_seq + j for j in range(per_seq)] for s in range(num_seqs)]
    last = context - 1
    return StepBatch([17] * num_seqs, [last] * num_seqs, [t[last // block_size] * block_size + last % block_size
                                                          for t in tables],
                     tables, [context] * num_seqs, list(range(num_seqs + 1)), list(range(num_seqs)))


def compare_compiled(label: str, batch_sizes: tuple[int, ...], repeats: int, bandwidth: float,
                     compiled: bool = True) -> list[dict]:
    """Rows of the compiled table for one weight encoding (module docstring); eager steps only when not
    `compiled` (no compile at start-up)."""
    start = time.perf_counter()
    llm = LLM(progress=False, **ENCODINGS[label], compile_decode=compiled, compile_batch_sizes=batch_sizes,
              max_num_seqs=max(batch_sizes), num_kv_blocks=max(batch_sizes) * (CONTEXT_TOKENS // 16 + 1) + 8)
    build_s = time.perf_counter() - start
    runner = llm.engine.runner
    weight_bytes = runner.model.decode_weight_bytes()
    modes = ("compiled", "eager") if compiled else ("eager",)
    if runner.model.native_decoder is not None:
        modes += ("loop",)  # the eager step with the native decoder off: the Python layer loop
    rows = []
    for n in batch_sizes:
        batch = decode_batch(n, runner.block_size)
        cpu: dict[str, list[float]] = {mode: [] for mode in modes}
        wall: dict[str, list[float]] = {mode: [] for mode in modes}
        eager_logits = compiled_logits = None
        for _ in range(repeats):
            for mode in modes:
                t0, w0 = time.thread_time(), time.perf_counter()
                if mode == "compiled":
                    compiled_logits = runner.compiled.run(batch)
                elif mode == "eager":
                    eager_logits, _ = run_step(runner.model, runner.kv_cache, batch, runner.device)
                else:
                    decoder, runner.model.native_decoder = runner.model.native_decoder, None
                    loop_logits, _ = run_step(runner.model, runner.kv_cache, batch, runner.device)
                    runner.model.native_decoder = decoder
                cpu[mode].append(time.thread_time() - t0)
                wall[mode].append(time.perf_counter() - w0)
        roofline_step_ms = weight_bytes / bandwidth * 1e3
        row = {"weights": label, "batch": n, "build_s": build_s, "roofline_ms_per_token": roofline_step_ms / n}
        if compiled:
            row.update(compile_s=runner.compiled.compile_seconds,
                       same_greedy=bool(torch.equal(compiled_logits.argmax(-1), eager_logits.argmax(-1))),
                       max_logit_diff=float((compiled_logits - eager_logits).abs().max()))
        if "loop" in modes:
            row["native_equals_loop"] = bool(torch.equal(loop_logits, eager_logits))
        for mode in modes:
            best, median = min(cpu[mode]) * 1e3 / n, statistics.median(cpu[mode]) * 1e3 / n
            row[mode] = {"ms_per_token_best": best, "ms_per_token_median": median,
                         "wall_ms_per_token_best": min(wall[mode]) * 1e3 / n,
                         "roofline_pct": 100 * roofline_step_ms / n / best}
        rows.append(row)
    return rows


def llama_server_ms_per_token(binary: str, threads: int, token_ids: list[int], num_tokens: int,
                              requests: int) -> float:
    """llama-server's best predicted_per_token_ms over `requests` greedy completions of `token_ids`."""
    path = Path(binary)
    if path.is_dir():
        path = path / "llama-server" if (path / "llama-server").is_file() else find_llama_server(None, path)
    config = LlamaServerConfig(binary=find_llama_server(str(path)),
                               model=fetch_default_model(progress=False), threads=threads, parallel=1)
    best = float("inf")
    with LlamaServer(config, Path("bench/results/llama_server_decode_step.log")) as server:
        for _ in range(requests):
            body = json.dumps({"prompt": token_ids, "n_predict": num_tokens, "temperature": 0.0, "ignore_eos": True,
                               **LlamaServer.extra_body, "cache_prompt": False}).encode()
            request = urllib.request.Request(server.base_url + "/completion", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as response:
                best = min(best, json.load(response)["timings"]["predicted_per_token_ms"])
    return best


def eager_table(rows: list[dict], args, bandwidth: float, llama_ms: float | None) -> str:
    """--eager-only: eager steps per encoding and batch size, as ratios to llama-server's batch-1 step."""
    lines = [(f"### Eager decode step, ms per token ({datetime.date.today()}, {cpu_model()}, {args.threads} threads, "
              f"torch {torch.__version__}, SmolLM2-135M, {CONTEXT_TOKENS}-token context, copy bandwidth "
              f"{bandwidth / 1e9:.1f} GB/s, load average {os.getloadavg()[0]:.1f}, kernel backend "
              f"{kernels.get_backend()})"), "",
             (f"Command: `python bench/bench_decode_step.py --eager-only --threads {args.threads} "
              f"--compiled-batch-sizes {','.join(map(str, args.compiled_batch_sizes))} --quantizations "
              f"{','.join(args.quantizations)} --repeats {args.repeats}"
              + (" --llama-server PATH`" if llama_ms is not None else "`")), "",
             ("| weights | batch | best (median) | wall best | % roofline | roofline | wall / llama-server batch 1 "
              "| layer loop best (median) | same logits |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        e, loop = r["eager"], r.get("loop")
        ratio = f"{e['wall_ms_per_token_best'] / llama_ms:.2f}x" if llama_ms and r["batch"] == 1 else "-"
        loop_cell = f"{loop['ms_per_token_best']:.2f} ({loop['ms_per_token_median']:.2f})" if loop else "-"
        same = "-" if loop is None else "yes" if r["native_equals_loop"] else "NO"
        lines.append(f"| {r['weights']} | {r['batch']} | {e['ms_per_token_best']:.2f} ({e['ms_per_token_median']:.2f}) "
                     f"| {e['wall_ms_per_token_best']:.2f} | {e['roofline_pct']:.0f}% | {r['roofline_ms_per_token']:.2f} "
                     f"| {ratio} | {loop_cell} | {same} |")
    lines += ["", ("The step is the engine's: pure decode batches through the native decoder (kernels.cpu_ops."
                   "DecoderLayers) where the model has one; \"layer loop\" is the same step with it off (the "
                   "Python loop over the same kernels), \"same logits\" whether the two are bit-identical.")]
    if llama_ms is not None:
        lines += ["", (f"llama-server (same GGUF, {args.threads} threads, batch 1, {args.tokens} tokens, best of "
                       f"2 x {args.repeats // 5 + 1} requests before and after the rows above, its own "
                       f"predicted_per_token_ms): {llama_ms:.2f} ms per token.")]
    return "\n".join(lines) + "\n"


def compiled_table(rows: list[dict], args, bandwidth: float, llama_ms: float | None) -> str:
    lines = [(f"### Compiled vs eager decode step, ms per token ({datetime.date.today()}, {cpu_model()}, "
              f"{args.threads} threads, torch {torch.__version__}, SmolLM2-135M, {CONTEXT_TOKENS}-token context, "
              f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, load average {os.getloadavg()[0]:.1f})"), "",
             (f"Command: `python bench/bench_decode_step.py --threads {args.threads} --compiled-batch-sizes "
              f"{','.join(map(str, args.compiled_batch_sizes))} --quantizations {','.join(args.quantizations)} "
              f"--repeats {args.repeats}`"), "",
             ("| weights | batch | eager best (median) | compiled best (median) | compiled / eager "
              "| eager % roofline | compiled % roofline | roofline | compile s | same greedy |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        e, c = r["eager"], r["compiled"]
        lines.append(f"| {r['weights']} | {r['batch']} | {e['ms_per_token_best']:.2f} ({e['ms_per_token_median']:.2f}) "
                     f"| {c['ms_per_token_best']:.2f} ({c['ms_per_token_median']:.2f}) "
                     f"| {c['ms_per_token_best'] / e['ms_per_token_best']:.2f} | {e['roofline_pct']:.0f}% "
                     f"| {c['roofline_pct']:.0f}% | {r['roofline_ms_per_token']:.2f} | {r['compile_s']:.0f} "
                     f"| {'yes' if r['same_greedy'] else 'NO'} |")
    lines += ["", "Wall time, fastest step, ms per token: " + ", ".join(
        f"{r['weights']} batch {r['batch']} eager {r['eager']['wall_ms_per_token_best']:.2f} / compiled "
        f"{r['compiled']['wall_ms_per_token_best']:.2f}" for r in rows) + "."]
    if llama_ms is not None:
        lines.append(f"llama-server (same GGUF, {args.threads} threads, batch 1, {args.tokens} tokens): "
                     f"{llama_ms:.2f} ms per token.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default="bench/results/decode_step.md")
    parser.add_argument("--compiled-batch-sizes", type=parse_int_list, default=(1, 32),
                        help="batch sizes of the compiled table (each compiled at start-up)")
    parser.add_argument("--quantizations", type=lambda t: t.split(","), default=["float32", "int8", "int4"],
                        help=f"weight encodings of the compiled table, of {', '.join(ENCODINGS)}")
    parser.add_argument("--eager-only", action="store_true",
                        help="no compiled graphs: eager steps only (seconds instead of minutes per encoding)")
    parser.add_argument("--repeats", type=int, default=30, help="interleaved steps per row of the compiled table")
    parser.add_argument("--llama-server", help="llama-server binary or build directory: a batch-1 peer row")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                        help="skip the per-op breakdown table")
    args = parser.parse_args()
    for name in args.quantizations:
        if name not in ENCODINGS:
            parser.error(f"--quantizations: {name!r} is not one of {', '.join(ENCODINGS)}")

    texts: list[str] = []
    compiled_rows: list[dict] = []

    def run_compiled() -> None:  # before the breakdown's timers wrap the kernels (the compiler would trace them)
        torch.set_num_threads(args.threads)
        bandwidth = copy_bandwidth(2**28)
        llama_ms = None
        ids = LLM(progress=False, num_kv_blocks=8).tokenizer.encode(PROMPT)

        def peer() -> float:
            return llama_server_ms_per_token(args.llama_server, args.threads, ids, args.tokens, args.repeats // 5 + 1)

        if args.llama_server:  # before and after pdserve's rows (a noisy machine drifts): the best of both
            llama_ms = peer()
        for name in args.quantizations:
            compiled_rows.extend(compare_compiled(name, args.compiled_batch_sizes, args.repeats, bandwidth,
                                                  compiled=not args.eager_only))
        if args.llama_server:
            llama_ms = min(llama_ms, peer())
        table = eager_table if args.eager_only else compiled_table
        texts.append(table(compiled_rows, args, bandwidth, llama_ms))
        print(texts[-1], flush=True)

    thread = threading.Thread(target=run_compiled)
    thread.start()
    thread.join()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_name("decode_step_eager.json" if args.eager_only else "decode_step_compiled.json").write_text(
        json.dumps({"cpu": cpu_model(), "threads": args.threads, "rows": compiled_rows}, indent=1))
    if not args.breakdown:
        Path(args.out).write_text("\n".join(texts))
        return

    timers = Timers()
    for name in KERNELS:
        timers.wrap(kernels, name, name)
    for cls in (quant.FloatLinear, quant.Int8Linear, quant.Int4Linear):
        timers.wrap(cls, "forward", "linear layers")
    for cls in (quant.FloatLinear, quant.Int8Linear):
        timers.wrap(cls, "logits", "LM head")  # the forward inside it counts as LM head
    timers.wrap(cpu_ops.DecoderLayers, "__call__", "native layers")

    results: dict[str, dict[str, float]] = {}

    def run() -> None:  # one thread builds and steps each engine, as engine.engine_loop's workers do
        torch.set_num_threads(args.threads)
        for label in args.quantizations:
            results[label] = measure(ENCODINGS[label], args.tokens, timers)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()

    columns = ["step", "native layers", "linear layers", "LM head", *KERNELS, "other"]
    lines = [(f"### Batch-1 decode step, ms per token ({datetime.date.today()}, {platform.machine()}, "
              f"{args.threads} threads, torch {torch.__version__}, SmolLM2-135M, kernel backend "
              f"{kernels.get_backend()})"), "",
             (f"Command: `python bench/bench_decode_step.py --threads {args.threads} --tokens {args.tokens} "
              f"--quantizations {','.join(args.quantizations)}`"), "",
             "| weights | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for label, row in results.items():
        lines.append(f"| {label} | " + " | ".join(f"{row.get(c, 0.0):.1f}" for c in columns) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text("\n".join([*texts, text]))


if __name__ == "__main__":
    main()
