"""Random cancels against a live cluster, then a leak check of every worker's KV blocks.

    python bench/soak_cancels.py [--count 1000] [--concurrency 16] [--seed 0] [--transport grpc] [--json PATH]
    python bench/soak_cancels.py --target HOST:PORT --http-url URL --worker decode=HOST:PORT [--worker prefill=...]

Without --target it starts its own cluster (LocalCluster: a real redis-server, 1 prefill + 1 decode worker with
the default model, the gateway with local prefill off, so every request goes through a KV transfer). Each request
goes over gRPC or HTTP (half each) and is cancelled at a random moment, in one of three phases:

    before-first-token  a random delay within the calibrated time to first token (Reserve, queue, prefill)
    kv-transfer         a delay inside the calibrated KV transfer window (prefill done, first token not yet out)
    mid-stream          after 1..10 streamed tokens

A gRPC cancel is `call.cancel()`; an HTTP cancel closes the connection mid-response. The phase a cancel landed in
is what the client saw: a cancel aimed before the first token that arrives after it counts as mid-stream. The
windows come from a calibration of uncancelled requests (the gateway's timings: queue, prefill, transfer, TTFT).

Then every worker is polled (Stats RPC, bounded) until idle, and the figures are printed: cancels per phase and
API, answers that were not a cancel (by status), leaked blocks per worker (expected 0), requests/s. Exit code 1 when a
worker still holds a block, a sequence or a reservation, or an answer was a server error (5xx, UNKNOWN, INTERNAL).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import grpc

from engine.config import EngineConfig
from pdserve.launcher import LocalCluster, LocalClusterConfig
from protos.tls import TlsFiles, channel_credentials, channel_options
from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

PHASES = ("before-first-token", "kv-transfer", "mid-stream")
APIS = ("grpc", "http")
PROMPT_WORDS = ("the quick brown fox jumps over the lazy dog while a careful assistant explains mutexes, caches "
                "and the capital of France to a curious reader ").split()
MAX_TOKENS = 48
RPC_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 60.0
SERVER_ERRORS = {"UNKNOWN", "INTERNAL", "DATA_LOSS", "UNIMPLEMENTED"}


@dataclasses.dataclass
class Windows:
    """Calibrated from uncancelled requests, in seconds after the request was sent."""

    ttft_s: float
    transfer_start_s: float
    transfer_end_s: float


@dataclasses.dataclass
class SoakResult:
    cancels: dict[str, dict[str, int]]
    """API -> phase -> cancels that landed in it."""
    answers: dict[str, int]
    """Outcomes that were not a cancel ("grpc OK", "http 429", ...): a request that finished before its cancel."""
    server_errors: list[str]
    leaked: dict[str, dict[str, int]]
    """Worker -> {used_blocks, running, waiting, reserved} after the soak (all 0 expected)."""
    idle_blocks: dict[str, int]
    """Worker -> its KV pool's size, every block of which must be free again."""
    elapsed_s: float
    windows: Windows

    @property
    def count(self) -> int:
        return sum(sum(p.values()) for p in self.cancels.values()) + sum(self.answers.values())

    @property
    def ok(self) -> bool:
        return not self.server_errors and all(not any(v.values()) for v in self.leaked.values())

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "count": self.count, "requests_per_s": self.count / self.elapsed_s,
                "ok": self.ok}


# ------------------------------------------------------------------------------------------------ workers
def worker_stats(name: str, endpoint: str, probe: TlsFiles | None) -> worker_pb2.WorkerStats:
    """Stats of the worker `name` ("prefill-*" or "decode-*", the launcher's ids): plaintext, or over mutual TLS
    as the probe identity checking the worker's role."""
    role = "prefill" if name.startswith("prefill") else "decode"
    if probe is None:
        channel = grpc.insecure_channel(endpoint)
    else:
        channel = grpc.secure_channel(endpoint, channel_credentials(probe), options=channel_options(role))
    stub = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    with channel:
        return stub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)


def _busy(stats: worker_pb2.WorkerStats) -> dict[str, int]:
    return {"used_blocks": stats.used_blocks, "running": stats.running, "waiting": stats.waiting,
            "reserved": stats.reserved}


def wait_idle(endpoints: dict[str, str], probe: TlsFiles | None,
              timeout_s: float = IDLE_TIMEOUT_S) -> dict[str, worker_pb2.WorkerStats]:
    """Poll every worker's Stats until none holds anything, or `timeout_s`; the last Stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {name: worker_stats(name, endpoint, probe) for name, endpoint in endpoints.items()}
        if not any(any(_busy(s).values()) for s in stats.values()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------------ requests
def prompt_for(rng: random.Random, index: int) -> str:
    """A prompt of 40..250 words, unique from its first block (no prefix-cache hit shortens the prefill)."""
    words = [rng.choice(PROMPT_WORDS) for _ in range(rng.randint(40, 250))]
    return f"Request {index}: " + " ".join(words)


def _sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


async def calibrate(stub, prompt: str, rounds: int = 3) -> Windows:
    """Client-side TTFT and the gateway's prefill/transfer timings of uncancelled requests."""
    ttfts, starts, ends = [], [], []
    give_up = time.monotonic() + 60.0  # a gateway that just started may not have seen the workers yet
    for i in range(rounds):
        request = generation_pb2.GenerateRequest(text=f"({i}) {prompt}", sampling=_sampling())
        while True:
            started = time.perf_counter()
            first = None
            timings = None
            try:
                async for response in stub.Generate(request, timeout=RPC_TIMEOUT_S):
                    first = first or time.perf_counter() - started
                    if response.HasField("timings"):
                        timings = response.timings
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > give_up:
                    raise
                await asyncio.sleep(0.5)
        ttfts.append(first)
        if timings is not None:
            starts.append((timings.queue_ms + timings.prefill_ms) / 1000)
            ends.append((timings.queue_ms + timings.prefill_ms + timings.transfer_ms) / 1000)
    ttft = statistics.median(ttfts)
    start = statistics.median(starts) if starts else ttft / 2
    end = max(statistics.median(ends) if ends else ttft, start + 0.001)
    return Windows(ttft_s=ttft, transfer_start_s=start, transfer_end_s=end)


def _cancel_plan(rng: random.Random, windows: Windows) -> tuple[str, float, int]:
    """(aimed phase, delay before cancelling in s, tokens to read first)."""
    phase = rng.choice(PHASES)
    if phase == "before-first-token":
        return phase, rng.uniform(0.0, windows.ttft_s * 0.9), 0
    if phase == "kv-transfer":
        return phase, rng.uniform(windows.transfer_start_s, windows.transfer_end_s), 0
    return phase, 0.0, rng.randint(1, 10)


async def grpc_one(stub, prompt: str, delay_s: float, num_tokens: int) -> tuple[str, str]:
    """(landed phase or "answer", status): cancel after `delay_s` (num_tokens 0) or after `num_tokens` tokens."""
    call = stub.Generate(generation_pb2.GenerateRequest(text=prompt, sampling=_sampling()), timeout=RPC_TIMEOUT_S)
    received = 0

    async def read() -> str:
        nonlocal received
        try:
            async for _ in call:
                received += 1
                if num_tokens and received >= num_tokens:
                    call.cancel()
                    return "CANCELLED"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        except asyncio.CancelledError:  # grpc's way of ending a read of a call cancelled before its metadata
            return "CANCELLED"
        return "OK"

    task = asyncio.ensure_future(read())
    if num_tokens:
        status = await task
        return ("mid-stream", status) if status == "CANCELLED" else ("answer", status)
    done, _ = await asyncio.wait({task}, timeout=delay_s)
    if done:
        return "answer", task.result()
    call.cancel()
    status = await task
    if status not in ("CANCELLED", "OK"):
        return "answer", status
    return ("before-first-token" if received == 0 else "mid-stream"), "CANCELLED"


async def http_one(session: aiohttp.ClientSession, url: str, prompt: str, delay_s: float,
                   num_tokens: int) -> tuple[str, str]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    received = 0

    async def read() -> str:
        nonlocal received
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                return str(response.status)
            async for line in response.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        return f"in-band {event['error'].get('code')}"
                    received += 1
                    if num_tokens and received >= num_tokens:
                        response.close()  # the client goes away mid-stream
                        return "CANCELLED"
            return "200"

    task = asyncio.ensure_future(read())
    if num_tokens:
        status = await task
        return ("mid-stream", status) if status == "CANCELLED" else ("answer", status)
    done, _ = await asyncio.wait({task}, timeout=delay_s)
    if done:
        return "answer", task.result()
    task.cancel()  # closes the connection: the gateway sees the client leave
    try:
        await task
    except asyncio.CancelledError:
        pass
    return ("before-first-token" if received == 0 else "mid-stream"), "CANCELLED"


async def soak(target: str, http_url: str | None, count: int, concurrency: int, seed: int) -> tuple[dict, dict, list,
                                                                                                       float, Windows]:
    rng = random.Random(seed)
    cancels = {api: dict.fromkeys(PHASES, 0) for api in APIS}
    answers: collections.Counter[str] = collections.Counter()
    server_errors: list[str] = []
    async with grpc.aio.insecure_channel(target) as channel, aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=RPC_TIMEOUT_S)) as session:
        stub = generation_pb2_grpc.GenerationStub(channel)
        windows = await calibrate(stub, prompt_for(random.Random(seed + 1), -1))
        semaphore = asyncio.Semaphore(concurrency)

        async def one(index: int) -> None:
            api = "http" if http_url is not None and rng.random() < 0.5 else "grpc"
            aimed, delay_s, num_tokens = _cancel_plan(rng, windows)
            prompt = prompt_for(rng, index)
            async with semaphore:
                if api == "grpc":
                    landed, status = await grpc_one(stub, prompt, delay_s, num_tokens)
                else:
                    landed, status = await http_one(session, http_url, prompt, delay_s, num_tokens)
            if landed == "answer":
                answers[f"{api} {status}"] += 1
                if status in SERVER_ERRORS or status.startswith("5") or status.startswith("in-band"):
                    server_errors.append(f"request {index} ({api}, aimed {aimed}): {status}")
            else:
                # Aimed at the transfer and still before the first token: it landed there, as far as a client can tell.
                cancels[api]["kv-transfer" if aimed == "kv-transfer" and landed == "before-first-token"
                             else landed] += 1

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(count)))
        elapsed = time.perf_counter() - started
    return cancels, dict(answers), server_errors, elapsed, windows


def run(target: str, http_url: str | None, workers: dict[str, str], count: int, concurrency: int,
        seed: int, probe: TlsFiles | None = None) -> SoakResult:
    """The whole soak against a running cluster: `workers` maps a name to each worker's gRPC endpoint; `probe`
    is the cluster's probe certificate when the workers serve mutual TLS."""
    cancels, answers, server_errors, elapsed, windows = asyncio.run(soak(target, http_url, count, concurrency, seed))
    stats = wait_idle(workers, probe)
    return SoakResult(cancels=cancels, answers=answers, server_errors=server_errors,
                      leaked={name: _busy(s) | {"not_free": s.num_blocks - s.free_blocks} for name, s in stats.items()},
                      idle_blocks={name: s.num_blocks for name, s in stats.items()}, elapsed_s=elapsed,
                      windows=windows)


def report(result: SoakResult) -> str:
    w = result.windows
    lines = [f"random cancels: {result.count} requests in {result.elapsed_s:.1f} s "
             f"({result.count / result.elapsed_s:.1f} requests/s)",
             f"calibration: TTFT {w.ttft_s * 1000:.0f} ms, KV transfer window {w.transfer_start_s * 1000:.0f}.."
             f"{w.transfer_end_s * 1000:.0f} ms after the request",
             f"{'cancels':<22}" + "".join(f"{api:>8}" for api in APIS)]
    for phase in PHASES:
        lines.append(f"  {phase:<20}" + "".join(f"{result.cancels[api][phase]:>8}" for api in APIS))
    lines.append("finished before their cancel: " + (", ".join(f"{k} x{v}" for k, v in sorted(result.answers.items()))
                                                    or "none"))
    for name, leak in result.leaked.items():
        lines.append(f"leaked on {name}: " + ", ".join(f"{k} {v}" for k, v in leak.items())
                     + f" (pool of {result.idle_blocks[name]} blocks)")
    lines += [f"server error: {e}" for e in result.server_errors[:20]]
    lines.append("OK: no leak, no server error" if result.ok else "FAILED")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000, help="requests, each cancelled (default 1000)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", help="gateway gRPC host:port of a running cluster (default: start one)")
    parser.add_argument("--http-url", help="its OpenAI-compatible HTTP base URL (with --target)")
    parser.add_argument("--worker", action="append", default=[], metavar="ROLE=HOST:PORT",
                        help="a worker of a running cluster, e.g. decode=127.0.0.1:50071 (with --target; plaintext only)")
    parser.add_argument("--transport", default="grpc", help="KV transport of the cluster this starts (default grpc: "
                        "the widest transfer window)")
    parser.add_argument("--kv-cache-memory", type=int, default=128 << 20, help="bytes per worker (default 128 MiB)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.target is not None:
        if not args.worker:
            parser.error("--target needs every worker's --worker HOST:PORT (for the leak check)")
        roles = [w.partition("=") for w in args.worker]
        if any(role not in ("prefill", "decode") or not endpoint for role, _, endpoint in roles):
            parser.error("--worker takes prefill=HOST:PORT or decode=HOST:PORT")
        workers = {f"{role}-{i}": endpoint for i, (role, _, endpoint) in enumerate(roles)}
        result = run(args.target, args.http_url, workers, args.count, args.concurrency,
                     args.seed)
    else:
        config = LocalClusterConfig(port=0, http_port=0, transport=args.transport,
                                    engine=EngineConfig(model="default", kv_cache_memory=args.kv_cache_memory),
                                    gateway_args=("--local-prefill-threshold", "0"))
        with LocalCluster(config) as cluster:
            result = run(cluster.gateway_target, cluster.http_url, cluster.workers, args.count, args.concurrency,
                         args.seed, cluster.tls_files.get("probe"))
    print(report(result), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_json(), indent=2))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
