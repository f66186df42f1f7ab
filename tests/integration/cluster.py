"""The pieces of a real cluster the integration tests share: worker processes (each loading the model, registered
in a real redis-server), in-process gateways in front of them, polling of the workers' Stats, and the offline
engine as the reference for greedy outputs.

    cluster = Cluster(model_path, redis)          # redis: a started kvstore.embedded_redis.EmbeddedRedis
    cluster.start_worker("prefill", "p0"); cluster.start_worker("decode", "d0")
    cluster.wait_registered("p0", "d0")
    handle = cluster.gateway()                    # gateway.server.start_server: gRPC and HTTP on free ports
    assert_idle(cluster.wait_idle())              # no block, sequence or reservation left on any worker
    cluster.close()

or, for a module fixture, `with running_cluster(model_path, [("prefill", "p0"), ("decode", "d0")]) as cluster:`.

With a cluster PKI (`Cluster(model_path, redis, pki=...)`, or `running_cluster(..., tls=True)`, which writes one
into a temporary directory with a certificate per worker plus "gateway" and "probe"), every worker serves mutual
TLS with its own certificate, `gateway()` talks to them with the "gateway" certificate and `stats()` polls them
with the "probe" one.

grpc.aio clients of a test run on the in-process gateways' event loop (`run_async(coro)`), never in an
`asyncio.run` of their own: see gateway.server.background_loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path

import grpc

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from gateway.config import GatewayConfig
from gateway.server import background_loop, load_model_spec, start_server
from kvstore.embedded_redis import EmbeddedRedis
from kvstore.index import PrefixIndex
from protos import tls
from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
KV_CACHE_MEMORY = 128 << 20
MAX_MODEL_LEN = 2048
BLOCK_SIZE = 16
START_TIMEOUT_S = 180.0
IDLE_TIMEOUT_S = 30.0
RPC_TIMEOUT_S = 120.0

# A worker process: serve() until SIGTERM, configured from JSON (no CLI flags involved). It kills itself when
# its stdin closes, so no worker outlives a test process that died without cleaning up.
WORKER_MAIN = r"""
import json, logging, os, signal, sys, threading
threading.Thread(target=lambda: (sys.stdin.read(), os.kill(os.getpid(), signal.SIGKILL)), daemon=True).start()
logging.basicConfig(level=logging.WARNING, format="%(asctime)s {} %(name)s %(levelname)s %(message)s")
role, worker_kwargs, engine_kwargs = json.loads(sys.argv[1])
from engine.config import EngineConfig
if role == "prefill":
    from prefill_worker.config import PrefillWorkerConfig as Config
    from prefill_worker.server import serve
else:
    from decode_worker.config import DecodeWorkerConfig as Config
    from decode_worker.server import serve
serve(Config(**worker_kwargs), EngineConfig(**engine_kwargs))
"""


def tls_kwargs(files: tls.TlsFiles) -> dict:
    """Worker or gateway config fields of one process's cluster TLS files."""
    return dict(cluster_ca=str(files.ca_path), cluster_cert=str(files.cert_path), cluster_key=str(files.key_path))


class Cluster:
    """Worker processes registered in one redis-server, plus in-process gateways in front of them."""

    def __init__(self, model_path: Path, redis: EmbeddedRedis, pki: dict[str, tls.TlsFiles] | None = None) -> None:
        """`pki`: name -> TlsFiles (protos.tls.write_cluster_pki) holding each worker's id, "gateway" and "probe";
        None: plaintext everywhere."""
        self.model_path = model_path
        self.redis = redis
        self.pki = pki
        self.index = PrefixIndex(redis.url, lookup_timeout_s=1.0)
        self.procs: dict[str, subprocess.Popen] = {}
        self.gateways = []
        self.model = None

    def start_worker(self, role: str, worker_id: str, engine_kwargs: dict | None = None, **worker_kwargs) -> None:
        """`engine_kwargs`: EngineConfig fields over the cluster's defaults (e.g. tensor_parallel_size)."""
        engine = {**dict(model=str(self.model_path), kv_cache_memory=KV_CACHE_MEMORY, num_threads=1,
                         block_size=BLOCK_SIZE), **(engine_kwargs or {})}
        if self.pki is not None and "cluster_ca" not in worker_kwargs and "insecure_internal" not in worker_kwargs:
            worker_kwargs = {**tls_kwargs(self.pki[worker_id]), **worker_kwargs}
        if "cluster_cert" not in worker_kwargs:  # plaintext on purpose: decode workers cache the KV they receive
            worker_kwargs.setdefault("insecure_internal", True)
        args = json.dumps([role, dict(worker_id=worker_id, redis_url=self.redis.url, **worker_kwargs), engine])
        self.procs[worker_id] = subprocess.Popen([sys.executable, "-c", WORKER_MAIN.replace("{}", worker_id), args],
                                                 cwd=REPO, stdin=subprocess.PIPE)

    def wait_registered(self, *worker_ids: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            live = {w.worker_id for w in self.index.list_workers() or []}
            if set(worker_ids) <= live:
                return
            for worker_id in worker_ids:
                assert self.procs[worker_id].poll() is None, f"worker {worker_id} exited"
            assert time.monotonic() < deadline, f"workers {set(worker_ids) - live} did not register"
            time.sleep(0.2)

    def stop_worker(self, worker_id: str, kill: bool = False) -> None:
        proc = self.procs.pop(worker_id)
        proc.kill() if kill else proc.terminate()
        try:
            proc.wait(60)
        finally:
            proc.stdin.close()

    def gateway(self, **overrides):
        config = GatewayConfig(model=str(self.model_path), redis_url=self.redis.url, port=0,
                               block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                               lease_ms=60_000,       # outlives every bounded wait here: a leaked reservation shows
                               **{"local_prefill_threshold": 0, "http_port": 0, "drain_timeout_s": 5.0,
                                  **(tls_kwargs(self.pki["gateway"]) if self.pki is not None else {}), **overrides})
        if self.model is None:
            self.model = load_model_spec(config)
        handle = start_server(config, self.model)
        self.gateways.append(handle)
        return handle

    def endpoint(self, worker_id: str) -> str:
        return next(w.grpc_endpoint for w in self.index.list_workers() if w.worker_id == worker_id)

    def channel(self, worker_id: str, role: str) -> grpc.Channel:
        """A channel to a worker: plaintext, or with the "probe" certificate checking the worker's role."""
        if self.pki is None:
            return grpc.insecure_channel(self.endpoint(worker_id))
        return grpc.secure_channel(self.endpoint(worker_id), tls.channel_credentials(self.pki["probe"]),
                                   options=tls.channel_options(role))

    def stats(self, worker_id: str) -> worker_pb2.WorkerStats:
        role = "decode" if worker_id.startswith("d") else "prefill"
        with self.channel(worker_id, role) as channel:
            stub_type = worker_pb2_grpc.DecodeWorkerStub if role == "decode" else worker_pb2_grpc.PrefillWorkerStub
            return stub_type(channel).Stats(worker_pb2.StatsRequest(), timeout=10)

    def wait_idle(self, *worker_ids: str) -> dict[str, worker_pb2.WorkerStats]:
        """Poll Stats until no worker holds a block, a sequence or a reservation (bounded); the last Stats."""
        worker_ids = worker_ids or tuple(self.procs)
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            stats = {w: self.stats(w) for w in worker_ids}
            busy = {w: s for w, s in stats.items() if s.used_blocks or s.running or s.waiting or s.reserved}
            if not busy and all(g.num_inflight == 0 for g in self.gateways) or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    def close(self) -> None:
        """Stop everything, whatever fails: gateways, then workers (SIGTERM; SIGKILL after 30 s)."""
        try:
            for handle in self.gateways:
                handle.stop(0)
        finally:
            procs, self.procs = list(self.procs.values()), {}
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                proc.stdin.close()
            self.index.close()


def run_async(coro: Coroutine):
    """Run a coroutine (grpc.aio clients) on the gateways' event loop and return its result."""
    return asyncio.run_coroutine_threadsafe(coro, background_loop()).result()


def generate_greedy(port: int, prompt: Sequence[int], max_tokens: int):
    """Greedy `prompt` (token ids, EOS ignored) through the gateway's gRPC on `port`: (token ids, last message,
    trailing metadata)."""
    request = generation_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    request.token_ids.ids[:] = prompt
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=RPC_TIMEOUT_S)
        chunks = list(call)
        metadata = {m.key: m.value for m in call.trailing_metadata()}
    return [t for c in chunks for t in c.token_ids], chunks[-1], metadata


def assert_idle(stats: dict[str, worker_pb2.WorkerStats]) -> None:
    for worker_id, s in stats.items():
        assert (s.used_blocks, s.running, s.waiting, s.reserved) == (0, 0, 0, 0), f"{worker_id} busy: {s}"


def _write_pki(directory: str, workers: Sequence[tuple[str, str]]) -> dict[str, tls.TlsFiles]:
    return tls.write_cluster_pki(directory, [*workers, ("gateway", "gateway"), ("probe", "probe")])


class Reference:
    """The offline engine with the workers' settings and no prefix caching: every answer is a cold run."""

    def __init__(self, model_path: Path) -> None:
        self.llm = LLM(model=str(model_path), progress=False, kv_cache_memory=KV_CACHE_MEMORY, num_threads=1,
                       enable_prefix_caching=False, max_model_len=MAX_MODEL_LEN)
        self._cache = {}

    def __call__(self, prompt, max_tokens=16, ignore_eos=False) -> tuple[str, list[int]]:
        """(text, token ids) of the greedy completion of `prompt` (text or token ids)."""
        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_tokens, ignore_eos)
        if key not in self._cache:
            out = self.llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                           ignore_eos=ignore_eos))[0].outputs[0]
            self._cache[key] = (out.text, out.token_ids)
        return self._cache[key]


@contextlib.contextmanager
def running_cluster(model_path: Path, workers: Sequence[tuple[str, str]], tls: bool = False) -> Iterator[Cluster]:
    """A real redis-server and the `workers` ((role, worker_id), ...) started and registered, with the cluster's
    Reference (loaded while the workers load) as `cluster.reference`; everything stops on exit. `tls`: a fresh
    cluster PKI (module doc), as `cluster.pki`."""
    with EmbeddedRedis() as redis, tempfile.TemporaryDirectory(prefix="pdserve-pki-") as pki_dir:
        pki = _write_pki(pki_dir, workers) if tls else None
        cluster = Cluster(model_path, redis, pki)
        try:
            for role, worker_id in workers:
                cluster.start_worker(role, worker_id)
            cluster.reference = Reference(model_path)
            cluster.wait_registered(*(worker_id for _, worker_id in workers))
            yield cluster
        finally:
            cluster.close()
