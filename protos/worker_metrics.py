"""A worker's Prometheus metrics (prefill or decode), in a CollectorRegistry of its own, served as text on
--metrics-port (`serve_metrics`: GET /metrics, plaintext HTTP). Every series carries model_name (the model
file's or directory's name, as the gateway's default served name) and role ("prefill" or "decode"). Names
follow vLLM's where it has one (vllm:X -> pdserve_X):

Read at each scrape from the snapshot the engine loop publishes every housekeeping interval (the HTTP thread
never touches the engine):
    pdserve_num_requests_running          sequences in the running batch
    pdserve_num_requests_waiting          sequences queued (new or preempted)
    pdserve_waiting_prompt_tokens         prompt tokens not computed yet, of queued and partly prefilled sequences
                                          (the prefill pool's autoscaling signal)
    pdserve_kv_blocks_used                KV blocks referenced by requests
    pdserve_kv_blocks_free                KV blocks free to allocate (cached-but-evictable included)
    pdserve_kv_cache_usage_ratio          used / all blocks, 0..1 (vLLM: kv_cache_usage_perc)
    pdserve_num_preemptions_total         sequences preempted since start
Fed from the engine loop after each step that ran the model (EngineLoop.add_step_hook, LLMEngine.last_step):
    pdserve_engine_step_seconds           histogram: one step's duration
    pdserve_prompt_tokens_total           prompt tokens computed, prefix-cache hits excluded (rate() = prefill
                                          tokens/s)
    pdserve_request_queue_time_seconds    histogram: queued (or joined the batch from a reservation) -> first step
Read at each scrape from a worker's CpuShare (engine.cpu_share), when it borrows another worker's CPUs:
    pdserve_engine_steps_by_cpus_total{cpus}   steps run on its own CPUs ("own") or on its own plus the idle
                                               other worker's ("borrowed")
Fed from the service edge:
    pdserve_kv_transfer_bytes_total{transport}    KV payload bytes sent (prefill: per Prefill answered) or received
    pdserve_kv_transfer_seconds_total{transport}  (decode: per committed transfer), and the time they took;
                                                  transport "grpc" or "shm"
    pdserve_request_failures_total{reason}        request RPCs (Reserve, Decode, Push, Prefill) that ended with a
                                                  status other than OK or CANCELLED (the caller's choice);
                                                  reason: the status name (UNAVAILABLE while draining,
                                                  RESOURCE_EXHAUSTED when full, FAILED_PRECONDITION, ...)
The process (protos.gc_tuning.register_process_collectors; no model_name or role labels):
    process_*, python_gc_*                prometheus_client's process and garbage-collector metrics
    pdserve_gc_frozen_objects             objects frozen out of the collector's walks before the worker served

Label values that are known in advance start at 0, so every series exists from the first scrape.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.llm_engine import EngineStats, LLMEngine
from engine.model_fetch import resolve_model_path
from kvstore.transfer_manifest import TransferManifest
from kvstore.transfer_service import KvReceiver, ReceivedBlocks, ReceiveTarget
from protos.gc_tuning import register_process_collectors

LABELS = ("model_name", "role")
TRANSPORTS = ("grpc", "shm")
FAILURE_REASONS = ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "UNAVAILABLE",
                   "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN")
REQUEST_METHODS = frozenset({"Reserve", "Decode", "Push", "Prefill"})
"""RPC method names that carry a request (failures of Stats, Abort and health are not request failures)."""
# Buckets as vLLM's (seconds), so dashboards built for it read these too.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
QUEUE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)


def model_name(model: str) -> str:
    """The model_name label: the name of the model's file (without suffix) or directory, as the gateway names it."""
    return (resolve_model_path(model, progress=False) if model == "default" else Path(model)).stem


@dataclass(frozen=True)
class LoadSnapshot:
    """The engine's load as the loop last published it."""

    stats: EngineStats
    waiting_prompt_tokens: int

    @classmethod
    def of(cls, engine: LLMEngine) -> LoadSnapshot:
        """On the loop thread (or before it starts)."""
        sched = engine.scheduler
        waiting = sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
                      for queue in (sched.waiting, sched.running) for seq in queue)
        return cls(engine.stats(), waiting)


class _LoadCollector(Collector):
    def __init__(self, label_values: tuple[str, str], snapshot: LoadSnapshot) -> None:
        self._label_values = list(label_values)
        self.snapshot = snapshot          # replaced whole by the loop thread

    def describe(self):
        return []

    def collect(self):
        s = self.snapshot
        st = s.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self._label_values, value)
            return family

        yield gauge("pdserve_num_requests_running", "Sequences in the running batch", st.running)
        yield gauge("pdserve_num_requests_waiting", "Sequences queued (new or preempted)", st.waiting)
        yield gauge("pdserve_waiting_prompt_tokens",
                    "Prompt tokens not computed yet, of queued and partly prefilled sequences", s.waiting_prompt_tokens)
        yield gauge("pdserve_kv_blocks_used", "KV blocks referenced by requests", st.used_blocks)
        yield gauge("pdserve_kv_blocks_free", "KV blocks free to allocate (cached-but-evictable included)",
                    st.free_blocks)
        yield gauge("pdserve_kv_cache_usage_ratio", "Fraction of the KV blocks referenced by requests (0..1)",
                    st.used_blocks / st.num_blocks if st.num_blocks else 0.0)
        preemptions = CounterMetricFamily("pdserve_num_preemptions", "Sequences preempted since start",
                                          labels=LABELS)
        preemptions.add_metric(self._label_values, st.preemptions)
        yield preemptions


class _StepsByCpusCollector(Collector):
    def __init__(self, label_values: tuple[str, str], steps: Mapping[str, int]) -> None:
        self._label_values = list(label_values)
        self._steps = steps               # counted by the loop thread

    def describe(self):
        return []

    def collect(self):
        family = CounterMetricFamily("pdserve_engine_steps_by_cpus", "Engine steps run on the worker's own CPUs "
                                     "or on its own plus another worker's idle ones", labels=[*LABELS, "cpus"])
        for cpus, count in list(self._steps.items()):
            family.add_metric([*self._label_values, cpus], count)
        yield family


class WorkerMetrics:
    """Every metric of one worker. Construct before the engine loop starts, then `attach(loop)`."""

    def __init__(self, engine: LLMEngine, model: str, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        values = (model, role)
        self._load = _LoadCollector(values, LoadSnapshot.of(engine))
        r.register(self._load)
        register_process_collectors(r)
        self.step_seconds = Histogram("pdserve_engine_step_seconds", "Duration of one engine step that ran the model",
                                      LABELS, buckets=STEP_BUCKETS, registry=r).labels(*values)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded)",
                                     LABELS, registry=r).labels(*values)
        self.queue_time = Histogram("pdserve_request_queue_time_seconds",
                                    "Queued (or joined the batch from a reservation) to the first step computing it",
                                    LABELS, buckets=QUEUE_BUCKETS, registry=r).labels(*values)
        verb = "sent to decode workers" if role == "prefill" else "received from prefill workers"
        transfer_bytes = Counter("pdserve_kv_transfer_bytes", f"KV payload bytes {verb}", [*LABELS, "transport"],
                                 registry=r)
        transfer_seconds = Counter("pdserve_kv_transfer_seconds", f"Time spent on KV transfers {verb}",
                                   [*LABELS, "transport"], registry=r)
        self._transfer = {t: (transfer_bytes.labels(*values, t), transfer_seconds.labels(*values, t))
                          for t in TRANSPORTS}
        failures = Counter("pdserve_request_failures", "Request RPCs that ended with a status other than OK",
                           [*LABELS, "reason"], registry=r)
        self._failures = failures
        self._values = values
        for reason in FAILURE_REASONS:
            failures.labels(*values, reason)

    def count_steps_by_cpus(self, steps: Mapping[str, int]) -> None:
        """Serve `steps` (CpuShare.steps: "own" / "borrowed" -> steps) as pdserve_engine_steps_by_cpus_total."""
        self.registry.register(_StepsByCpusCollector(self._values, steps))

    # --- engine loop thread -------------------------------------------------------------------------------------
    def attach(self, loop) -> None:
        """Feed from `loop` (an EngineLoop, before it starts): the load snapshot and the per-step metrics."""
        loop.add_housekeeping(self._publish)
        loop.add_step_hook(self._on_step)

    def _publish(self, engine: LLMEngine) -> None:
        self._load.snapshot = LoadSnapshot.of(engine)

    def _on_step(self, engine: LLMEngine, seconds: float) -> None:
        self.step_seconds.observe(seconds)
        record = engine.last_step
        if record is not None:
            self.prompt_tokens.inc(record.num_prompt_tokens)
            for queue_s in record.queue_times_s:
                self.queue_time.observe(queue_s)

    # --- service edge (gRPC threads) ----------------------------------------------------------------------------
    def record_transfer(self, transport: str, num_bytes: int, seconds: float) -> None:
        counters = self._transfer.get(transport)
        if counters is not None:
            counters[0].inc(num_bytes)
            counters[1].inc(max(seconds, 0.0))

    def on_rpc_end(self, method: str, code: grpc.StatusCode, response) -> None:
        """RpcGate observer: count failed request RPCs; a prefill's answer reports the KV it sent."""
        name = method.rsplit("/", 1)[-1]
        if name not in REQUEST_METHODS:
            return
        if code is grpc.StatusCode.CANCELLED:   # the caller's choice (or it closed a finished stream early)
            return
        if code is not grpc.StatusCode.OK:
            self._failures.labels(*self._values, code.name).inc()
        elif name == "Prefill" and response is not None:
            self.record_transfer(response.transport, response.transfer_bytes, response.transfer_ms / 1000.0)

    def metered_receiver(self, receiver: KvReceiver) -> KvReceiver:
        """`receiver` whose committed transfers count in the transfer metrics (decode side)."""
        return _MeteredReceiver(receiver, self)


class _MeteredReceiver:
    """A KvReceiver that times each transfer from its check to its commit and counts what was committed."""

    def __init__(self, receiver: KvReceiver, metrics: WorkerMetrics) -> None:
        self._receiver = receiver
        self._metrics = metrics
        self._started: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def check(self, manifest: TransferManifest) -> ReceiveTarget:
        target = self._receiver.check(manifest)
        with self._lock:
            self._started[(manifest.request_id, manifest.handle)] = time.perf_counter()
        return target

    def commit(self, request_id: str, handle: str, blocks: ReceivedBlocks) -> None:
        self._receiver.commit(request_id, handle, blocks)      # raises when refused: then reject follows
        with self._lock:
            started = self._started.pop((request_id, handle), None)
        if started is not None:
            self._metrics.record_transfer(blocks.transport, blocks.num_bytes, time.perf_counter() - started)

    def reject(self, request_id: str, handle: str, reason: str) -> None:
        with self._lock:
            self._started.pop((request_id, handle), None)
        self._receiver.reject(request_id, handle, reason)


class MetricsServer:
    """GET /metrics (Prometheus text format) of one registry, on its own thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._httpd, self._thread = start_http_server(port, host.strip("[]"), registry=registry)
        self.port: int = self._httpd.server_port

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None) -> MetricsServer | None:
    """Serve `registry` on host:port (0 picks a free port); None serves nothing."""
    return None if port is None else MetricsServer(registry, host, port)
