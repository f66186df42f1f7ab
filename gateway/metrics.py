"""The gateway's Prometheus metrics, kept in a CollectorRegistry of its own per server (several gateways in one
process, as in the tests, never share counts). Served as text by the HTTP front's GET /metrics.

Requests, both APIs (label api: "grpc" or "http"; endpoint: generate, chat, completions, chat_completions):
    pdserve_requests_total{api,endpoint,code}        finished requests by status (grpc.StatusCode names: OK,
                                                     INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE,
                                                     DEADLINE_EXCEEDED, CANCELLED, INTERNAL)
    pdserve_requests_in_flight{api}                  requests between arrival and their last byte
    pdserve_gateway_queued_requests                  admitted requests waiting for room on a decode worker
    pdserve_time_to_first_token_seconds{api}         arrival -> first token leaving the gateway
    pdserve_inter_token_latency_seconds{api}         between consecutive chunks of tokens of one request
    pdserve_time_per_output_token_seconds{api}       (last token - first token) / (tokens - 1), finished requests
    pdserve_e2e_request_latency_seconds{api}         arrival -> last token, finished requests
    pdserve_request_queue_seconds, pdserve_request_prefill_seconds      Timings.queue_ms / prefill_ms
    pdserve_prompt_tokens_total, pdserve_generation_tokens_total        tokens of finished requests / generated
    pdserve_prefix_cache_hit_tokens_total            prompt tokens whose KV came from a prefix cache
    pdserve_kv_transfer_bytes_total{transport}       KV bytes moved from prefill to decode workers ("shm", "grpc")
    pdserve_kv_transfer_seconds{transport}           the prefill worker's push time per request
    pdserve_local_prefill_total{reason}              requests prefilled on their decode worker, by routing reason
    pdserve_unauthenticated_requests_total{api}      calls refused for a missing, malformed or unknown API key
                                                     (any RPC or path; not in pdserve_requests_total)
Workers, as last reported to the prefix index (refreshed on each scrape; label worker, role):
    pdserve_worker_running_seqs, pdserve_worker_waiting_seqs (queue depth),
    pdserve_worker_kv_blocks_used, pdserve_worker_kv_blocks_free
The process (protos.gc_tuning.register_process_collectors):
    process_*, python_gc_*                           prometheus_client's process and garbage-collector metrics
    pdserve_gc_frozen_objects                        objects frozen out of the collector's walks before it served

"Finished" means the stream ended with a finish reason (length, stop token or stop string); cancelled and failed
requests count only in pdserve_requests_total and, for tokens they did get, the TTFT / ITL / generation counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.request_types import OutputChunk, RequestTrace
from kvstore.local_index import WorkerInfo
from protos.gc_tuning import register_process_collectors

# Buckets as vLLM's (seconds), so dashboards built for it read these too.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _WorkerCollector(Collector):
    """Per-worker gauges from the latest list of workers (replaced whole, so departed workers disappear)."""

    def __init__(self) -> None:
        self.workers: Sequence[WorkerInfo] = ()

    def describe(self):
        return []           # nothing to check at registration; names are fixed below

    def collect(self):
        labels = ["worker", "role"]
        families = {
            "running": GaugeMetricFamily("pdserve_worker_running_seqs", "Sequences in the worker's running batch",
                                         labels=labels),
            "waiting": GaugeMetricFamily("pdserve_worker_waiting_seqs", "Sequences queued on the worker",
                                         labels=labels),
            "used": GaugeMetricFamily("pdserve_worker_kv_blocks_used", "KV blocks referenced by sequences",
                                      labels=labels),
            "free": GaugeMetricFamily("pdserve_worker_kv_blocks_free",
                                      "KV blocks free to allocate (cached-but-evictable included)", labels=labels),
        }
        for w in self.workers:
            values = {"running": w.running, "waiting": w.waiting, "used": w.capacity_blocks - w.free_blocks,
                      "free": w.free_blocks}
            for key, family in families.items():
                family.add_metric([w.worker_id, w.role], values[key])
        yield from families.values()


class GatewayMetrics:
    """Every metric of one gateway; `request` starts the recording of one request."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        register_process_collectors(r)
        self.requests = Counter("pdserve_requests", "Requests by API, endpoint and final status code",
                                ["api", "endpoint", "code"], registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "Requests between arrival and their last byte", ["api"],
                               registry=r)
        self.queued = Gauge("pdserve_gateway_queued_requests",
                            "Admitted requests waiting in the gateway for room on a decode worker", registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Arrival to the first token leaving the gateway",
                              ["api"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds",
                             "Time between consecutive chunks of tokens of one request", ["api"],
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds",
                              "(last token - first token) / (tokens - 1) of finished requests", ["api"],
                              buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Arrival to the last token of finished requests",
                             ["api"], buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("pdserve_request_queue_seconds",
                               "Arrival to a worker taking the request (Timings.queue_ms)", buckets=TTFT_BUCKETS,
                               registry=r)
        self.prefill = Histogram("pdserve_request_prefill_seconds", "Prefill time (Timings.prefill_ms)",
                                 buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated", registry=r)
        self.prefix_hit_tokens = Counter("pdserve_prefix_cache_hit_tokens",
                                         "Prompt tokens whose KV came from a prefix cache (finished requests)",
                                         registry=r)
        self.transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved from prefill to decode workers",
                                      ["transport"], registry=r)
        self.transfer_seconds = Histogram("pdserve_kv_transfer_seconds", "KV push time of one request",
                                          ["transport"], buckets=TRANSFER_BUCKETS, registry=r)
        self.local_prefill = Counter("pdserve_local_prefill", "Requests prefilled on their decode worker, by reason",
                                     ["reason"], registry=r)
        self.unauthenticated = Counter("pdserve_unauthenticated_requests",
                                       "Calls refused for a missing, malformed or unknown API key", ["api"],
                                       registry=r)
        self._workers = _WorkerCollector()
        r.register(self._workers)

    def request(self, api: str, endpoint: str, arrival: float, trace: RequestTrace) -> RequestRecorder:
        return RequestRecorder(self, api, endpoint, arrival, trace)

    def track_queue(self, num_queued: Callable[[], int]) -> None:
        """pdserve_gateway_queued_requests reads `num_queued()` at each scrape."""
        self.queued.set_function(num_queued)

    def set_workers(self, workers: Sequence[WorkerInfo]) -> None:
        """The workers the per-worker gauges report from now on."""
        self._workers.workers = tuple(workers)

    def exposition(self) -> bytes:
        """Prometheus text format of every metric."""
        return generate_latest(self.registry)


class RequestRecorder:
    """Records one request: `start` at arrival, `chunk` for each chunk handed to the client, `end` once."""

    def __init__(self, metrics: GatewayMetrics, api: str, endpoint: str, arrival: float,
                 trace: RequestTrace) -> None:
        self._m = metrics
        self._api = api
        self._endpoint = endpoint
        self._arrival = arrival
        self._trace = trace
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._num_tokens = 0
        self._finished = False
        self._ended = False

    def start(self) -> None:
        self._m.in_flight.labels(self._api).inc()

    def chunk(self, chunk: OutputChunk, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if chunk.token_ids:
            if self._first_token_at is None:
                self._first_token_at = now
                self._m.ttft.labels(self._api).observe(now - self._arrival)
            else:
                self._m.itl.labels(self._api).observe(now - self._last_token_at)
            self._last_token_at = now
            self._num_tokens += len(chunk.token_ids)
            self._m.generation_tokens.inc(len(chunk.token_ids))
        if chunk.usage is not None:              # the request's last chunk (each choice's last has a finish_reason)
            self._finish(chunk, now)

    def _finish(self, chunk: OutputChunk, now: float) -> None:
        m = self._m
        self._finished = True
        m.e2e.labels(self._api).observe(now - self._arrival)
        if self._num_tokens > 1:
            m.tpot.labels(self._api).observe((self._last_token_at - self._first_token_at) / (self._num_tokens - 1))
        if chunk.usage is not None:
            m.prompt_tokens.inc(chunk.usage.prompt_tokens)
            m.prefix_hit_tokens.inc(chunk.usage.cached_tokens)
        if chunk.timings is not None:
            t = chunk.timings
            m.queue.observe(t.queue_ms / 1000.0)
            m.prefill.observe(t.prefill_ms / 1000.0)
            if t.transport != "local":
                m.transfer_bytes.labels(t.transport).inc(t.transfer_bytes)
                m.transfer_seconds.labels(t.transport).observe(t.transfer_ms / 1000.0)
        if self._trace.local_reason:
            m.local_prefill.labels(self._trace.local_reason).inc()

    def end(self, code: str) -> None:
        """The request is over with status `code` (a grpc.StatusCode name); idempotent."""
        if self._ended:
            return
        self._ended = True
        self._m.in_flight.labels(self._api).dec()
        self._m.requests.labels(self._api, self._endpoint, code).inc()
