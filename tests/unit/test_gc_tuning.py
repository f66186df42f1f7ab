"""protos.gc_tuning in a process of its own (freezing the pytest process's heap would outlive the test): a paused
collector lets cyclic garbage pile up, and freezing collects it first, freezes what is left and turns the
collector back on; the registry helper exposes the frozen count beside prometheus_client's process and gc
metrics."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from protos.gc_tuning import register_process_collectors

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import gc, weakref
from protos.gc_tuning import freeze_startup_heap, pause_collection

class Node:
    pass

pause_collection()
kept = [Node() for _ in range(1000)]       # what a server keeps from its start
garbage = []
for _ in range(2000):                      # cycles the start let go of: only the collector frees them
    a, b = Node(), Node()
    a.other, b.other = b, a
    garbage.append(weakref.ref(a))
    del a, b
assert not gc.isenabled() and all(r() is not None for r in garbage)
frozen = freeze_startup_heap()
assert gc.isenabled(), "collector left off"
assert all(r() is None for r in garbage), "the start's cycles were frozen instead of collected"
assert frozen == gc.get_freeze_count() and frozen >= len(kept)
assert all(gc.is_tracked(n) for n in kept) and gc.get_count()[0] < 700
print("ok", frozen)
"""


def test_freezing_collects_the_start_s_cycles_then_freezes_the_rest_and_enables_the_collector():
    result = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok ")


def test_process_collectors_expose_frozen_objects_process_and_gc_metrics():
    registry = CollectorRegistry()
    register_process_collectors(registry)
    text = generate_latest(registry).decode()
    for name in ("pdserve_gc_frozen_objects", "process_cpu_seconds_total", "process_resident_memory_bytes",
                 "python_gc_collections_total"):
        assert f"\n{name}" in text, name
