"""Prefill worker configuration (frozen, validated; the engine's own knobs are in engine.config.EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

TRANSPORTS = ("auto", "grpc", "shm")
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
    worker_ttl_s: float = 10.0
    """Registration TTL in the index; heartbeats refresh it every third of it."""
    fault_corrupt_transfers: int = 0
    """Fault injection for tests: flip a byte in the first data chunk of this many transfers, after their
    digests were computed, so the receiver must reject them. 0 in production."""

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("PrefillWorkerConfig.worker_id must not be empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"PrefillWorkerConfig.port must be in [0, 65535], got {self.port}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"PrefillWorkerConfig.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.codec not in CODECS:
            raise ValueError(f"PrefillWorkerConfig.codec must be one of {CODECS}, got {self.codec!r}")
        if not 1 << 20 <= self.chunk_bytes <= 4 << 20:
            raise ValueError(f"PrefillWorkerConfig.chunk_bytes must be in [1 MiB, 4 MiB], got {self.chunk_bytes}")
        if self.fault_corrupt_transfers < 0:
            raise ValueError("PrefillWorkerConfig.fault_corrupt_transfers must be >= 0")
        if self.worker_ttl_s <= 0:
            raise ValueError("PrefillWorkerConfig.worker_ttl_s must be positive")
