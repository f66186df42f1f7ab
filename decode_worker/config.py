"""Decode worker configuration (frozen, validated; the engine's own knobs are in engine.config.EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("DecodeWorkerConfig.worker_id must not be empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"DecodeWorkerConfig.port must be in [0, 65535], got {self.port}")
        if self.max_lease_ms < 1 or self.worker_ttl_s <= 0:
            raise ValueError("DecodeWorkerConfig.max_lease_ms and worker_ttl_s must be positive")
