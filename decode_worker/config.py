"""Decode worker configuration (frozen, validated; the engine's own knobs are in engine.config.EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protos.tls import TlsFiles

VERIFY_KV_MODES = ("off", "sample", "full")


@dataclass(frozen=True)
class DecodeWorkerConfig:
    worker_id: str
    """Id in the prefix index; unique in the deployment."""
    redis_url: str | None
    """Prefix index to register in; None runs unregistered (tests, single-node use)."""
    host: str = "127.0.0.1"
    """Address the gRPC server binds (DecodeWorker, KvTransfer, health and reflection on one port)."""
    port: int = 0
    """Port (0 picks a free one; the chosen port is registered)."""
    advertise_host: str | None = None
    """Host other processes use to reach this worker; None advertises `host`."""
    max_lease_ms: int = 60_000
    """Upper bound of a reservation's lease, whatever the gateway asks."""
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
    cluster_ca: str | None = None
    """CA bundle of the cluster (PEM path). With cluster_cert and cluster_key: the port is mutual TLS and
    the role table holds (only gateways Reserve/Decode/Abort, only prefill workers Push)."""
    cluster_cert: str | None = None
    """This worker's certificate (PEM path), issued by the cluster CA for role decode."""
    cluster_key: str | None = None
    """This worker's private key (PEM path)."""
    insecure_internal: bool = False
    """Serve plaintext, on purpose: anyone who reaches the port may call anything, and KV any caller pushes
    enters the prefix cache (the operator trusts the network). Without TLS files and without this the port
    is plaintext too (logged as a warning) but received KV never enters the prefix cache; the CLI requires
    TLS files or this flag explicitly."""
    verify_kv: str = "off"
    """Check received KV against a recomputation before decoding on it: "off"; "sample" (layer 0's K/V of a
    few received blocks); "full" (every layer of every received block: the whole prompt recomputed here)."""
    busy_lock: str | None = None
    """A file this worker holds an exclusive flock on while its engine has work, so that a prefill worker
    borrowing its CPUs (PrefillWorkerConfig.borrow_lock) steps on them only while it is idle (engine.cpu_share).
    None: no lock."""
    borrow_cpus: tuple[int, ...] = ()
    """CPUs of a prefill worker this worker also steps on while that worker is idle (engine.cpu_share), one torch
    thread per CPU; with borrow_lock. Empty: only its own CPUs."""
    borrow_lock: str | None = None
    """That prefill worker's busy_lock file."""
    max_reserved_fraction_per_caller: float = 0.5
    """Share of the KV pool one caller may hold in reservations whose KV has not been committed; beyond it
    Reserve answers RESOURCE_EXHAUSTED with a retry hint. Committed and running requests do not count."""

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("DecodeWorkerConfig.worker_id must not be empty")
        tls = (self.cluster_ca, self.cluster_cert, self.cluster_key)
        if any(tls) and not all(tls):
            raise ValueError("DecodeWorkerConfig.cluster_ca, cluster_cert and cluster_key go together: give all "
                             "three or none")
        if self.insecure_internal and any(tls):
            raise ValueError("DecodeWorkerConfig.insecure_internal excludes cluster_ca/cluster_cert/cluster_key")
        object.__setattr__(self, "borrow_cpus", tuple(self.borrow_cpus))
        if bool(self.borrow_cpus) != bool(self.borrow_lock):
            raise ValueError("DecodeWorkerConfig.borrow_cpus and borrow_lock go together: give both or neither")
        if self.verify_kv not in VERIFY_KV_MODES:
            raise ValueError(f"DecodeWorkerConfig.verify_kv must be one of {VERIFY_KV_MODES}, got {self.verify_kv!r}")
        if not 0 < self.max_reserved_fraction_per_caller <= 1:
            raise ValueError("DecodeWorkerConfig.max_reserved_fraction_per_caller must be in (0, 1], got "
                             f"{self.max_reserved_fraction_per_caller}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"DecodeWorkerConfig.port must be in [0, 65535], got {self.port}")
        for name in ("health_port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"DecodeWorkerConfig.{name} must be None or in [0, 65535], got {value}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"DecodeWorkerConfig.drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.max_lease_ms < 1 or self.worker_ttl_s <= 0:
            raise ValueError("DecodeWorkerConfig.max_lease_ms and worker_ttl_s must be positive")

    @property
    def tls_files(self) -> TlsFiles | None:
        """The cluster TLS material, or None for a plaintext port."""
        if not self.cluster_cert:
            return None
        return TlsFiles(Path(self.cluster_cert), Path(self.cluster_key), Path(self.cluster_ca))
