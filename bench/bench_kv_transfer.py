"""Benchmark of KV transfer: GB/s of KvSender.push over the shm and grpc transports, next to a memory copy and a
raw socket between the same two processes.

    python bench/bench_kv_transfer.py [--blocks 16 64 256] [--repeats 5] [--threads 1] [--shm-pool-bytes N]
                                      [--paths 'raw socket' grpc ...]

Layout: SmolLM2-135M (30 layers, 3 kv heads of 64, blocks of 16 tokens) in float32, 737,280 bytes per block.
The receiver (a KvTransferServicer over a permissive in-memory receiver) runs in its own process on 127.0.0.1,
as a decode worker would; the sender pushes blocks picked at random from a 320-block cache into random blocks of
the receiver's cache. A push is timed end to end: encode (gather [+ int8 quantize] + digests), shm write or grpc
chunks, the receiver's digest checks and scatter, the reply. Every path runs once per round, rounds interleaved,
so that a loaded machine slows them alike; the median of the rounds is reported. Rows:

    memcpy         torch uint8 .copy_ of the raw payload's bytes: the physical limit of a memory-to-memory move
    raw socket     the payload's bytes over one TCP connection to the receiver process (sendall / recv_into a
                   reused buffer, one-byte answer): what any stream transport between these processes can reach
    grpc floor     the payload as ready-made 2 MiB bytes messages over one grpc stream (KvSender's channel
                   options) to a handler in the receiver process that drops them: Python grpc's own cost, the
                   ceiling of any KV push over it (no gather, hash, scatter or protobuf)
    encode only    the sender's write_records into a reused buffer (kernels gather [+ quantize] + xxh3 digests)
    hash in place  the zero-copy sender's share, alone: xxh3 digests of the blocks where they are in its cache
    copy + hash    the zero-copy receiver's share, alone, in this process: each block copied out of the cache
                   segment's mapping into a receiving cache, hashed as it lands (kvstore.shm_cache.CacheRead)
    block copy     the same blocks copied cache to cache by torch, block by block, nothing hashed: the floor of
                   any one-copy path in the paged layout (each block is 2 x layers pieces, far apart)
    shm zero-copy  KvSender.push of blocks of a cache that lives in shared memory (kvstore.shm_cache, the default
                   of a prefill worker): the receiver copies each block out of the sender's segment into its
                   cache and hashes it as it lands, while the sender hashes the same blocks in place
    zero-copy, prefill digests  the same push given the blocks' digests (taken before the timed rounds), as a
                   prefill worker has them: its steps hash each layer's pieces as they write them
                   (engine.kv_digests), so the push reads the blocks once, the receiver's copy; what that costs
                   the prefill is measured by bench/bench_kv_ttft.py (TTFT against the one-process engine)
    shm            KvSender.push with a segment pool (pre-faulted, reused segments; a cache not in shared memory)
    shm one-shot   KvSender.push with a fresh segment per transfer (a sender without a pool)
    grpc           KvSender.push over grpc: each chunk's message filled straight out of the cache and hashed as it
                   is filled, digests in the trailer; each chunk landed straight in the receiver's destination
                   blocks and hashed as it lands (kvstore.paged_records: one native pass a side)
    grpc, prefill digests  the same push given the blocks' digests, as a prefill worker has them: the sender
                   only copies the blocks into the messages (the receiver still hashes what lands)

"wire GB/s" is payload bytes per second; "KV GB/s" is the raw float32 KV moved per second (what int8 buys).
"CPU ms" and "page faults" are per call, of every thread of the sending (this) and the receiving process
(their CPU-time clocks, /proc/<pid>/stat): what a path costs, much less sensitive than its
wall time to other load on the machine (a path that runs only here, e.g. memcpy, costs the receiver nothing).
Prints a markdown table with issue 16's goals (shm zero-copy and pooled shm / memcpy, grpc raw / raw socket)
and writes it to --out
(default bench/results/kv_transfer.md) with the figures as JSON beside it (.json).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvstore.transfer import KvLayoutSpec, write_records  # noqa: E402
from pdserve.bench.roofline import cpu_model  # noqa: E402

LAYOUT = KvLayoutSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32",
                      model_fingerprint="smollm2-135m-bench")
CACHE_BLOCKS = 320
FLOOR_SERVICE = "pdserve.bench.Discard"
PATHS = ("memcpy", "raw socket", "grpc floor", "encode only", "hash in place", "copy + hash", "block copy",
         "shm zero-copy", "zero-copy, prefill digests", "shm",
         "shm one-shot", "grpc", "grpc, prefill digests")


def cache_shape(num_blocks: int) -> tuple[int, ...]:
    return (LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def serve_raw_socket(listener: socket.socket) -> None:
    """The baseline's receiving end: for each connection, messages of an 8-byte length then that many bytes,
    read into one reused buffer with recv_into, each answered with one byte once it is all in."""
    buffer = bytearray()
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                header = conn.recv(8, socket.MSG_WAITALL)
                if len(header) < 8:
                    break
                (nbytes,) = struct.unpack("<Q", header)
                if len(buffer) < nbytes:
                    buffer = bytearray(nbytes)
                view, received = memoryview(buffer), 0
                while received < nbytes:
                    received += conn.recv_into(view[received:nbytes])
                conn.sendall(b"k")


def serve_receiver(port_queue, stop_event, threads: int, files=None, socket_queue=None) -> None:
    """Child process: a KvTransfer server whose receiver accepts any handle and any in-bounds block ids; with
    `files` (protos.tls.TlsFiles) it serves mutual TLS behind the cluster's role table, as a decode worker does.
    With `socket_queue`, also the raw-socket baseline (serve_raw_socket) on a port put there."""
    import grpc

    if socket_queue is not None:
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=serve_raw_socket, args=(listener,), daemon=True).start()
        socket_queue.put(listener.getsockname()[1])

    from kvstore.transfer_service import GRPC_OPTIONS, KvTransferServicer, ReceiveTarget, add_kv_transfer_servicer
    from protos import tls

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
    add_kv_transfer_servicer(KvTransferServicer(AnyReservation()), server)

    def discard(messages, context):  # the "grpc floor" row: grpc alone, the bytes objects dropped on arrival
        return struct.pack("<Q", sum(len(m) for m in messages))

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        FLOOR_SERVICE, {"Push": grpc.stream_unary_rpc_method_handler(discard)})])
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


class RawSocketSender:
    """The baseline's sending end: the payload's bytes over one TCP connection (sendall of the buffer, no
    framing, no copy in Python), timed until the receiver's one-byte answer."""

    def __init__(self, port: int) -> None:
        self.conn = socket.create_connection(("127.0.0.1", port))
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, payload: memoryview) -> None:
        self.conn.sendall(struct.pack("<Q", len(payload)))
        self.conn.sendall(payload)
        if self.conn.recv(1) != b"k":
            raise RuntimeError("raw-socket receiver went away")

    def close(self) -> None:
        self.conn.close()


def memcpy_ms(num_bytes: int, repeats: int) -> float:
    src, dst = torch.ones(num_bytes, dtype=torch.uint8), torch.empty(num_bytes, dtype=torch.uint8)
    return median_ms(lambda: dst.copy_(src), repeats)


def machine() -> str:
    return (f"{cpu_model()}, {os.cpu_count()} logical cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def process_cost(pid: int) -> tuple[float, int]:
    """(CPU ms so far of every thread the process ever ran, from its CPU-time clock; minor page faults so far,
    from /proc/<pid>/stat): what a call costs each process whatever else loads the machine (Linux only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    clock_id, spec = ctypes.c_int(), (ctypes.c_long * 2)()
    if libc.clock_getcpuclockid(pid, ctypes.byref(clock_id)) or libc.clock_gettime(clock_id, spec):
        raise OSError(ctypes.get_errno(), f"no CPU-time clock for process {pid}")
    minflt = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
    return spec[0] * 1e3 + spec[1] / 1e6, minflt


def interleaved_ms(paths: dict, repeats: int, pids: tuple[int, int] | None = None) -> dict:
    """Median ms of each callable, run round-robin (one of each per round) so that load on a shared machine
    hits every path alike; one warm-up round first (channels, allocators, segment pool, page faults). With
    `pids` (sender, receiver), also each path's mean CPU ms and page faults per call in both processes:
    {name: (ms, (sender cpu ms, sender faults, receiver cpu ms, receiver faults))}."""
    samples = {name: [] for name in paths}
    costs = {name: [0.0, 0, 0.0, 0] for name in paths}
    for round_index in range(repeats + 1):
        for name, fn in paths.items():
            before = [v for pid in pids for v in process_cost(pid)] if pids else None
            start = time.perf_counter()
            fn()
            if round_index:
                samples[name].append(time.perf_counter() - start)
                if pids:
                    after = [v for pid in pids for v in process_cost(pid)]
                    costs[name] = [c + a - b for c, a, b in zip(costs[name], after, before, strict=True)]
    if not pids:
        return {name: statistics.median(times) * 1e3 for name, times in samples.items()}
    return {name: (statistics.median(times) * 1e3, tuple(c / repeats for c in costs[name]))
            for name, times in samples.items()}


def run(args: argparse.Namespace) -> list[dict]:
    import grpc

    from kvstore.kv_sender import KvSender
    from kvstore.shm_cache import SharedKvCache, block_digests_in_place, open_cache
    from kvstore.shm_pool import PooledSegmentReader
    from kvstore.transfer_manifest import DEFAULT_CHUNK_BYTES, TransferManifest
    from kvstore.transfer_service import GRPC_OPTIONS

    ctx = mp.get_context("spawn")
    port_queue, socket_queue, stop_event = ctx.Queue(), ctx.Queue(), ctx.Event()
    child = ctx.Process(target=serve_receiver, args=(port_queue, stop_event, args.threads, None, socket_queue),
                        daemon=True)
    child.start()
    endpoint = f"127.0.0.1:{port_queue.get(timeout=120)}"
    raw_socket = RawSocketSender(socket_queue.get(timeout=120))
    pids = (os.getpid(), child.pid)
    floor_channel = grpc.insecure_channel(endpoint, options=GRPC_OPTIONS)
    floor = floor_channel.stream_unary(f"/{FLOOR_SERVICE}/Push")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shared = SharedKvCache(cache_shape(CACHE_BLOCKS), torch.float32)  # the sender's cache, in shared memory
    src = shared.tensor  # [L, 2, CACHE_BLOCKS, block_size, Hkv, D]
    src.copy_(torch.randn(cache_shape(CACHE_BLOCKS), generator=gen))
    receiving = torch.zeros(cache_shape(CACHE_BLOCKS))  # copy + hash: a receiving cache in this process
    reader = PooledSegmentReader()
    rows = []
    try:
        with (KvSender(shm_pool_bytes=args.shm_pool_bytes) as sender, KvSender() as one_shot,
              KvSender(shared_cache=shared) as zero_copy):
            for num_blocks in args.blocks:
                src_ids = torch.randperm(CACHE_BLOCKS, generator=gen)[:num_blocks].tolist()
                dst_ids = torch.randperm(CACHE_BLOCKS, generator=gen)[:num_blocks].tolist()
                raw_bytes = num_blocks * LAYOUT.block_bytes("raw")
                copy_src = torch.ones(raw_bytes, dtype=torch.uint8)
                copy_dst = torch.empty(raw_bytes, dtype=torch.uint8)
                socket_payload = memoryview(copy_src.numpy())
                floor_messages = [bytes(copy_src[i:i + DEFAULT_CHUNK_BYTES].numpy())
                                  for i in range(0, raw_bytes, DEFAULT_CHUNK_BYTES)]
                paths = {("memcpy", "raw"): functools.partial(copy_dst.copy_, copy_src),
                         ("raw socket", "raw"): functools.partial(raw_socket.send, socket_payload),
                         ("grpc floor", "raw"): lambda messages=floor_messages: floor(iter(messages), timeout=600.0)}
                for codec in ("raw", "int8"):
                    out = torch.empty(num_blocks * LAYOUT.block_bytes(codec), dtype=torch.uint8)
                    paths[("encode only", codec)] = functools.partial(write_records, src, src_ids, codec, out)
                paths[("hash in place", "raw")] = functools.partial(block_digests_in_place, src, src_ids)
                manifest = TransferManifest("bench", "bench", LAYOUT, tuple(dst_ids), (), "raw", "shm", "", raw_bytes,
                                            digests_in_trailer=True, cache_segment=shared.name,
                                            src_block_ids=tuple(src_ids), cache_num_blocks=CACHE_BLOCKS,
                                            sender_epoch=shared.epoch)

                def copy_and_hash(manifest=manifest, dst_ids=dst_ids):
                    with open_cache(reader, manifest, LAYOUT) as read:
                        read.copy_into(receiving, dst_ids)

                paths[("copy + hash", "raw")] = copy_and_hash

                def block_copy(src_ids=src_ids, dst_ids=dst_ids):
                    for s, d in zip(src_ids, dst_ids):
                        receiving[:, :, d].copy_(src[:, :, s])  # [L, 2, block_size, Hkv, D]

                paths[("block copy", "raw")] = block_copy
                # What a prefill worker sends: the digests its steps took as they wrote the blocks (engine.kv_digests);
                # each such path runs right after its twin that hashes at push time
                prefill_digests = block_digests_in_place(src, src_ids)
                given = {"shm zero-copy": "zero-copy, prefill digests", "grpc": "grpc, prefill digests"}
                for codec in ("raw", "int8"):
                    senders = (("shm zero-copy", zero_copy, "shm"),) if codec == "raw" else ()
                    for path, who, transport in (*senders, ("shm", sender, "shm"), ("shm one-shot", one_shot, "shm"),
                                                 ("grpc", sender, "grpc")):
                        paths[(path, codec)] = functools.partial(
                            who.push, endpoint, request_id="bench", handle="bench", layout=LAYOUT, kv_cache=src,
                            src_block_ids=src_ids, dst_block_ids=dst_ids, transport=transport, codec=codec,
                            timeout_s=600.0)
                        if codec == "raw" and path in given:
                            paths[(given[path], codec)] = functools.partial(paths[(path, codec)],
                                                                            block_digests=prefill_digests)
                if args.paths:
                    paths = {key: fn for key, fn in paths.items() if key[0] in args.paths}
                for (path, codec), (ms, cost) in interleaved_ms(paths, args.repeats, pids).items():
                    rows.append(dict(blocks=num_blocks, path=path, codec=codec,
                                     wire=num_blocks * LAYOUT.block_bytes(codec), ms=ms,
                                     sender_cpu_ms=cost[0], sender_faults=cost[1], receiver_cpu_ms=cost[2],
                                     receiver_faults=cost[3]))
                    print(f"{num_blocks:4d} blocks {path:12s} {codec:4s} {ms:9.1f} ms  cpu ms sender {cost[0]:7.1f} "
                          f"receiver {cost[2]:7.1f}  faults {cost[1]:7.0f} / {cost[3]:7.0f}", file=sys.stderr)
    finally:
        reader.close()
        shared.close()
        raw_socket.close()
        floor_channel.close()
        stop_event.set()
        child.join(timeout=30)
    return rows


def goals(rows: list[dict]) -> list[dict]:
    """Issue 16's KV goals per block count, each judged on the path a prefill worker takes (the push given the
    digests its steps took; hashing at push time when --paths left that out): shm raw >= 0.5x memcpy (64+
    blocks; zero copy on the same host), grpc raw >= 0.8x raw socket."""
    by = {(r["blocks"], r["path"], r["codec"]): r["ms"] for r in rows}

    def ratio(blocks, baseline, path):  # None when --paths left either out
        a, b = by.get((blocks, baseline, "raw")), by.get((blocks, path, "raw"))
        return None if a is None or b is None else a / b

    out = []
    for blocks in sorted({r["blocks"] for r in rows}):
        hashing = ratio(blocks, "memcpy", "shm zero-copy")
        zero_copy = ratio(blocks, "memcpy", "zero-copy, prefill digests") or hashing
        grpc_hashing = ratio(blocks, "raw socket", "grpc")
        grpc_ratio = ratio(blocks, "raw socket", "grpc, prefill digests") or grpc_hashing
        out.append(dict(blocks=blocks, shm_vs_memcpy=zero_copy, zero_copy_hashing_vs_memcpy=hashing,
                        shm_goal_met=zero_copy >= 0.5 if blocks >= 64 and zero_copy is not None else None,
                        shm_pooled_vs_memcpy=ratio(blocks, "memcpy", "shm"), grpc_vs_raw_socket=grpc_ratio,
                        grpc_hashing_vs_raw_socket=grpc_hashing,
                        grpc_goal_met=None if grpc_ratio is None else grpc_ratio >= 0.8))
    return out


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
        f"bytes per block raw, {LAYOUT.block_bytes('int8'):,} int8; median of {args.repeats} interleaved rounds "
        "after a warm-up round",
        "",
        ("| blocks | path | codec | wire MB | ms | wire GB/s | KV GB/s | vs memcpy | vs raw socket | "
         "CPU ms sender / receiver | page faults sender / receiver |"),
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    memcpy_ms = {r["blocks"]: r["ms"] for r in rows if r["path"] == "memcpy"}
    socket_ms = {r["blocks"]: r["ms"] for r in rows if r["path"] == "raw socket"}

    def vs(baseline, r):
        return f"{baseline[r['blocks']] / r['ms']:.2f}x" if r["blocks"] in baseline else "-"

    for r in rows:
        kv_bytes = r["blocks"] * LAYOUT.block_bytes("raw")
        seconds = r["ms"] / 1e3
        lines.append(f"| {r['blocks']} | {r['path']} | {r['codec']} | {r['wire'] / 1e6:.1f} | {r['ms']:.1f} | "
                     f"{r['wire'] / seconds / 1e9:.2f} | {kv_bytes / seconds / 1e9:.2f} | "
                     f"{vs(memcpy_ms, r)} | {vs(socket_ms, r)} | "
                     f"{r['sender_cpu_ms']:.1f} / {r['receiver_cpu_ms']:.1f} | "
                     f"{r['sender_faults']:.0f} / {r['receiver_faults']:.0f} |")
    lines += ["", "| blocks | shm zero-copy raw, prefill digests / memcpy (goal >= 0.5, 64+ blocks) | "
              "zero-copy hashing at push / memcpy | pooled shm raw / memcpy | grpc raw, prefill digests / raw socket "
              "(goal >= 0.8) | grpc hashing at push / raw socket |",
              "|---:|---:|---:|---:|---:|---:|"]
    def cell(value, met=None):
        return "-" if value is None else f"{value:.2f}x" + ("" if met is None else " met" if met else " not met")

    for g in goals(rows):
        lines.append(f"| {g['blocks']} | {cell(g['shm_vs_memcpy'], g['shm_goal_met'])} | "
                     f"{cell(g['zero_copy_hashing_vs_memcpy'])} | {cell(g['shm_pooled_vs_memcpy'])} | "
                     f"{cell(g['grpc_vs_raw_socket'], g['grpc_goal_met'])} | {cell(g['grpc_hashing_vs_raw_socket'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each process")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=None,
                        help="run only these rows (default: all), e.g. --paths 'raw socket' grpc")
    parser.add_argument("--shm-pool-bytes", type=int, default=1 << 30,
                        help="the sender's shared-memory segment pool (0: a fresh segment per transfer)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "kv_transfer.md"))
    args = parser.parse_args()
    if max(args.blocks) > CACHE_BLOCKS:
        parser.error(f"--blocks at most {CACHE_BLOCKS}")
    command = "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]])
    rows = run(args)
    text = report(rows, args, command)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(dict(machine=machine(), command=command, rows=rows,
                                                        goals=goals(rows)), indent=1))


if __name__ == "__main__":
    main()
