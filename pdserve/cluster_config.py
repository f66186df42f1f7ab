"""`LocalClusterConfig`: what `pdserve up` starts. Its own module so that the CLI's flags (`cli_args`) and the
launcher that starts the processes both depend on it, and neither on the other."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from prefill_worker.config import CODECS, TRANSPORTS


@dataclass(frozen=True)
class LocalClusterConfig:
    """What `pdserve up` starts."""

    num_prefill: int = 1
    """Prefill worker processes (0: every prompt is prefilled on its decode worker)."""
    num_decode: int = 1
    """Decode worker processes."""
    host: str = "127.0.0.1"
    """Address the gateway binds (workers and Redis always bind 127.0.0.1)."""
    port: int = 50051
    """Port of the gateway's public gRPC API (0 picks a free one)."""
    http_port: int = 8000
    """Port of the gateway's OpenAI-compatible HTTP API (0 picks a free one, -1 turns it off)."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model="default"))
    """Engine of every worker. When its num_threads is None, the CPUs are divided among the workers."""
    prefill_kv_cache_memory: int | None = None
    """KV-cache bytes of each prefill worker; None takes engine.kv_cache_memory. A prefill worker holds only the
    prompts it is computing plus the prefixes it keeps for reuse; a decode worker holds every running sequence."""
    prefill_tensor_parallel_size: int | None = None
    """Ranks of each prefill worker; None takes engine.tensor_parallel_size."""
    decode_tensor_parallel_size: int | None = None
    """Ranks of each decode worker; None takes engine.tensor_parallel_size. The pools may differ: KV moves between
    them with every head once on the wire (kvstore.reshard_plan)."""
    transport: str = "auto"
    """KV transport of the prefill workers (see PrefillWorkerConfig.transport)."""
    codec: str = "raw"
    """KV wire codec of the prefill workers (see PrefillWorkerConfig.codec)."""
    gateway_args: tuple[str, ...] = ()
    """Extra `pdserve gateway` flags, e.g. ("--local-prefill-threshold", "0")."""
    redis_url: str | None = None
    """Use this Redis instead of starting an embedded redis-server. Either URL reaches the processes in their
    environment (PDSERVE_REDIS_URL), never on their command lines, which every local user can read."""
    run_dir: str | None = None
    """Directory for the processes' logs (kept); None uses a temporary one, removed after a clean stop."""
    num_cpus: int | None = None
    """CPUs to divide among the workers; None counts those this process may run on."""
    pin_workers: bool = False
    """Pin each worker process to CPUs of its own (pdserve.affinity): the first `num_cpus` of the CPUs this
    process may run on, in consecutive slices of each worker's thread count, prefill workers first. Off: workers
    float over every CPU (the kernel's scheduler places their threads)."""
    lend_idle_cpus: bool = False
    """With pin_workers: prefill worker i and decode worker i (i < min(num_prefill, num_decode)) each also step on
    the other's CPUs while the other's engine is idle, a step at a time (engine.cpu_share); neither waits."""
    start_timeout_s: float = 600.0
    """Bound on the whole start (loading the model included)."""
    stop_timeout_s: float = 20.0
    """How long each stage of the stop waits after SIGTERM before SIGKILL."""
    restart_workers: bool = False
    """Restart a worker process that exits while the cluster runs (same id, port and flags; after a backoff that
    doubles while it keeps failing). Off: a dead worker is reported and the cluster serves on the others until no
    decode worker is left. The embedded Redis is always restarted, on the same port."""

    insecure_internal: bool = False
    """Run every process plaintext inside the cluster (workers on loopback, no certificates; logged as a
    warning). Off: a cluster CA is made per run in the run directory and each process gets its certificate."""
    api_key_file: str | None = None
    """The gateway's API key file (gateway.auth's format); `--once` sends its first key."""
    allow_unauthenticated: bool = False
    """Let the gateway serve a non-loopback `host` without api_key_file."""
    tls: bool = False
    """Serve the gateway's public gRPC port and HTTPS with a certificate made for the run (<run dir>/pki/public.pem
    for localhost, 127.0.0.1 and `host`, from a CA of its own: public-ca.pem, which `--once` verifies it with)."""
    tls_cert: str | None = None
    """Certificate chain (PEM) of the gateway's public gRPC port and HTTPS, with tls_key; None: plaintext (or
    the run's own with `tls`)."""
    tls_key: str | None = None
    """Private key (PEM) of tls_cert."""
    ca_cert: str | None = None
    """CA bundle (PEM) the launcher's own calls to the gateway (health, `--once`) verify tls_cert with; None:
    the system's roots."""

    def tensor_parallel_size(self, role: str) -> int:
        """Ranks of each worker of `role` ("prefill" or "decode")."""
        own = self.prefill_tensor_parallel_size if role == "prefill" else self.decode_tensor_parallel_size
        return own if own is not None else self.engine.tensor_parallel_size

    def __post_init__(self) -> None:
        if self.num_prefill < 0:
            raise ValueError(f"LocalClusterConfig.num_prefill must be >= 0, got {self.num_prefill}")
        if self.num_decode < 1:
            raise ValueError(f"LocalClusterConfig.num_decode must be >= 1, got {self.num_decode}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"LocalClusterConfig.port must be in [0, 65535], got {self.port}")
        if not -1 <= self.http_port < 65536:
            raise ValueError(f"LocalClusterConfig.http_port must be in [0, 65535], or -1 for no HTTP API, "
                             f"got {self.http_port}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"LocalClusterConfig.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.codec not in CODECS:
            raise ValueError(f"LocalClusterConfig.codec must be one of {CODECS}, got {self.codec!r}")
        if self.prefill_kv_cache_memory is not None and self.prefill_kv_cache_memory < 1:
            raise ValueError(f"LocalClusterConfig.prefill_kv_cache_memory must be >= 1 byte, "
                             f"got {self.prefill_kv_cache_memory}")
        for name in ("prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"LocalClusterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"LocalClusterConfig.num_cpus must be >= 1, got {self.num_cpus}")
        if self.pin_workers and (self.engine.tensor_parallel_size != 1 or self.prefill_tensor_parallel_size
                                 not in (None, 1) or self.decode_tensor_parallel_size not in (None, 1)):
            raise ValueError("LocalClusterConfig.pin_workers is not supported with tensor parallelism")
        if self.lend_idle_cpus and not self.pin_workers:
            raise ValueError("LocalClusterConfig.lend_idle_cpus lends pinned CPUs: it needs pin_workers")
        if self.lend_idle_cpus and self.num_prefill < 1:
            raise ValueError("LocalClusterConfig.lend_idle_cpus pairs prefill worker i with decode worker i: it "
                             "needs num_prefill >= 1 (with no prefill worker nothing would lend)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("LocalClusterConfig.tls_cert and tls_key go together: give both or neither")
        if self.tls and self.tls_cert is not None:
            raise ValueError("LocalClusterConfig.tls makes a certificate and tls_cert gives one: not both")
        if self.ca_cert is not None and self.tls_cert is None:
            raise ValueError("LocalClusterConfig.ca_cert verifies tls_cert: give tls_cert and tls_key too")
        if self.start_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("LocalClusterConfig.start_timeout_s and stop_timeout_s must be positive")

