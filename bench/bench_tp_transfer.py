"""KV transfer between tensor-parallel degrees with the default model: prefill TP=p -> decode TP=d clusters answer
like 1P+1D at TP=1, and what the re-sharding costs.

    python bench/bench_tp_transfer.py [--pairs 1x1,2x1,1x2,2x2] [--transports shm,grpc] [--prompts 4]
                                      [--prompt-len 256] [--out bench/results/tp_transfer.json]

For each transport and each pair p x d it starts a local cluster (`pdserve.launcher.LocalCluster`: one prefill
worker at TP=p, one decode worker at TP=d, the machine's CPUs divided among the ranks), then sends the same
greedy prompts, one at a time, straight to the workers (Reserve on D, Prefill on P pushing to it, Decode), each
with its own cache salt so every push is cold. It records per pair the tokens (which must equal the 1x1 run's:
the script exits 1 otherwise), the prefill worker's reported transfer bytes and milliseconds (median), and the
plan's reshard bytes and slices (PrefillResponse). It prints a table and saves JSON, naming the CPU.

What the numbers mean: every KV head crosses the wire once whatever the degrees, so transfer bytes are the same
for every pair; a TP sender's rank 0 first receives the other ranks' slices and a TP receiver's rank 0 sends
each rank its heads (gloo over loopback on CPU), which adds to transfer_ms. On a shared CPU that overhead is the
whole difference; on GPUs the same plan moves between devices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import grpc

from engine.config import EngineConfig
from engine.model_fetch import fetch_default_model
from engine.sampling_params import SamplingParams
from pdserve.bench.roofline import cpu_model
from pdserve.launcher import LocalCluster, LocalClusterConfig
from protos.convert import sampling_to_pb
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def run_pair(model_path: Path, p: int, d: int, transport: str, prompts: list[list[int]]) -> dict:
    config = LocalClusterConfig(
        num_prefill=1, num_decode=1, port=0, http_port=-1, transport=transport, num_cpus=2, insecure_internal=True,
        engine=EngineConfig(model=str(model_path), dtype="float32", kv_cache_memory=64 * 2**20),
        prefill_tensor_parallel_size=p, decode_tensor_parallel_size=d)
    tokens, responses = [], []
    with LocalCluster(config) as cluster:
        workers = cluster.workers
        with grpc.insecure_channel(next(e for w, e in workers.items() if w.startswith("prefill"))) as pc, \
                grpc.insecure_channel(next(e for w, e in workers.items() if w.startswith("decode"))) as dc:
            prefill, decode = worker_pb2_grpc.PrefillWorkerStub(pc), worker_pb2_grpc.DecodeWorkerStub(dc)
            for i, prompt in enumerate(prompts):
                req = worker_pb2.WorkerRequest(request_id=f"tp-{p}x{d}-{transport}-{i}", prompt_token_ids=prompt,
                                               sampling=sampling_to_pb(GREEDY), cache_salt=f"{p}x{d}-{i}", seed=0)
                res = decode.Reserve(worker_pb2.ReserveRequest(request=req, lease_ms=60_000), timeout=120)
                pre = prefill.Prefill(worker_pb2.PrefillRequest(request=req, target=res.target), timeout=600)
                out = [pre.first_token_id]
                for msg in decode.Decode(worker_pb2.DecodeRequest(request_id=req.request_id,
                                                                  handle=res.target.handle,
                                                                  first_token_id=pre.first_token_id), timeout=600):
                    out.extend(msg.token_ids)
                tokens.append(out)
                responses.append(pre)
    return {"pair": f"{p}x{d}", "transport": transport, "tokens": tokens,
            "transfer_bytes": statistics.median(r.transfer_bytes for r in responses),
            "transfer_ms": statistics.median(r.transfer_ms for r in responses),
            "reshard_bytes": statistics.median(r.reshard_bytes for r in responses),
            "reshard_slices": responses[0].reshard_slices}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="1x1,2x1,1x2,2x2")
    parser.add_argument("--transports", default="shm,grpc")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--out", default="bench/results/tp_transfer.json")
    args = parser.parse_args()

    model_path = fetch_default_model()
    prompts = [[(i * 7919 + j * 104729) % 48000 + 500 for j in range(args.prompt_len)] for i in range(args.prompts)]
    pairs = [tuple(int(x) for x in pair.split("x")) for pair in args.pairs.split(",")]
    if pairs[0] != (1, 1):
        pairs.insert(0, (1, 1))  # the reference
    rows = [run_pair(model_path, p, d, transport, prompts)
            for transport in args.transports.split(",") for p, d in pairs]
    reference = rows[0]["tokens"]
    print(f"KV transfer between tensor-parallel degrees, default model, {args.prompts} prompts of "
          f"{args.prompt_len} tokens, {cpu_model()} (a shared, loaded machine: ms are noisy)")
    print("| pair p x d | transport | same tokens as 1x1 | transfer MiB | transfer ms | reshard MiB | slices |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        r["same_as_1x1"] = r["tokens"] == reference
        print(f"| {r['pair']} | {r['transport']} | {r['same_as_1x1']} | {r['transfer_bytes'] / 2**20:.2f} | "
              f"{r['transfer_ms']:.1f} | {r['reshard_bytes'] / 2**20:.2f} | {r['reshard_slices']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu_model(), "prompts": args.prompts,
                                          "prompt_len": args.prompt_len, "rows": rows}, indent=1))
    if not all(r["same_as_1x1"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
