"""Where a batch-1 decode step's time goes on CPU, per weight encoding (float32, int8, int4).

    python bench/bench_decode_step.py [--threads 2] [--tokens 64] [--out bench/results/decode_step.md]

Wraps the model's kernel calls (`kernels.rms_norm`, `rotary_embedding`, `write_kv`, `paged_attention`) and every
linear's `forward` with a wall-clock timer, generates `--tokens` greedy tokens for one short prompt after a
warm-up, and prints the milliseconds per token of each (the LM head, an int8 `logits` call, is counted in
"LM head", not in "linear layers"); "other" is the rest of the step (embedding, SiLU, the runner's batch building, sampling). Each
engine is built and stepped on one thread, as a worker does. The timers add a few microseconds per call.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import platform
import threading
import time
from pathlib import Path

import torch

import kernels
import engine.quant as quant
from engine.llm import LLM
from engine.sampling_params import SamplingParams

KERNELS = ("rms_norm", "rotary_embedding", "write_kv", "paged_attention")
QUANTIZATIONS = {"float32": None, "int8": "int8", "int4": "int4"}


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


def measure(quantization: str | None, num_tokens: int, timers: Timers) -> dict[str, float]:
    llm = LLM(progress=False, quantization=quantization)
    ids = llm.tokenizer.encode("The history of science is the study of the development of science")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default="bench/results/decode_step.md")
    args = parser.parse_args()

    timers = Timers()
    for name in KERNELS:
        timers.wrap(kernels, name, name)
    for cls in (quant.FloatLinear, quant.Int8Linear, quant.Int4Linear):
        timers.wrap(cls, "forward", "linear layers")
    for cls in (quant.FloatLinear, quant.Int8Linear):
        timers.wrap(cls, "logits", "LM head")  # the forward inside it counts as LM head

    results: dict[str, dict[str, float]] = {}

    def run() -> None:  # one thread builds and steps each engine, as engine.engine_loop's workers do
        torch.set_num_threads(args.threads)
        for label, quantization in QUANTIZATIONS.items():
            results[label] = measure(quantization, args.tokens, timers)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()

    columns = ["step", "linear layers", "LM head", *KERNELS, "other"]
    lines = [f"### Batch-1 decode step, ms per token ({datetime.date.today()}, {platform.machine()}, "
             f"{args.threads} threads, torch {torch.__version__}, SmolLM2-135M)", "",
             f"Command: `python bench/bench_decode_step.py --threads {args.threads} --tokens {args.tokens}`", "",
             "| weights | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for label, row in results.items():
        lines.append(f"| {label} | " + " | ".join(f"{row.get(c, 0.0):.1f}" for c in columns) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
