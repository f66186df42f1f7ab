"""Prefill worker configuration (frozen, validated; the engine's own knobs are in engine.config.EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protos.tls import TlsFiles

TRANSPORTS = ("auto", "grpc", "shm")
MIN_POOL_BYTES = (4 << 20) + 4096
"""The smallest useful segment pool: one segment of the smallest size (kvstore.shm_pool)."""
CODECS = ("raw", "int8")


@dataclass(frozen=True)
class PrefillWorkerConfig:
    worker_id: str
    """Id in the prefix index; unique in the deployment."""
    redis_url: str | None
    """Prefix index to register in; None runs unregistered (tests, single-node use)."""
    host: str = "127.0.0.1"
    """Address the gRPC server binds."""
    port: int = 0
    """Port (0 picks a free one; the chosen port is registered)."""
    advertise_host: str | None = None
    """Host other processes use to reach this worker; None advertises `host`."""
    transport: str = "auto"
    """KV data path: "shm" (same host only), "grpc", or "auto" (shm when the decode worker reports this
    host's id, grpc otherwise). The choice is explicit and reported per request; never a silent fallback."""
    codec: str = "raw"
    """KV wire format: "raw" (cache dtype) or "int8" (halves bytes or better, lossy)."""
    chunk_bytes: int = 2 << 20
    """Payload bytes per gRPC message on the grpc transport (1-4 MiB)."""
    shm_pool_bytes: int = 1 << 30
    """Bound of the pool of pre-faulted shared-memory segments the shm transport gathers KV into and reuses
    (kvstore.shm_pool; segments are made on demand, each a power of two >= 4 MiB plus a page). 0: a fresh
    segment per transfer (every transfer pays the page faults)."""
    worker_ttl_s: float = 10.0
    """Registration TTL in the index; heartbeats refresh it every third of it."""
    health_port: int | None = None
    """Plaintext port serving only grpc.health.v1, with the main port's status (for the kubelet's gRPC probes
    when the main port is mutual TLS); None: none. Bound on `host`; 0 picks a free one."""
    metrics_port: int | None = None
    """HTTP port of Prometheus GET /metrics (protos.worker_metrics); None: none. Bound on `host`."""
    drain_timeout_s: float = 15.0
    """On SIGTERM: how long requests already taken may take to finish once the worker left the index and
    refuses new ones; what is left then ends with UNAVAILABLE (below `pdserve up`'s 20 s stop timeout)."""
    borrow_cpus: tuple[int, ...] = ()
    """CPUs of a decode worker this worker also steps on while that worker is idle (engine.cpu_share), one torch
    thread per CPU; with borrow_lock. Empty: only its own CPUs."""
    borrow_lock: str | None = None
    """That decode worker's busy_lock file."""
    busy_lock: str | None = None
    """A file this worker holds an exclusive flock on while its engine has work, so that a decode worker
    borrowing its CPUs (DecodeWorkerConfig.borrow_lock) steps on them only while it is idle. None: no lock."""
    fault_corrupt_transfers: int = 0
    """Fault injection for tests: flip a byte in the first data chunk of this many transfers, after their
    digests were computed, so the receiver must reject them. 0 in production."""

    cluster_ca: str | None = None
    """CA bundle of the cluster (PEM path). With cluster_cert and cluster_key: the port is mutual TLS (only
    gateways call Prefill/Abort) and KV goes only to servers holding a decode certificate of this CA."""
    cluster_cert: str | None = None
    """This worker's certificate (PEM path), issued by the cluster CA for role prefill."""
    cluster_key: str | None = None
    """This worker's private key (PEM path)."""
    insecure_internal: bool = False
    """Serve and push plaintext, on purpose (anyone who reaches the port may call anything). Without TLS files
    the port is plaintext too (logged as a warning); the CLI requires one or the other explicitly."""
    decode_endpoints: tuple[str, ...] = ()
    """Decode workers (host:port) an unregistered worker (no redis_url) may push KV to; a registered one
    pushes only to live decode workers of its index."""

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("PrefillWorkerConfig.worker_id must not be empty")
        tls = (self.cluster_ca, self.cluster_cert, self.cluster_key)
        if any(tls) and not all(tls):
            raise ValueError("PrefillWorkerConfig.cluster_ca, cluster_cert and cluster_key go together: give all "
                             "three or none")
        if self.insecure_internal and any(tls):
            raise ValueError("PrefillWorkerConfig.insecure_internal excludes cluster_ca/cluster_cert/cluster_key")
        object.__setattr__(self, "decode_endpoints", tuple(self.decode_endpoints))
        object.__setattr__(self, "borrow_cpus", tuple(self.borrow_cpus))
        if bool(self.borrow_cpus) != bool(self.borrow_lock):
            raise ValueError("PrefillWorkerConfig.borrow_cpus and borrow_lock go together: give both or neither")
        if not 0 <= self.port < 65536:
            raise ValueError(f"PrefillWorkerConfig.port must be in [0, 65535], got {self.port}")
        for name in ("health_port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"PrefillWorkerConfig.{name} must be None or in [0, 65535], got {value}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"PrefillWorkerConfig.drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"PrefillWorkerConfig.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.codec not in CODECS:
            raise ValueError(f"PrefillWorkerConfig.codec must be one of {CODECS}, got {self.codec!r}")
        if not 1 << 20 <= self.chunk_bytes <= 4 << 20:
            raise ValueError(f"PrefillWorkerConfig.chunk_bytes must be in [1 MiB, 4 MiB], got {self.chunk_bytes}")
        if self.shm_pool_bytes and self.shm_pool_bytes < MIN_POOL_BYTES:
            raise ValueError(f"PrefillWorkerConfig.shm_pool_bytes must be 0 or >= {MIN_POOL_BYTES}, got "
                             f"{self.shm_pool_bytes}")
        if self.fault_corrupt_transfers < 0:
            raise ValueError("PrefillWorkerConfig.fault_corrupt_transfers must be >= 0")
        if self.worker_ttl_s <= 0:
            raise ValueError("PrefillWorkerConfig.worker_ttl_s must be positive")

    @property
    def tls_files(self) -> TlsFiles | None:
        """The cluster TLS material, or None for plaintext."""
        if not self.cluster_cert:
            return None
        return TlsFiles(Path(self.cluster_cert), Path(self.cluster_key), Path(self.cluster_ca))
