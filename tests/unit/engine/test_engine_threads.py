"""The engine loop keeps its torch thread count when gRPC handler threads start after it (each sets its own
count to 1): in a process of its own, since torch's thread counts are process state."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import sys
from concurrent import futures
import torch
sys.path.insert(0, {tests!r})
from engine.engine_loop import EngineLoop, build_engine
from engine.config import EngineConfig
import tiny_model
from protos.service_runtime import _single_threaded_torch

engine = build_engine(EngineConfig(model="tiny-random", num_kv_blocks=64, block_size=4, dtype="float32",
                                   num_threads=2), loaded=tiny_model.tiny_loaded())
loop = EngineLoop(engine).start()
handlers = futures.ThreadPoolExecutor(4, initializer=_single_threaded_torch)  # as protos.service_runtime's server
handler_threads = [handlers.submit(torch.get_num_threads).result() for _ in range(4)]
loop_threads = loop.call(lambda e: torch.get_num_threads())
x = torch.randn(2000, 2000)
loop.call(lambda e: (x * 2).sum())  # a parallel op on the loop thread: OpenMP starts its second thread
futures.ThreadPoolExecutor(1, initializer=_single_threaded_torch).submit(lambda: (x + 1).sum()).result()
print(handler_threads, loop_threads, loop.call(lambda e: torch.get_num_threads()))
loop.stop()
"""


def test_the_loop_thread_keeps_its_threads_when_handler_threads_set_theirs_after_it_started():
    code = SCRIPT.format(tests=str(ROOT / "tests" / "unit" / "engine"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "[1, 1, 1, 1] 2 2"
