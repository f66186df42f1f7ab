"""A worker's main thread runs its SIGTERM handler whichever thread the kernel delivers the signal to.

CPython runs a Python signal handler only on the main thread, when it next executes bytecode; a main thread asleep
in an untimed wait never does if the signal landed on another thread (engine, gRPC, torch threads), and the worker
would ignore SIGTERM and keep heartbeating. The test sends SIGTERM to one other thread (pthread_kill), which a
process-directed signal may pick at random."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import signal, threading, time
from protos.service_runtime import wait_for_termination

def send_to_this_thread():
    while signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:     # until wait_for_termination installed its handler
        time.sleep(0.01)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    time.sleep(60)

threading.Thread(target=send_to_this_thread, daemon=True).start()
wait_for_termination(lambda: print("stopped", flush=True))
"""


def test_sigterm_delivered_to_another_thread_still_stops_the_worker():
    result = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=60,
                            check=False)
    assert (result.returncode, result.stdout.strip()) == (0, "stopped"), result.stderr
