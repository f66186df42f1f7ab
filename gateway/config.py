"""Gateway configuration (frozen, validated; flags are mapped onto it by the CLI only)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from engine.config import QUANTIZATIONS
from gateway.tool_parsers import PARSERS as TOOL_CALL_PARSERS
from protos.tls import TlsFiles


def is_loopback_host(host: str) -> bool:
    """Whether binding `host` keeps the ports on this machine ("localhost", 127.0.0.0/8, ::1); "" and 0.0.0.0
    bind every interface."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class GatewayConfig:
    model: str
    """Model path or "default": the gateway reads its tokenizer, chat template, limits and fingerprint (no weights)."""
    redis_url: str
    """Prefix index and worker registry (redis://[user:pass@]host:port/db, rediss://, unix://)."""
    host: str = "127.0.0.1"
    """Address the public gRPC server binds."""
    port: int = 50051
    """Port of the public gRPC server (0 picks a free one)."""
    http_port: int = 8000
    """Port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics) on the same host; 0 picks a free one, -1 turns it off."""
    health_port: int | None = None
    """Plaintext port serving only grpc.health.v1, with the public server's statuses (for the kubelet's gRPC
    probes when the public port needs TLS and an API key); None: none. On `host`; 0 picks a free one."""
    metrics_port: int | None = None
    """HTTP port of Prometheus GET /metrics alone (the registry the HTTP API's /metrics serves too); None: none."""
    block_size: int = 16
    """KV block size in tokens; must equal the workers' (checked against their registration)."""
    max_inflight: int = 256
    """Requests admitted at once (queued ones included); one more gets RESOURCE_EXHAUSTED."""
    max_queued: int = 256
    """Admitted requests that may wait in the gateway for room on a decode worker when every one is full
    (or too slow to answer Reserve); one more gets RESOURCE_EXHAUSTED at once. 0 disables the queue."""
    queue_timeout_s: float = 5.0
    """Longest wait of a queued request (within its deadline) before RESOURCE_EXHAUSTED with a retry hint."""
    token_timeout_s: float = 60.0
    """Longest wait for the next message of a decode stream (the first one includes a local prefill and the
    decode worker's own queue); a stream silent for longer fails with UNAVAILABLE (a hung worker)."""
    max_request_bytes: int = 4 << 20
    """Largest request body: HTTP bodies (413 beyond) and gRPC messages (grpc.max_receive_message_length;
    RESOURCE_EXHAUSTED beyond, decided by grpc before the gateway sees the message)."""
    local_prefill_threshold: int = 32
    """When fewer prompt tokens than this are missing from the chosen decode worker's cache, it prefills
    them itself instead of involving a prefill worker (conditional disaggregation)."""
    idle_offload_min_tokens: int = 16
    """A prompt below local_prefill_threshold that lacks at least this many tokens still goes to a prefill worker
    when one is idle and the decode worker is decoding other requests, whose every step a local prefill would
    stall (gateway/routing.py); 0 keeps every short prompt on the decode worker."""
    lease_ms: int = 30_000
    """How long a decode worker keeps a reservation whose KV has not arrived."""
    prefill_attempts: int = 2
    """Prefill workers tried for one request before falling back to local prefill on the decode worker."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: how long in-flight requests may take to finish before the server stops."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens the gateway admits; None takes the model's max_position_embeddings.
    Set it to the workers' value when they run with a smaller context (else they refuse long prompts themselves)."""
    served_model_name: str | None = None
    """Name ListModels reports and requests may give in `model`; None uses the model file's or directory's name
    (the `model` value itself is always accepted too)."""
    routing: str = "prefix"
    """"prefix": choose workers by cached prefix and load (gateway/routing.py); "round-robin": ignore both
    (a baseline for benchmarks)."""
    quantization: str | None = None
    """The workers' weight quantization (EngineConfig.quantization): it is part of the model fingerprint they
    register, and workers whose fingerprint differs from the gateway's are ignored."""
    max_prefill_load: int = 16
    """A prefill worker whose load (running + waiting as last reported, or this gateway's own prefills in flight
    on it when more) reaches this is saturated: it is not chosen; when all are, decode workers prefill locally."""
    api_key_file: str | None = None
    """API keys (gateway.auth's file format; reloaded on SIGHUP). Every gRPC RPC and HTTP endpoint then needs
    `authorization: Bearer <key>`, except grpc.health.v1 and HTTP /health (the ops ports stay open too); each
    key's tenant namespaces the prefix cache. None: no authentication."""
    allow_unauthenticated: bool = False
    """Allow a non-loopback `host` without api_key_file (anyone who reaches the ports may use the model)."""
    tls_cert: str | None = None
    """Certificate chain (PEM) of the public gRPC port and the HTTPS API, with tls_key; None: plaintext."""
    tls_key: str | None = None
    """Private key (PEM) of tls_cert."""
    cluster_ca: str | None = None
    """CA bundle of the cluster (PEM). With cluster_cert and cluster_key: mutual TLS toward the workers, each
    connection accepting only a server certificate of the worker's role (protos.tls)."""
    cluster_cert: str | None = None
    """This gateway's certificate (PEM), issued by the cluster CA for role gateway."""
    cluster_key: str | None = None
    """Private key (PEM) of cluster_cert."""
    tool_call_parser: str = "auto"
    """How tool calls are read out of the model's output (gateway.tool_parsers): "hermes" (`<tool_call>` JSON
    blocks), "llama3_json", or "auto": chosen from the chat template (llama3_json for Llama 3.1+'s, else hermes;
    a template without a tools section gets the Hermes default tool prompt)."""
    insecure_internal: bool = False
    """Talk plaintext to the workers, on purpose (without the cluster files it is plaintext anyway, with a
    warning at start; the CLI requires one or the other)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"GatewayConfig.port must be in [0, 65535], got {self.port}")
        if not -1 <= self.http_port < 65536:
            raise ValueError(f"GatewayConfig.http_port must be in [0, 65535], or -1 for no HTTP API, "
                             f"got {self.http_port}")
        for name in ("health_port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"GatewayConfig.{name} must be None or in [0, 65535], got {value}")
        for name in ("block_size", "max_inflight", "lease_ms", "prefill_attempts", "max_prefill_load",
                     "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"GatewayConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.routing not in ("prefix", "round-robin"):
            raise ValueError(f"GatewayConfig.routing must be 'prefix' or 'round-robin', got {self.routing!r}")
        for name in ("local_prefill_threshold", "idle_offload_min_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"GatewayConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"GatewayConfig.max_model_len must be >= 2 (a prompt token and a generated one), "
                             f"got {self.max_model_len}")
        if self.max_queued < 0:
            raise ValueError(f"GatewayConfig.max_queued must be >= 0, got {self.max_queued}")
        for name in ("queue_timeout_s", "token_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GatewayConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"GatewayConfig.drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"GatewayConfig.quantization must be None or one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.tool_call_parser not in ("auto", *TOOL_CALL_PARSERS):
            raise ValueError(f"GatewayConfig.tool_call_parser must be 'auto' or one of {TOOL_CALL_PARSERS}, "
                             f"got {self.tool_call_parser!r}")
        if self.served_model_name == "":
            raise ValueError("GatewayConfig.served_model_name must be None or a non-empty name")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("GatewayConfig.tls_cert and tls_key go together: give both or neither")
        cluster = (self.cluster_ca, self.cluster_cert, self.cluster_key)
        if any(cluster) and not all(cluster):
            raise ValueError("GatewayConfig.cluster_ca, cluster_cert and cluster_key go together: give all three "
                             "or none")
        if self.insecure_internal and any(cluster):
            raise ValueError("GatewayConfig.insecure_internal excludes cluster_ca/cluster_cert/cluster_key")
        if self.api_key_file is None and not self.allow_unauthenticated and not is_loopback_host(self.host):
            raise ValueError(f"GatewayConfig.host {self.host!r} is reachable from other machines and no "
                             "api_key_file is given: give API keys, or allow_unauthenticated to serve anyone")

    @property
    def cluster_tls(self) -> TlsFiles | None:
        """The gateway's cluster TLS material, or None for plaintext toward the workers."""
        if not self.cluster_cert:
            return None
        return TlsFiles(Path(self.cluster_cert), Path(self.cluster_key), Path(self.cluster_ca))
