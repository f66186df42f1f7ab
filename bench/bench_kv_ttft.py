"""TTFT of a long prompt: the one-process engine vs 1P+1D clusters (shm and grpc KV transport), interleaved.

    python bench/bench_kv_ttft.py [--prompts 4] [--prompt-len 2048] [--out bench/results/kv_ttft.md]

Issue 16's goal: 1P+1D TTFT for a 2k-token prompt <= 1.05x the one-process engine's. In one run, with both
clusters up at once (plaintext inside: bench_tls.py measures mutual TLS; each idle while the others measure),
each prompt goes to the offline engine (1 thread, in this process) and to the workers of each cluster directly
(Reserve, then Prefill, whose reply carries the first token, then Decode of the rest), in an order that rotates
per prompt, so that load on a shared machine hits every path alike. TTFT is the time to the first token; for a
cluster it includes Reserve, the prefill, the KV push and the reply. The prefill worker's own figures
(prefill_ms, transfer_ms) are reported beside it. Distinct prompts, a distinct cache_salt per path: no
prefix-cache hits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402

from bench_cluster import make_prompts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.model_fetch import fetch_default_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.bench.roofline import cpu_model  # noqa: E402
from pdserve.launcher import LocalCluster, LocalClusterConfig  # noqa: E402
from protos.convert import sampling_to_pb  # noqa: E402
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

NEW_TOKENS = 4
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
KV_MEMORY = 512 * 2**20


class Offline:
    def __init__(self, model_path: Path) -> None:
        torch.set_num_threads(1)  # each cluster worker also gets one of the cores
        self.llm = LLM(model=str(model_path), dtype="float32", kv_cache_memory=KV_MEMORY, progress=False)
        self.llm.generate([1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0.0))  # warm up

    def ttft(self, prompt: list[int], index: int) -> dict:
        start = time.perf_counter()
        first = None
        for _ in self.llm.stream(prompt, GREEDY):
            first = first or time.perf_counter()
        return {"ttft_ms": (first - start) * 1e3}


class Direct:
    """Reserve / Prefill / Decode on one cluster's workers, as the gateway calls them."""

    def __init__(self, cluster: LocalCluster, transport: str) -> None:
        self.transport = transport
        self.prefill = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(
            next(e for w, e in cluster.workers.items() if w.startswith("prefill"))))
        self.decode = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(
            next(e for w, e in cluster.workers.items() if w.startswith("decode"))))
        self.ttft([1, 2, 3, 4] * 8, -1)  # warm up: channels, the sender's pool, the receiver's buffers

    def ttft(self, prompt: list[int], index: int) -> dict:
        req = worker_pb2.WorkerRequest(request_id=f"ttft-{self.transport}-{index}", prompt_token_ids=prompt,
                                       sampling=sampling_to_pb(GREEDY), cache_salt=self.transport, seed=0)
        start = time.perf_counter()
        res = self.decode.Reserve(worker_pb2.ReserveRequest(request=req, lease_ms=60_000))
        pre = self.prefill.Prefill(worker_pb2.PrefillRequest(request=req, target=res.target))
        first = time.perf_counter()
        for _ in self.decode.Decode(worker_pb2.DecodeRequest(request_id=req.request_id, handle=res.target.handle,
                                                             first_token_id=pre.first_token_id)):
            pass
        if pre.transport != self.transport:
            raise RuntimeError(f"the cluster moved KV over {pre.transport}, expected {self.transport}")
        return {"ttft_ms": (first - start) * 1e3, "prefill_ms": pre.prefill_ms, "transfer_ms": pre.transfer_ms,
                "transfer_bytes": pre.transfer_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--out", default="bench/results/kv_ttft.md")
    args = parser.parse_args()

    model_path = fetch_default_model()
    prompts = make_prompts(model_path, args.prompts, args.prompt_len)
    engine = EngineConfig(model=str(model_path), dtype="float32", kv_cache_memory=KV_MEMORY)
    paths: dict[str, object] = {"offline engine (1 thread)": Offline(model_path)}
    clusters = []
    try:
        for transport in ("shm", "grpc"):
            cluster = LocalCluster(LocalClusterConfig(num_prefill=1, num_decode=1, port=0, http_port=-1,
                                                      transport=transport, num_cpus=2, engine=engine,
                                                      insecure_internal=True))
            cluster.__enter__()
            clusters.append(cluster)
            paths[f"1P+1D {transport}"] = Direct(cluster, transport)
        samples: dict[str, list[dict]] = {name: [] for name in paths}
        names = list(paths)
        for i, prompt in enumerate(prompts):
            for name in names[i % len(names):] + names[:i % len(names)]:
                samples[name].append(paths[name].ttft(prompt, i))
                print(f"prompt {i} {name}: {samples[name][-1]}", file=sys.stderr)
    finally:
        for cluster in clusters:
            cluster.__exit__(None, None, None)

    def med(name: str, key: str) -> float:
        return statistics.median(s[key] for s in samples[name])

    base = med("offline engine (1 thread)", "ttft_ms")
    lines = [f"### TTFT of a {args.prompt_len}-token prompt, one-process engine vs 1P+1D ({datetime.date.today()})",
             "",
             f"- Machine: {cpu_model()}, {os.cpu_count()} logical cores; load average {os.getloadavg()[0]:.2f} at the "
             "end (shared with other jobs: figures are indicative)",
             f"- Command: `python bench/bench_kv_ttft.py --prompts {args.prompts} --prompt-len {args.prompt_len}`; "
             f"median of {args.prompts} prompts, paths interleaved; float32, {NEW_TOKENS} new tokens",
             "",
             "| path | TTFT p50 ms | vs one process | prefill ms (worker) | KV push ms | push % of TTFT | KV MiB | "
             "push GB/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    result = {"machine": cpu_model(), "prompt_len": args.prompt_len, "samples": samples, "ratios": {}}
    for name in paths:
        ttft = med(name, "ttft_ms")
        result["ratios"][name] = ttft / base
        if name.startswith("offline"):
            lines.append(f"| {name} | {ttft:.1f} | 1.00x | | | | | |")
            continue
        push_ms, nbytes = med(name, "transfer_ms"), med(name, "transfer_bytes")
        goal = "met" if ttft / base <= 1.05 else "not met"
        lines.append(f"| {name} | {ttft:.1f} | {ttft / base:.3f}x (goal <= 1.05x: {goal}) | "
                     f"{med(name, 'prefill_ms'):.1f} | {push_ms:.1f} | "
                     f"{statistics.median(x['transfer_ms'] / x['ttft_ms'] for x in samples[name]) * 100:.2f}% | "
                     f"{nbytes / 2**20:.1f} | "
                     f"{nbytes / push_ms / 1e6:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
