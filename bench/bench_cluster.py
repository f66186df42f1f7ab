"""The cost of disaggregation on this machine: the cluster vs the offline engine, and what the gateway adds.

    python bench/bench_cluster.py [--prompts 12] [--prompt-len 256] [--out bench/results/cluster.md]

In one run, one request at a time (so the figures are latencies, not queueing), the same token-id prompts,
greedy, EOS ignored, 32 new tokens:
- offline: the engine in this process, 1 thread (each cluster worker also gets 1 of this machine's 2 cores);
- cluster, direct: Reserve / Prefill / Decode called on the workers from this process (no gateway);
- cluster, via gateway: the same through the gateway's public API (client-side timing);
- for both KV transports (shm, grpc): a 1 prefill + 1 decode local cluster with local prefill disabled.
TTFT is the time to the first token, TPOT = (E2EL - TTFT) / (tokens - 1). The gateway's added latency is the
median E2EL via the gateway minus the median E2EL calling the workers directly. KV transfer GB/s is the prefill
worker's reported bytes / transfer time, beside a plain memory copy of the same bytes.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import grpc
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.loader import load_model
from engine.model_fetch import fetch_default_model
from engine.sampling_params import SamplingParams
from pdserve.client import Client
from pdserve.launcher import LocalCluster, LocalClusterConfig
from protos.convert import sampling_to_pb
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def make_prompts(model_path: Path, n: int, length: int) -> list[list[int]]:
    tokenizer = load_model(model_path, with_weights=False).tokenizer
    words = ("river stone lantern orbit maple quartz violet ember harbor cedar falcon meadow ").split()
    prompts = []
    for i in range(n):
        text = " ".join(words[(i * 7 + j * 3) % len(words)] + str(i * 131 + j) for j in range(length))
        prompts.append(tokenizer.encode(text)[:length])
    return prompts


def summarize(samples: list[tuple[float, float]]) -> dict[str, float]:
    """samples: (ttft_s, e2el_s) per request -> p50/p99 of TTFT, TPOT and E2EL in ms."""
    ttft = sorted(s[0] * 1000 for s in samples)
    tpot = sorted((s[1] - s[0]) * 1000 / (NEW_TOKENS - 1) for s in samples)
    e2el = sorted(s[1] * 1000 for s in samples)

    def pct(values, q):
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]
    return {"ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "tpot_p50": pct(tpot, 0.5),
            "tpot_p99": pct(tpot, 0.99), "e2el_p50": statistics.median(e2el)}


def run_offline(model_path: Path, prompts) -> dict[str, float]:
    torch.set_num_threads(1)
    llm = LLM(model=str(model_path), dtype="float32", kv_cache_memory=256 * 2**20, progress=False)
    llm.generate(prompts[0][:16], SamplingParams(max_tokens=2, temperature=0.0))  # warm up
    samples = []
    for p in prompts:
        start = time.perf_counter()
        first = None
        for _ in llm.stream(p, GREEDY):
            first = first or time.perf_counter()
        samples.append((first - start, time.perf_counter() - start))
    return summarize(samples)


def run_gateway(target: str, prompts, salt: str) -> tuple[dict[str, float], list]:
    samples, timings = [], []
    with Client(target) as client:
        client.complete(prompts[0][:16], max_tokens=2, temperature=0.0, cache_salt="warmup")
        for p in prompts:
            start = time.perf_counter()
            first, last = None, None
            with client.generate(p, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                 cache_salt=salt) as stream:
                for chunk in stream:
                    if chunk.token_ids and first is None:
                        first = time.perf_counter()
                    if chunk.timings is not None:
                        last = chunk
            samples.append((first - start, time.perf_counter() - start))
            timings.append(last.timings)
    return summarize(samples), timings


def run_direct(workers: dict[str, str], prompts, salt: str) -> dict[str, float]:
    prefill = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(
        next(e for w, e in workers.items() if w.startswith("prefill"))))
    decode = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(
        next(e for w, e in workers.items() if w.startswith("decode"))))
    samples = []
    for i, p in enumerate(prompts):
        req = worker_pb2.WorkerRequest(request_id=f"direct-{salt}-{i}", prompt_token_ids=p,
                                       sampling=sampling_to_pb(GREEDY), cache_salt=salt, seed=0)
        start = time.perf_counter()
        res = decode.Reserve(worker_pb2.ReserveRequest(request=req, lease_ms=30_000))
        pre = prefill.Prefill(worker_pb2.PrefillRequest(request=req, target=res.target))
        first = time.perf_counter()
        for _ in decode.Decode(worker_pb2.DecodeRequest(request_id=req.request_id, handle=res.target.handle,
                                                        first_token_id=pre.first_token_id)):
            pass
        samples.append((first - start, time.perf_counter() - start))
    return summarize(samples)


def copy_gbps(num_bytes: int) -> float:
    src = torch.ones(max(num_bytes // 4, 1))
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    return num_bytes * 10 / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--out", default="bench/results/cluster.md")
    args = parser.parse_args()

    model_path = fetch_default_model()
    prompts = make_prompts(model_path, args.prompts, args.prompt_len)
    rows = {"offline engine (1 thread)": run_offline(model_path, prompts)}
    transfer = {}
    for transport in ("shm", "grpc"):
        config = LocalClusterConfig(
            num_prefill=1, num_decode=1, port=0, http_port=-1, transport=transport, num_cpus=2,
            engine=EngineConfig(model=str(model_path), dtype="float32", kv_cache_memory=256 * 2**20),
            gateway_args=("--local-prefill-threshold", "0"))
        with LocalCluster(config) as cluster:
            rows[f"cluster 1P+1D {transport}, workers direct"] = run_direct(cluster.workers, prompts, f"d-{transport}")
            stats, timings = run_gateway(cluster.gateway_target, prompts, f"g-{transport}")
            rows[f"cluster 1P+1D {transport}, via gateway"] = stats
        moved = [t for t in timings if t.transport == transport and t.transfer_ms > 0]
        num_bytes = statistics.median(t.transfer_bytes for t in moved)
        transfer[transport] = (num_bytes, statistics.median(t.transfer_bytes / t.transfer_ms / 1e6 for t in moved))

    lines = [f"### Cost of disaggregation ({datetime.date.today()}, {args.prompts} prompts of {args.prompt_len} "
             f"tokens, {NEW_TOKENS} new tokens, one request at a time)", "",
             "Command: `python bench/bench_cluster.py`", "",
             "| shape | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | E2EL p50 ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | {r['tpot_p50']:.1f} | "
                     f"{r['tpot_p99']:.1f} | {r['e2el_p50']:.1f} |")
    lines.append("")
    for transport in ("shm", "grpc"):
        added = (rows[f"cluster 1P+1D {transport}, via gateway"]["e2el_p50"]
                 - rows[f"cluster 1P+1D {transport}, workers direct"]["e2el_p50"])
        lines.append(f"- Gateway added latency ({transport} cluster): {added:.1f} ms per request (median E2EL via "
                     "the gateway minus median E2EL calling the workers directly).")
    for transport, (num_bytes, gbps) in transfer.items():
        lines.append(f"- KV transfer over {transport}: {num_bytes / 2**20:.1f} MiB per request at {gbps:.2f} GB/s "
                     f"(prefill worker's bytes / transfer time); a plain memory copy of the same bytes: "
                     f"{copy_gbps(int(num_bytes)):.1f} GB/s.")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
