"""The offline engine on one CUDA device against transformers, same weights, same token ids, bfloat16.

    python bench/bench_engine_gpu.py [--models smollm2-135m,llama-3.2-1b] [--streams 32,128] [--out DIR]
    python bench/bench_engine_gpu.py --smoke      # tiny shapes on CPU: checks this script, measures nothing

No checkpoint travels to a GPU machine here, so each model is its architecture's shape with seeded random
weights (normal, std 0.02), built on the device: speed depends on the shapes, not on the values. Per model:
    prefill       TTFT of one --prefill-len-token prompt (one engine step / one transformers forward)
    batch 1       decode ms per token of one sequence: (E2E - TTFT) / (new tokens - 1)
    N streams     N sequences of --prompt-len tokens, all due at once, --output-len tokens each (EOS ignored):
                  output tokens / wall time of the whole batch, prefill included
    roofline      batch-1 ms per token if every weight byte came from HBM once at the measured copy bandwidth
                  (pdserve.bench.roofline.copy_bandwidth on the device: a 2 GiB copy, read + write bytes)
pdserve is `LLMEngine` (eager: Triton attention and KV-write kernels, cuBLAS linears, no CUDA graphs); the peer is
transformers' `generate` (eager, its default dynamic cache), static batches of the same prompts. The greedy tokens
of both on the first prompt are compared and the length of their common prefix reported (random weights give flat
logits, so bfloat16 rounding may part them early; tests/kernels checks tokens against the torch path exactly).
Writes engine_gpu.md and engine_gpu.json under --out, else $OUT when set, else bench/results/ (--smoke: only under
--out). Never passes or fails on speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader import LoadedModel  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.bench.roofline import copy_bandwidth  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "unit" / "engine"))
from tiny_model import hf_llama  # noqa: E402  (the tests' transformers twin of a Llama config)

MODELS = {
    "smollm2-135m": ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                                rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-3.2-1b": ModelConfig(architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
                                rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny": ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
                        tie_word_embeddings=True),
}


def random_weights(c: ModelConfig, device: str, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    w = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size), "model.norm.weight": ones(c.hidden_size)}
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": ones(c.hidden_size),
              p + "post_attention_layernorm.weight": ones(c.hidden_size),
              p + "self_attn.q_proj.weight": rand(q, c.hidden_size),
              p + "self_attn.k_proj.weight": rand(kv, c.hidden_size),
              p + "self_attn.v_proj.weight": rand(kv, c.hidden_size),
              p + "self_attn.o_proj.weight": rand(c.hidden_size, q),
              p + "mlp.gate_proj.weight": rand(c.intermediate_size, c.hidden_size),
              p + "mlp.up_proj.weight": rand(c.intermediate_size, c.hidden_size),
              p + "mlp.down_proj.weight": rand(c.hidden_size, c.intermediate_size)}
    return w


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Pdserve:
    name = "pdserve LLMEngine"

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: str, dtype: str, kv_bytes: int):
        loaded = LoadedModel(config=config, weights=weights, tokenizer=None, fingerprint="random-weights")
        self.engine = LLMEngine(EngineConfig(model="random-weights", device=device, dtype=dtype,
                                             kv_cache_memory=kv_bytes, max_num_seqs=256,
                                             max_num_batched_tokens=8192, enable_prefix_caching=False),
                                progress=False, loaded=loaded)
        self.device = device
        self.n = 0

    def run(self, batch: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
        """(seconds to the first token of every sequence, seconds to the end, the tokens)."""
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        sync(self.device)
        t0 = time.perf_counter()
        seqs = []
        for p in batch:
            seqs.append(self.engine.add_request(f"r{self.n}", p, params))
            self.n += 1
        ttft = None
        while self.engine.has_unfinished():
            self.engine.step()
            if ttft is None and all(s.output_token_ids for s in seqs):
                ttft = time.perf_counter() - t0
        return ttft, time.perf_counter() - t0, [list(s.output_token_ids) for s in seqs]


class Transformers:
    name = "transformers generate"

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: str):
        self.model = hf_llama(config, weights)
        self.device = device

    @torch.inference_mode()
    def run(self, batch: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
        ids = torch.tensor(batch, device=self.device)  # equal lengths: no padding
        kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
        sync(self.device)
        t0 = time.perf_counter()
        self.model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        sync(self.device)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = self.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        sync(self.device)
        return ttft, time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def measure(system, vocab: int, args) -> dict:
    r = {}
    system.run(prompts(2, 16, vocab, seed=1), 4)  # kernels compiled / autotuned, allocator warm
    system.run(prompts(1, args.prefill_len, vocab, seed=1), 1)  # and at the prefill's shapes
    ttft, _, _ = system.run(prompts(1, args.prefill_len, vocab, seed=2), 1)
    r["prefill_ms"] = ttft * 1e3
    first = prompts(1, args.prompt_len, vocab, seed=3)
    ttft, e2e, tokens = system.run(first, args.decode_tokens)
    r["tpot_ms"] = (e2e - ttft) / (args.decode_tokens - 1) * 1e3
    r["first_tokens"] = tokens[0]
    for n in args.streams:
        _, e2e, tokens = system.run(prompts(n, args.prompt_len, vocab, seed=4), args.output_len)
        r[f"streams_{n}_tok_s"] = sum(len(t) for t in tokens) / e2e
    return r


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[32, 128])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--no-peer", action="store_true", help="pdserve only")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, float32: checks the script")
    parser.add_argument("--out", default=None, help="report folder (default $OUT, else bench/results; --smoke: none)")
    args = parser.parse_args()
    if args.smoke:
        device, dtype, models = "cpu", "float32", ["tiny"]
        args.streams, args.prompt_len, args.output_len, args.decode_tokens, args.prefill_len = [4], 8, 4, 4, 32
    elif torch.cuda.is_available():
        device, dtype, models = "cuda", "bfloat16", args.models.split(",")
    else:
        print("bench_engine_gpu: no CUDA device available; nothing to measure (--smoke checks the script on CPU)")
        return
    torch_dtype = getattr(torch, dtype)
    where = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or platform.machine()
    bandwidth = copy_bandwidth(2**31 if device == "cuda" else 2**24, device=device)
    print(f"{where}: copy {bandwidth / 1e9:.0f} GB/s; torch {torch.__version__}", flush=True)
    results = {"device": where, "dtype": dtype, "copy_gb_s": bandwidth / 1e9, "torch": torch.__version__,
               "date": datetime.date.today().isoformat(), "args": vars(args), "models": {}}
    for name in models:
        config = MODELS[name]
        weights = random_weights(config, device, torch_dtype)
        weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())  # tied: the head is the embedding
        entry = {"weight_bytes": weight_bytes, "roofline_tpot_ms": weight_bytes / bandwidth * 1e3, "systems": {}}
        peers = [("pdserve", lambda: Pdserve(config, weights, device, dtype, kv_bytes=4 << 30))]
        if not args.no_peer:
            peers.append(("transformers", lambda: Transformers(config, weights, device)))
        for key, make in peers:
            t0 = time.perf_counter()
            system = make()
            r = measure(system, config.vocab_size, args)
            r["wall_s"] = time.perf_counter() - t0
            entry["systems"][key] = r
            print(f"{name} {key}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items() if isinstance(v, float)),
                  flush=True)
            del system
            if device == "cuda":
                torch.cuda.empty_cache()
        if "transformers" in entry["systems"]:
            entry["greedy_common_prefix"] = common_prefix(entry["systems"]["pdserve"]["first_tokens"],
                                                          entry["systems"]["transformers"]["first_tokens"])
        results["models"][name] = entry
        del weights
    out = args.out or (None if args.smoke else os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    write(results, args, None if out is None else Path(out))


def write(results: dict, args, out: Path | None) -> None:
    streams = args.streams
    head = ["model", "system", "prefill TTFT ms", "batch-1 ms/token", "% of roofline"]
    head += [f"{n} streams tok/s" for n in streams]
    lines = [f"# pdserve engine on {results['device']} ({results['dtype']}, {results['date']})", "",
             f"Copy bandwidth {results['copy_gb_s']:.0f} GB/s; torch {results['torch']}. Prefill {args.prefill_len} "
             f"tokens; decode prompts {args.prompt_len} tokens, {args.output_len} new each. "
             "% of roofline: roofline ms / measured ms.", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, entry in results["models"].items():
        for key, r in entry["systems"].items():
            row = [name, key, f"{r['prefill_ms']:.1f}", f"{r['tpot_ms']:.2f}",
                   f"{entry['roofline_tpot_ms'] / r['tpot_ms'] * 100:.1f}%"]
            row += [f"{r[f'streams_{n}_tok_s']:.0f}" for n in streams]
            lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for name, entry in results["models"].items():
        lines.append(f"- {name}: {entry['weight_bytes'] / 1e9:.2f} GB of weights, roofline "
                     f"{entry['roofline_tpot_ms']:.3f} ms/token"
                     + (f"; greedy tokens equal for the first {entry['greedy_common_prefix']} of "
                        f"{args.decode_tokens}" if "greedy_common_prefix" in entry else ""))
    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "engine_gpu.md").write_text(text)
        (out / "engine_gpu.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
