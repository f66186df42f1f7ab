"""The types every prefix index shares (kvstore.index.PrefixIndex is the one implementation, on Redis).

- ``register`` starts a new epoch for the worker (1, 2, ...); entries of older epochs never count.
- ``publish(worker_id, epoch, events)`` applies the events in order and returns the worker's
  epoch afterwards: ``AllBlocksCleared`` starts a new epoch (all of the worker's entries stop
  counting at once). A missing or superseded worker raises ``WorkerNotRegistered``: the caller
  must register again and re-publish its full cached set.
- ``match`` returns every live worker of the role, sorted by worker_id, with the number of LEADING
  prompt blocks it holds (counting stops at its first miss).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

ROLES = ("prefill", "decode")
_WORKER_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,200}")


class WorkerNotRegistered(Exception):
    """The worker's record is missing (expired, deregistered, index restarted) or its epoch is superseded."""


@dataclass(frozen=True)
class WorkerInfo:
    """A worker as the index knows it: who it is, where to reach it, what it serves, and its load as of its last
    heartbeat. Serialized in one place, kvstore.index (`worker_to_record` / `worker_from_record`)."""
    worker_id: str                  # unique and stable across restarts, e.g. "decode-0"; [A-Za-z0-9._:-]
    role: str                       # "prefill" or "decode"
    grpc_endpoint: str = ""         # host:port of its gRPC services, e.g. "10.0.0.5:50061"; "" when unset
    epoch: int = 0                  # assigned by register(); 0 before that
    capacity_blocks: int = 0        # KV blocks in the worker's pool
    free_blocks: int = 0            # blocks with ref_count 0 (cached-but-evictable included)
    running: int = 0                # sequences in the running batch
    waiting: int = 0                # sequences queued
    block_size: int = 0             # KV block size in tokens (0: not reported)
    fingerprint: str = ""           # model fingerprint (engine.quant.quantized_fingerprint); "" when unknown
    max_model_len: int = 0          # longest prompt + completion its KV cache holds (0: not reported)
    host_id: str = ""               # identifies the host (same-host peers may use shared memory)

    def __post_init__(self) -> None:
        if not _WORKER_ID_RE.fullmatch(self.worker_id):
            raise ValueError(f"worker_id must match {_WORKER_ID_RE.pattern}, got {self.worker_id!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


@dataclass(frozen=True)
class PrefixMatch:
    """One live worker and how many leading blocks of the looked-up prompt it holds."""
    worker: WorkerInfo
    num_cached_blocks: int
