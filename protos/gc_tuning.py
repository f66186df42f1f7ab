"""Python's cyclic garbage collector in a serving process (gateway, prefill or decode worker): off while the
process starts, then the heap it started with frozen.

A full (generation-2) collection walks every object the collector tracks, stopping every thread that needs the
GIL: a worker holds ~230,000 of them once torch, grpc and the model's modules are loaded, and one such walk took
~100 ms on a 2-core AMD EPYC, 8 of them while a worker started (bench/bench_gc.py). What a server loads at start
it keeps until it exits, so those walks find nothing to free.

    pause_collection()     first thing in a server command (`pdserve gateway | prefill-worker | decode-worker`):
                           the collector stays off while it imports and loads the model; reference counting
                           still frees everything that is not in a cycle
    freeze_startup_heap()  once it has loaded what it keeps (a worker's engine, the gateway's tokenizer), before its
                           servers start, so that no request waits for it: one collection (the start's cyclic
                           garbage), then gc.freeze() moves every object left into the permanent generation, which
                           no later collection walks, and the collector back on, at Python's thresholds, for the
                           objects the servers and requests make

A frozen object is still freed when its reference count drops to zero; only a cycle among frozen objects stays
until exit (the start's own cycles were collected just before). Every server entry point (`serve`) calls
freeze_startup_heap, paused or not; embedding code that starts a server otherwise (tests, `start_server`) keeps
its collector as it was.

`register_process_collectors` gives a gateway's or worker's own registry what prometheus_client's default one
has: process_* (CPU seconds, resident memory, open file descriptors, start time) and python_gc_* (collections
and objects collected per generation), and beside them pdserve_gc_frozen_objects, how many objects were frozen.
"""

from __future__ import annotations

import gc
import logging
import time

from prometheus_client import GCCollector, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger(__name__)


def pause_collection() -> None:
    """Turn the cyclic collector off until freeze_startup_heap."""
    gc.disable()


def freeze_startup_heap() -> int:
    """Collect once, freeze every object left and turn the collector on; returns how many objects are frozen."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    gc.enable()
    frozen = gc.get_freeze_count()
    log.info("startup heap frozen: %d objects out of the collector's walks (%.0f ms)", frozen,
             (time.perf_counter() - start) * 1e3)
    return frozen


class FrozenObjectsCollector(Collector):
    """`pdserve_gc_frozen_objects`: objects in the collector's permanent generation (freeze_startup_heap)."""

    def collect(self):
        yield GaugeMetricFamily("pdserve_gc_frozen_objects",
                                "Objects frozen out of the garbage collector's walks before the process began serving",
                                value=gc.get_freeze_count())


def register_process_collectors(registry: CollectorRegistry) -> None:
    """process_*, python_gc_* and pdserve_gc_frozen_objects in `registry` (module doc)."""
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(FrozenObjectsCollector())
