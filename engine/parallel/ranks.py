"""The N processes of a tensor-parallel worker and what rank 0 tells the others.

Rank 0 is the worker's own process: it owns scheduling, sampling, the gRPC service and the block accounting.
`TensorParallelGroup.start` spawns ranks 1..N-1 (multiprocessing "spawn"; the full checkpoint reaches them
through shared memory, read only), each builds its slice of the model (engine.parallel.shard) and a paged KV
cache of its own KV heads with the same number of blocks, and they join one process group (gloo on CPU, NCCL
on CUDA, rank r on cuda:(index + r)) over a FileStore in a private temporary directory.

Control plane: one pipe per rank. For every step rank 0 sends the `StepBatch` (plain lists) to each rank, then
all ranks run it; the model's all-reduces and the logits gather are the only collectives of a step. Block copies
(an n > 1 request's forked prompt block) run on every rank the same way, without a collective. The ranks idle
in a blocking read of their pipe, never inside a collective, so an idle worker never times out.

KV transfer follows the re-sharding plan (kvstore.reshard_plan), point to point over the group:
    sending    `gather_kv`: each rank whose heads are first held by it sends exactly those heads of the blocks to
               rank 0 (a rank holding only replicas sends nothing); rank 0 pushes them as the payload's slices
    receiving  `scatter_kv`: rank 0 cuts each rank's own heads out of the payload slices, as the plan's slices to
               that rank say (a head replicated on several ranks, received once, goes to each), and sends them
Rank 0 is the one end of the KV transfer service: the payload passes through it (the rank-to-rank route
without it, each rank reading and writing its own slice, is not built).

Failure (never a hang):
- every collective has the group's timeout (EngineConfig.tensor_parallel_timeout_s): a rank that stops
  answering fails the collective on the others after at most that long; a rank that dies fails it at once
  (its sockets close);
- rank 0 checks its ranks are alive before each operation; any failure raises `TensorParallelError`, after
  which the group is closed (the other ranks are told to exit, then terminated) and every later operation
  raises it again: the worker must exit (the engine loop's fatal path);
- a rank whose pipe reaches end-of-file (rank 0 died) or whose collective fails exits with status 1;
- the start is bounded by _STARTUP_TIMEOUT_S (the rendezvous, each rank's model build), and a rank that exits
  during it fails the start at once with TensorParallelError.
Operations are serialized by one lock, so the engine loop and the KV transfer threads never interleave
collectives.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import EngineConfig, ModelConfig
from engine.parallel.shard import RankShard, build_rank_model
from engine.step_batch import StepBatch, copy_blocks, run_step
from kvstore.malloc_tuning import keep_freed_memory_for_reuse
from kvstore.reshard_plan import KvReshardPlan, payload_slices
from kvstore.transfer import DecodedBlocks
from kvstore.transfer_slices import KvSlices, merge_slices, take_heads

log = logging.getLogger(__name__)

__all__ = ["TensorParallelError", "TensorParallelGroup", "rank_device"]

_STARTUP_TIMEOUT_S = 600.0
"""Longest rank 0 waits for a rank to build its model (loads on a busy CPU are slow)."""


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel worker died, timed out in a collective or failed a step: the worker cannot
    go on and must exit (module docstring)."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank`: CUDA ranks take consecutive devices from the configured one; CPU ranks share it."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _make_group(device: torch.device, store_path: str, rank: int, size: int,
                timeout: datetime.timedelta) -> dist.ProcessGroup:
    """Join the ranks' process group: the rendezvous may wait _STARTUP_TIMEOUT_S (ranks start slowly on a busy
    machine), every collective after it at most `timeout`."""
    store = dist.FileStore(store_path, size)
    startup = max(timeout, datetime.timedelta(seconds=_STARTUP_TIMEOUT_S))
    store.set_timeout(startup)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = startup
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, startup)
    group.set_timeout(timeout)
    return group


@dataclass(frozen=True)
class _RankSpec:
    """What a rank process needs besides the weights."""

    engine_config: EngineConfig
    model_config: ModelConfig
    shards: tuple[RankShard, ...]
    max_model_len: int
    num_blocks: int
    dtype: torch.dtype
    store_path: str


def _new_kv_cache(spec: _RankSpec, rank: int, device: torch.device) -> torch.Tensor:
    c = spec.model_config
    # Zeroed for the reason ModelRunner gives. [L, 2, num_blocks, block_size, this rank's kv_heads, head_dim]
    return torch.zeros(c.num_layers, 2, spec.num_blocks, spec.engine_config.block_size,
                       len(spec.shards[rank].heads.kv_heads), c.head_dim, dtype=spec.dtype, device=device)


_KV_TAG = 0
"""Tag of the KV transfer's point-to-point messages (the only ones)."""


def _rank_kv_heads(shards: tuple[RankShard, ...]) -> tuple[range, ...]:
    return tuple(s.heads.kv_heads for s in shards)


def _blocks_of_heads(kv_cache: torch.Tensor, block_ids: list[int], own: range, heads: range) -> torch.Tensor:
    """Blocks `block_ids` of global KV heads `heads` from a rank cache holding heads `own`:
    [L, 2, n, block_size, len(heads), D], contiguous."""
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    # kv_cache: [L, 2, num_blocks, block_size, this rank's kv heads, D]
    return kv_cache.index_select(2, ids)[:, :, :, :, heads.start - own.start:heads.stop - own.start].contiguous()


def _rank_main(rank: int, spec: _RankSpec, weights: dict[str, torch.Tensor],
               conn: multiprocessing.connection.Connection) -> None:
    """Body of rank `rank` >= 1: build, report ready, then run what rank 0 sends until told to stop."""
    keep_freed_memory_for_reuse()  # first, as rank 0's engine does (kvstore.malloc_tuning)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    config = spec.engine_config
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = rank_device(torch.device(config.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        group = _make_group(device, spec.store_path, rank, len(spec.shards),
                            datetime.timedelta(seconds=config.tensor_parallel_timeout_s))
        model = build_rank_model(spec.model_config, weights, spec.dtype, device, spec.max_model_len,
                                 config.quantization, spec.shards, rank, group)
        del weights
        kv_cache = _new_kv_cache(spec, rank, device)
        own = spec.shards[rank].heads.kv_heads
        sent = next((w.kv_heads for w in payload_slices(_rank_kv_heads(spec.shards)) if w.src_rank == rank), None)
        conn.send("ready")
        while True:
            try:
                message = conn.recv()
            except EOFError:  # rank 0 is gone
                log.error("rank 0 closed the pipe; exiting")
                sys.exit(1)
            if message is None:
                return
            op, payload = message
            with torch.inference_mode():
                if op == "step":
                    run_step(model, kv_cache, payload, device)
                elif op == "copy_blocks":
                    copy_blocks(kv_cache, payload)
                elif op == "gather_kv":
                    if sent is not None:
                        group.send([_blocks_of_heads(kv_cache, payload, own, sent)], 0, _KV_TAG).wait()
                elif op == "scatter_kv":
                    c = spec.model_config
                    # part: [L, 2, n, block_size, this rank's kv heads, D]
                    part = torch.empty(c.num_layers, 2, len(payload), config.block_size, len(own), c.head_dim,
                                       dtype=spec.dtype, device=device)
                    group.recv([part], 0, _KV_TAG).wait()
                    kv_cache.index_copy_(2, torch.tensor(payload, dtype=torch.int64, device=device), part)
                else:
                    raise ValueError(f"unknown tensor-parallel operation {op!r}")
    except Exception:
        log.exception("tensor-parallel rank %d failed; exiting", rank)
        sys.exit(1)


def _rendezvous(processes: list, make_group) -> dist.ProcessGroup:
    """`make_group()` (which waits for every rank to join) on a helper thread, failing as soon as a rank exits
    before it joined: the wait itself cannot be interrupted, so the thread is left to time out on its own."""
    made: dict = {}

    def run() -> None:
        try:
            made["group"] = make_group()
        except BaseException as exc:  # noqa: BLE001  (re-raised on the starting thread)
            made["error"] = exc

    thread = threading.Thread(target=run, name="tp-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        for rank, process in enumerate(processes, start=1):
            if process.exitcode is not None and thread.is_alive():
                raise TensorParallelError(f"rank {rank} exited with status {process.exitcode} before joining "
                                          "the process group")
    if "error" in made:
        raise TensorParallelError(f"the ranks did not join: {made['error']}") from made["error"]
    return made["group"]


class TensorParallelGroup:
    """Rank 0's handle on ranks 1..N-1 (module docstring). Build with `start`; `close` ends them."""

    def __init__(self, shards: tuple[RankShard, ...], group: dist.ProcessGroup,
                 processes: list, conns: list, store_dir: str) -> None:
        self.shards = shards
        self.group = group
        self._processes = processes
        self._conns = conns
        self._store_dir = store_dir
        self._lock = threading.Lock()
        self._failed: str | None = None
        self.num_kv_bytes_moved = 0
        """KV bytes gather_kv brought from ranks 1..N-1 and scatter_kv sent them (the plan's slices)."""

    @property
    def size(self) -> int:
        return len(self.shards)

    @classmethod
    def start(cls, engine_config: EngineConfig, model_config: ModelConfig, weights: dict[str, torch.Tensor],
              shards: tuple[RankShard, ...], max_model_len: int, num_blocks: int,
              dtype: torch.dtype) -> TensorParallelGroup:
        """Spawn ranks 1..N-1 and join them in a process group; they build their slices while the caller
        builds rank 0's (call `wait_ready` after)."""
        device = torch.device(engine_config.device)
        store_dir = tempfile.mkdtemp(prefix="pdserve-tp-")
        spec = _RankSpec(engine_config, model_config, shards, max_model_len, num_blocks, dtype,
                         os.path.join(store_dir, "store"))
        ctx = mp.get_context("spawn")
        processes, conns = [], []
        try:
            for rank in range(1, len(shards)):
                parent, child = ctx.Pipe()
                process = ctx.Process(target=_rank_main, args=(rank, spec, weights, child), daemon=True,
                                      name=f"tp-rank-{rank}")
                process.start()
                child.close()
                processes.append(process)
                conns.append(parent)
            group = _rendezvous(processes, lambda: _make_group(
                rank_device(device, 0), spec.store_path, 0, len(shards),
                datetime.timedelta(seconds=engine_config.tensor_parallel_timeout_s)))
        except BaseException:
            for process in processes:
                process.terminate()
            shutil.rmtree(store_dir, ignore_errors=True)
            raise
        return cls(shards, group, processes, conns, store_dir)

    def wait_ready(self) -> None:
        """Block until every rank has built its slice; TensorParallelError if one fails first."""
        for rank, (process, conn) in enumerate(zip(self._processes, self._conns), start=1):
            with self._failing(f"rank {rank} did not start"):
                if not conn.poll(_STARTUP_TIMEOUT_S):
                    raise TimeoutError(f"no answer within {_STARTUP_TIMEOUT_S:.0f} s")
                if conn.recv() != "ready":
                    raise RuntimeError("unexpected message")
        log.info("tensor parallelism: %d ranks ready", self.size)

    @contextlib.contextmanager
    def _failing(self, what: str):
        """Turn any error into TensorParallelError and close the group."""
        try:
            yield
        except TensorParallelError:
            raise
        except BaseException as exc:
            self._failed = f"{what}: {type(exc).__name__}: {exc}"
            log.error("tensor parallelism failed: %s", self._failed)
            self.close()
            raise TensorParallelError(self._failed) from exc

    @contextlib.contextmanager
    def operation(self, op: str, payload):
        """Tell every rank to run `op` on `payload`, then run rank 0's side inside the block (serialized)."""
        with self._lock, self._failing(f"tensor-parallel {op}"):
            if self._failed is not None:
                raise TensorParallelError(self._failed)
            for rank, process in enumerate(self._processes, start=1):
                if not process.is_alive():
                    raise RuntimeError(f"rank {rank} exited with status {process.exitcode}")
            for conn in self._conns:
                conn.send((op, payload))
            yield

    def run_step(self, model, kv_cache: torch.Tensor, batch: StepBatch, device: torch.device):
        """run_step on every rank; rank 0's result (engine.step_batch.run_step)."""
        with self.operation("step", batch):
            return run_step(model, kv_cache, batch, device)

    def copy_blocks(self, kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """engine.step_batch.copy_blocks on every rank."""
        with self.operation("copy_blocks", list(pairs)):
            copy_blocks(kv_cache, pairs)

    @property
    def rank_kv_heads(self) -> tuple[range, ...]:
        """Each rank's KV heads (global ids), rank by rank."""
        return _rank_kv_heads(self.shards)

    def gather_kv(self, kv_cache: torch.Tensor, block_ids: list[int]) -> KvSlices:
        """Blocks `block_ids` as the KV payload's slices (kvstore.reshard_plan): each head once, from the first
        rank holding it; rank 0's slice from its own cache, the others sent by their ranks."""
        block_ids = list(block_ids)
        c = kv_cache.shape  # [L, 2, num_blocks, block_size, rank 0's kv heads, D]
        if not block_ids:  # nothing to send (the receiver has every block): no rank is involved
            return KvSlices(self.rank_kv_heads, tuple(kv_cache.new_empty(c[0], 2, 0, c[3], len(w.kv_heads), c[5])
                                                      for w in payload_slices(self.rank_kv_heads)))
        caches = []
        with self.operation("gather_kv", block_ids), torch.inference_mode():
            for wire in payload_slices(self.rank_kv_heads):
                if wire.src_rank == 0:
                    caches.append(_blocks_of_heads(kv_cache, block_ids, self.rank_kv_heads[0], wire.kv_heads))
                    continue
                part = torch.empty(c[0], 2, len(block_ids), c[3], len(wire.kv_heads), c[5], dtype=kv_cache.dtype,
                                   device=kv_cache.device)  # [L, 2, n, block_size, the slice's heads, D]
                self.group.recv([part], wire.src_rank, _KV_TAG).wait()
                self.num_kv_bytes_moved += part.numel() * part.element_size()
                caches.append(part)
        return KvSlices(self.rank_kv_heads, tuple(caches))

    def scatter_kv(self, kv_cache: torch.Tensor, block_ids: list[int], plan: KvReshardPlan,
                   slices: tuple[tuple[range, DecodedBlocks], ...]) -> None:
        """Write the received payload `slices` into blocks `block_ids` of every rank's cache, each rank taking
        its own heads as the plan's slices to it say."""
        if plan.dst_kv_heads != self.rank_kv_heads:
            raise ValueError(f"plan for receiving ranks {plan.dst_kv_heads}, these hold {self.rank_kv_heads}")
        block_ids = list(block_ids)
        if not block_ids:
            return
        c = kv_cache.shape
        parts = []
        for rank, heads in enumerate(self.rank_kv_heads):
            mine = merge_slices([(s.kv_heads, take_heads(slices, s.kv_heads)) for s in plan.slices_to(rank)])
            part = torch.empty(c[0], 2, len(block_ids), c[3], len(heads), c[5], dtype=kv_cache.dtype,
                               device=kv_cache.device)  # [L, 2, n, block_size, the rank's kv heads, D]
            mine.scatter_into(part, range(len(block_ids)))
            parts.append(part)
        with self.operation("scatter_kv", block_ids), torch.inference_mode():
            kv_cache.index_copy_(2, torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device), parts[0])
            for rank, part in enumerate(parts[1:], start=1):
                self.group.send([part], rank, _KV_TAG).wait()
                self.num_kv_bytes_moved += part.numel() * part.element_size()

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the ranks to exit, terminate (then kill) those that do not within `timeout_s` (1 s after a
        failure: a rank may be stuck); idempotent."""
        if self._failed is not None:
            timeout_s = min(timeout_s, 1.0)
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        for process in self._processes:
            process.join(timeout_s)
            if process.is_alive():
                process.terminate()
                process.join(timeout_s)
            if process.is_alive():  # a stopped process keeps SIGTERM pending
                process.kill()
                process.join(timeout_s)
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._processes = []
        shutil.rmtree(self._store_dir, ignore_errors=True)
        if self._failed is None:
            self._failed = "the tensor-parallel group is closed"
