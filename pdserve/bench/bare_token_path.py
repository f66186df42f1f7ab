"""A batch-1 token stream with pdserve's shape and nothing of pdserve in it: what Python grpc's message passing
alone costs the CPUs a decode step runs on.

A batch-1 token crosses three processes on its way out of a 1P+1D cluster: the decode worker's Decode stream
(a sync grpc server), the gateway (grpc.aio: it reads that stream and yields each chunk to its own client) and the
client (a sync channel, as pdserve.client.Client). `BareTokenPath` builds that path without pdserve's code,
protobuf or TLS:

    source   a process with a sync grpc server streaming `n` 48-byte messages, one every `gap_s` (each message due
             `gap_s` after the one before; a late one goes at once);
    relay    a process with a grpc.aio server whose handler reads the source's stream over a grpc.aio channel and
             yields each message on;
    client   `stream()` in the calling process: a sync channel that reads the relay's stream (hops=3) or the
             source's (hops=2: what calling a decode worker directly has).

bench/bench_cluster.py --tpot-vs-engine runs the one-process engine beside it, one message per token at the
engine's own token rate: the engine's TPOT there is what passing each token through Python grpc's processes
costs a step that has every core of the machine, beside what pdserve's own serving paths cost it. It is a
reference, not a bound: the source paces itself with a sleep where a worker's stream wakes on the engine's
token, and its messages land at any point of a step.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import threading
import time
from concurrent import futures

import grpc

_METHOD = "/pdserve.bench.TokenPath/Stream"
_MESSAGE = b"t" * 48


def _same(data: bytes) -> bytes:
    return data


def _request(n: int, gap_s: float) -> bytes:
    return n.to_bytes(4, "little") + round(gap_s * 1e6).to_bytes(4, "little")


def _handler(behavior) -> grpc.GenericRpcHandler:
    service, method = _METHOD[1:].rsplit("/", 1)
    return grpc.method_handlers_generic_handler(
        service, {method: grpc.unary_stream_rpc_method_handler(behavior, _same, _same)})


def _run_source(ports: multiprocessing.Queue) -> None:
    def stream(request: bytes, context):
        n, gap_s = int.from_bytes(request[:4], "little"), int.from_bytes(request[4:8], "little") / 1e6
        due = time.perf_counter()
        for _ in range(n):
            due += gap_s
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            yield _MESSAGE

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((_handler(stream),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _run_relay(upstream: int, ports: multiprocessing.Queue) -> None:
    async def main() -> None:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{upstream}")
        call = channel.unary_stream(_METHOD, request_serializer=_same, response_deserializer=_same)

        async def stream(request: bytes, context):
            async for message in call(request):
                yield message

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_handler(stream),))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


class BareTokenPath:
    """The source and relay processes (module docstring), started at construction; `close()` ends them."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        ports = context.Queue()
        self._channels: dict[int, grpc.Channel] = {}
        self._processes: list[multiprocessing.Process] = []
        try:
            source_port = self._start(context, ports, _run_source, "bare-path-source")
            relay_port = self._start(context, ports, _run_relay, "bare-path-relay", source_port)
            self._channels = {2: grpc.insecure_channel(f"127.0.0.1:{source_port}"),
                              3: grpc.insecure_channel(f"127.0.0.1:{relay_port}")}
            self.stream(2, 0.0, hops=3)  # both hops connected before anything is timed
        except BaseException:
            self.close()
            raise
        self.pids = {"bare path source": self._processes[0].pid, "bare path relay": self._processes[1].pid}

    def _start(self, context, ports, target, name: str, *args) -> int:
        """Start `target(*args, ports)` as a process; returns the port its server listens on."""
        process = context.Process(target=target, args=(*args, ports), name=name, daemon=True)
        process.start()
        self._processes.append(process)
        try:
            return ports.get(timeout=60)
        except queue.Empty:
            raise RuntimeError(f"{name} did not start (exit code {process.exitcode})") from None

    def stream(self, n: int, gap_s: float, hops: int = 3, stop: threading.Event | None = None) -> int:
        """Read `n` messages sent one every `gap_s` over `hops` processes (3: through the relay, 2: straight from
        the source); once `stop` is set, the stream is cancelled at the next message. Returns the messages read."""
        call = self._channels[hops].unary_stream(_METHOD, request_serializer=_same, response_deserializer=_same)
        responses = call(_request(n, gap_s))
        read = 0
        for _ in responses:
            read += 1
            if stop is not None and stop.is_set():
                responses.cancel()
                break
        return read

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        for process in reversed(self._processes):
            process.terminate()
            process.join(timeout=10)

    def __enter__(self) -> BareTokenPath:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
