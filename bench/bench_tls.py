"""Benchmark of what TLS costs: request latency through a real cluster, and gRPC KV transfer GB/s, each with TLS
and in plaintext, in one run.

    python bench/bench_tls.py [--requests 20] [--max-tokens 8] [--blocks 16 64 256] [--repeats 5]

Latency: a real redis-server and two clusters side by side, each one prefill and one decode worker process (the
default model, 1 thread each) behind an in-process gateway: one plaintext everywhere (--insecure-internal, no
key), one secured the way a deployment runs it (public TLS on the gateway's gRPC port, an API key, mutual TLS
from the gateway to the workers and from the prefill worker to the decode worker). Short prompts alternate
between them (idle workers cost nothing, so a change in the machine's load hits both alike), one request at a
time, over gRPC with pdserve.client (greedy; one channel per mode, so each pays its handshakes once). TTFT is
the first chunk's arrival at the client, E2E the last one's; each mode's first request (which connects every
channel) is reported separately and left out of the medians. Every prompt is distinct: no prefix hits.

KV transfer: KvSender.push over the grpc transport (raw codec) to a KvTransfer server in another process on
127.0.0.1, plaintext vs mutual TLS (a prefill certificate pushing to a decode one), SmolLM2-135M's layout.

Prints a table naming the CPU and writes JSON to --out (default bench/results/tls.json). Figures, not a test.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_kv_transfer import CACHE_BLOCKS, LAYOUT, cache_shape, median_ms, serve_receiver  # noqa: E402
from protos import tls  # noqa: E402
from pdserve.bench.roofline import cpu_model  # noqa: E402

API_KEY = "bench-key-0123456789abcdef"
START_TIMEOUT_S = 300.0


# ------------------------------------------------------------------------------------------------ KV transfer
def bench_transfer(args: argparse.Namespace, pki: dict[str, tls.TlsFiles]) -> list[dict]:
    import torch

    from kvstore.kv_sender import KvSender

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(cache_shape(CACHE_BLOCKS), generator=gen)
    rows = []
    ctx = mp.get_context("spawn")
    for mode, receiver_files, sender_files in (("plaintext", None, None), ("mTLS", pki["d0"], pki["p0"])):
        port_queue, stop_event = ctx.Queue(), ctx.Event()
        child = ctx.Process(target=serve_receiver, args=(port_queue, stop_event, 1, receiver_files), daemon=True)
        child.start()
        endpoint = f"127.0.0.1:{port_queue.get(timeout=120)}"
        try:
            with KvSender(tls=sender_files) as sender:
                for num_blocks in args.blocks:
                    src_ids = torch.randperm(CACHE_BLOCKS, generator=gen)[:num_blocks].tolist()
                    dst_ids = torch.randperm(CACHE_BLOCKS, generator=gen)[:num_blocks].tolist()

                    def push():
                        return sender.push(endpoint, request_id="bench", handle="bench", layout=LAYOUT,
                                           kv_cache=src, src_block_ids=src_ids, dst_block_ids=dst_ids,
                                           transport="grpc", codec="raw", timeout_s=600.0)

                    ms = median_ms(push, args.repeats)
                    num_bytes = num_blocks * LAYOUT.block_bytes("raw")
                    rows.append(dict(mode=mode, blocks=num_blocks, bytes=num_bytes, ms=ms,
                                     gb_per_s=num_bytes / (ms / 1e3) / 1e9))
                    print(f"transfer {mode:9s} {num_blocks:4d} blocks {ms:9.1f} ms", file=sys.stderr)
        finally:
            stop_event.set()
            child.join(timeout=30)
    return rows


# ------------------------------------------------------------------------------------------------ latency
@contextlib.contextmanager
def cluster(model: str, redis_url: str, pki: dict[str, tls.TlsFiles] | None, run_dir: Path):
    """A prefill and a decode worker (processes) and an in-process gateway; yields (gateway handle, client
    keyword arguments)."""
    from gateway.config import GatewayConfig
    from gateway.server import start_server
    from kvstore.index import PrefixIndex

    suffix = "tls" if pki else "plain"
    procs = []
    index = PrefixIndex(redis_url)
    try:
        for role in ("prefill", "decode"):
            worker_id = f"{role[0]}-{suffix}"
            security = ["--insecure-internal"] if pki is None else [
                "--cluster-ca", str(pki[role[0] + "0"].ca_path), "--cluster-cert", str(pki[role[0] + "0"].cert_path),
                "--cluster-key", str(pki[role[0] + "0"].key_path)]
            log = open(run_dir / f"{worker_id}.log", "wb")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pdserve", f"{role}-worker", "--worker-id", worker_id, "--host", "127.0.0.1",
                 "--port", "0", "--redis-url", redis_url, "--model", model, "--kv-cache-memory", "128M",
                 "--threads", "1", *security], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + START_TIMEOUT_S
        wanted = {f"p-{suffix}", f"d-{suffix}"}
        while not wanted <= {w.worker_id for w in index.list_workers() or []}:
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise RuntimeError(f"workers did not start; see {run_dir}")
            time.sleep(0.2)
        kwargs = dict(model=model, redis_url=redis_url, port=0, http_port=-1, local_prefill_threshold=0)
        client_kwargs = {}
        if pki is not None:
            key_file = run_dir / "keys"
            key_file.write_text(f"{API_KEY} bench\n")
            g, public = pki["gateway"], pki["public"]
            kwargs.update(api_key_file=str(key_file), tls_cert=str(public.cert_path), tls_key=str(public.key_path),
                          cluster_ca=str(g.ca_path), cluster_cert=str(g.cert_path), cluster_key=str(g.key_path))
            client_kwargs = dict(api_key=API_KEY, ca_cert=str(public.ca_path))
        handle = start_server(GatewayConfig(**kwargs))
        try:
            yield handle, client_kwargs
        finally:
            handle.stop(5.0)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        index.close()


def bench_latency(args: argparse.Namespace, pki: dict[str, tls.TlsFiles], run_dir: Path) -> list[dict]:
    from engine.model_fetch import resolve_model_path
    from kvstore.embedded_redis import EmbeddedRedis
    from pdserve.client import Client

    model = str(resolve_model_path(args.model, progress=False))
    modes = (("plaintext", None), ("TLS + mTLS + key", pki))
    with EmbeddedRedis() as redis, contextlib.ExitStack() as stack:
        clients = {}
        for mode, mode_pki in modes:
            handle, client_kwargs = stack.enter_context(cluster(model, redis.url, mode_pki, run_dir))
            clients[mode] = stack.enter_context(Client(f"127.0.0.1:{handle.port}", timeout=300, **client_kwargs))
        samples = {mode: {"ttft": [], "e2e": []} for mode, _ in modes}
        first = {}
        for i in range(args.requests + 1):
            for mode, _ in modes if i % 2 == 0 else reversed(modes):
                prompt = f"Request {i} of the {mode} run: name a colour and a fruit."
                start = time.perf_counter()
                first_at = None
                with clients[mode].generate(prompt, max_tokens=args.max_tokens, temperature=0,
                                            ignore_eos=True) as stream:
                    for chunk in stream:
                        if first_at is None and chunk.token_ids:
                            first_at = time.perf_counter()
                end = time.perf_counter()
                if i == 0:
                    first[mode] = dict(ttft_ms=(first_at - start) * 1e3, e2e_ms=(end - start) * 1e3)
                else:
                    samples[mode]["ttft"].append((first_at - start) * 1e3)
                    samples[mode]["e2e"].append((end - start) * 1e3)
    rows = []
    for mode, _ in modes:
        ttft, e2e = samples[mode]["ttft"], samples[mode]["e2e"]
        rows.append(dict(mode=mode, requests=args.requests, max_tokens=args.max_tokens,
                         ttft_p50_ms=statistics.median(ttft), ttft_p90_ms=_quantile(ttft, 0.9),
                         e2e_p50_ms=statistics.median(e2e), e2e_p90_ms=_quantile(e2e, 0.9),
                         first_request=first[mode]))
        print(f"latency {mode}: {rows[-1]}", file=sys.stderr)
    return rows


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1] if len(values) > 1 else values[0]


# ------------------------------------------------------------------------------------------------ report
def table(latency: list[dict], transfer: list[dict], cpu: str) -> str:
    lines = [f"TLS cost on {cpu} ({os.cpu_count()} logical cores), {datetime.date.today().isoformat()}", "",
             "| requests (gRPC, sequential) | TTFT p50 ms | TTFT p90 ms | E2E p50 ms | E2E p90 ms | first TTFT ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in latency:
        lines.append(f"| {r['mode']}, {r['requests']} x {r['max_tokens']} tokens | {r['ttft_p50_ms']:.1f} | "
                     f"{r['ttft_p90_ms']:.1f} | {r['e2e_p50_ms']:.1f} | {r['e2e_p90_ms']:.1f} | "
                     f"{r['first_request']['ttft_ms']:.1f} |")
    lines += ["", "| KV push (grpc, raw) | blocks | MB | ms | GB/s |", "|---|---:|---:|---:|---:|"]
    for r in transfer:
        lines.append(f"| {r['mode']} | {r['blocks']} | {r['bytes'] / 1e6:.1f} | {r['ms']:.1f} | {r['gb_per_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=20, help="timed requests per mode (after one warm-up)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tls.json")
    args = parser.parse_args()
    if max(args.blocks) > CACHE_BLOCKS:
        parser.error(f"--blocks at most {CACHE_BLOCKS}")
    cpu = cpu_model()
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-tls-") as tmp:
        pki = tls.write_cluster_pki(Path(tmp) / "pki", [("prefill", "p0"), ("decode", "d0"), ("gateway", "gateway"),
                                                        ("gateway", "public")])
        transfer = bench_transfer(args, pki)
        latency = [] if args.skip_latency else bench_latency(args, pki, Path(tmp))
    text = table(latency, transfer, cpu)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), cpu=cpu,
                                        logical_cores=os.cpu_count(), load_average=os.getloadavg()[0],
                                        command=" ".join(["python", *sys.argv]), latency=latency,
                                        kv_transfer=transfer), indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
