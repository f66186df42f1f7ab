"""Benchmark of KV transfer: GB/s of KvSender.push over the shm and grpc transports, next to a memory copy.

    python bench/bench_kv_transfer.py [--blocks 16 64 256] [--repeats 5] [--threads 1]

Layout: SmolLM2-135M (30 layers, 3 kv heads of 64, blocks of 16 tokens) in float32, 737,280 bytes per block.
The receiver (a KvTransferServicer over a permissive in-memory receiver) runs in its own process on 127.0.0.1,
as a decode worker would; the sender pushes blocks picked at random from a 320-block cache into random blocks of
the receiver's cache. A push is timed end to end: encode (gather [+ int8 quantize] + digests), shm write or grpc
chunks, the receiver's digest checks and scatter, the reply. Rows:

    memcpy         torch uint8 .copy_ of the raw payload's bytes: the physical limit of a memory-to-memory move
    encode only    the sender's encode_stream, one group (kernels gather [+ quantize] + xxh3 digests), no transport
    shm / grpc     KvSender.push, raw and int8

"wire GB/s" is payload bytes per second; "KV GB/s" is the raw float32 KV moved per second (what int8 buys).
Prints a markdown table and writes it to --out (default bench/results/kv_transfer.md).
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvstore.transfer import KvLayoutSpec, encode_stream  # noqa: E402

LAYOUT = KvLayoutSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32",
                      model_fingerprint="smollm2-135m-bench")
CACHE_BLOCKS = 320


def cache_shape(num_blocks: int) -> tuple[int, ...]:
    return (LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def serve_receiver(port_queue, stop_event, threads: int, files=None) -> None:
    """Child process: a KvTransfer server whose receiver accepts any handle and any in-bounds block ids; with
    `files` (protos.tls.TlsFiles) it serves mutual TLS behind the cluster's role table, as a decode worker does."""
    import grpc

    from kvstore.transfer_service import GRPC_OPTIONS, KvTransferServicer, ReceiveTarget
    from protos import tls
    from protos.pdserve.v1 import kv_transfer_pb2_grpc

    torch.set_num_threads(threads)
    kv_cache = torch.zeros(cache_shape(CACHE_BLOCKS))  # [L, 2, num_blocks, block_size, Hkv, D]

    class AnyReservation:
        def check(self, manifest):
            return ReceiveTarget(LAYOUT, manifest.block_ids, kv_cache)

        def commit(self, request_id, handle, blocks):
            pass

        def reject(self, request_id, handle, reason):
            print(f"receiver rejected {request_id}: {reason}", file=sys.stderr)

    interceptors = [tls.RoleInterceptor(tls.cluster_role_table())] if files is not None else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS, interceptors=interceptors)
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(KvTransferServicer(AnyReservation()), server)
    address = "127.0.0.1:0"
    port_queue.put(server.add_secure_port(address, tls.server_credentials(files)) if files is not None
                   else server.add_insecure_port(address))
    server.start()
    stop_event.wait()
    server.stop(None)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: channel, allocator, page faults
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def memcpy_ms(num_bytes: int, repeats: int) -> float:
    src, dst = torch.ones(num_bytes, dtype=torch.uint8), torch.empty(num_bytes, dtype=torch.uint8)
    return median_ms(lambda: dst.copy_(src), repeats)


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} logical cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def run(args: argparse.Namespace) -> list[dict]:
    from kvstore.transfer_service import KvSender

    ctx = mp.get_context("spawn")
    port_queue, stop_event = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=serve_receiver, args=(port_queue, stop_event, args.threads), daemon=True)
    child.start()
    endpoint = f"127.0.0.1:{port_queue.get(timeout=120)}"
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(cache_shape(CACHE_BLOCKS), generator=gen)
    rows = []
    try:
        with KvSender() as sender:
            for num_blocks in args.blocks:
                src_ids = torch.randperm(CACHE_BLOCKS, generator=gen)[:num_blocks].tolist()
                dst_ids = torch.randperm(CACHE_BLOCKS, generator=gen)[:num_blocks].tolist()
                raw_bytes = num_blocks * LAYOUT.block_bytes("raw")
                rows.append(dict(blocks=num_blocks, path="memcpy", codec="raw", wire=raw_bytes,
                                 ms=memcpy_ms(raw_bytes, args.repeats)))
                for codec in ("raw", "int8"):
                    rows.append(dict(blocks=num_blocks, path="encode only", codec=codec,
                                     wire=num_blocks * LAYOUT.block_bytes(codec),
                                     ms=median_ms(lambda: list(encode_stream(src, src_ids, codec, len(src_ids)).groups),
                                                    args.repeats)))
                for codec in ("raw", "int8"):
                    for transport in ("shm", "grpc"):
                        def push():
                            return sender.push(endpoint, request_id="bench", handle="bench", layout=LAYOUT,
                                               kv_cache=src, src_block_ids=src_ids, dst_block_ids=dst_ids,
                                               transport=transport, codec=codec, timeout_s=600.0)
                        rows.append(dict(blocks=num_blocks, path=transport, codec=codec,
                                         wire=num_blocks * LAYOUT.block_bytes(codec),
                                         ms=median_ms(push, args.repeats)))
                        print(f"{num_blocks:4d} blocks {transport:4s} {codec:4s} {rows[-1]['ms']:9.1f} ms",
                              file=sys.stderr)
    finally:
        stop_event.set()
        child.join(timeout=30)
    return rows


def report(rows: list[dict], args: argparse.Namespace, command: str) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "## KV transfer",
        "",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Machine: {machine()}; load average {load:.2f} at the end (shared with other jobs: figures are indicative)",
        f"- torch {torch.__version__} (CPU, torch reference kernels), {args.threads} intra-op thread(s) per process; "
        "sender and receiver in separate processes on 127.0.0.1",
        f"- Command: `{command}`",
        f"- Layout: SmolLM2-135M, 30 layers x 3 kv heads x 64, block 16, float32: {LAYOUT.block_bytes('raw'):,} "
        f"bytes per block raw, {LAYOUT.block_bytes('int8'):,} int8; median of {args.repeats} after a warm-up",
        "",
        "| blocks | path | codec | wire MB | ms | wire GB/s | KV GB/s | vs memcpy |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    memcpy_ms = {r["blocks"]: r["ms"] for r in rows if r["path"] == "memcpy"}
    for r in rows:
        kv_bytes = r["blocks"] * LAYOUT.block_bytes("raw")
        seconds = r["ms"] / 1e3
        lines.append(f"| {r['blocks']} | {r['path']} | {r['codec']} | {r['wire'] / 1e6:.1f} | {r['ms']:.1f} | "
                     f"{r['wire'] / seconds / 1e9:.2f} | {kv_bytes / seconds / 1e9:.2f} | "
                     f"{memcpy_ms[r['blocks']] / r['ms']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each process")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "kv_transfer.md"))
    args = parser.parse_args()
    if max(args.blocks) > CACHE_BLOCKS:
        parser.error(f"--blocks at most {CACHE_BLOCKS}")
    command = "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]])
    text = report(run(args), args, command)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
