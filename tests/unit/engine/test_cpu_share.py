"""Pinned workers lending each other their idle CPUs (engine.cpu_share): the lock, the borrower's choice of CPUs
and threads a step, a worker that lends and borrows at once, and the engine loop's activity hook that drives them."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cpu_share import BusyLock, CpuBorrower, CpuShare
from engine.engine_loop import EngineLoop
from engine.sampling_params import SamplingParams
from tiny_model import tiny_engine

ROOT = Path(__file__).resolve().parents[3]
CPUS = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="lending needs two CPUs")

# The borrower sets its thread's CPUs and torch's thread count (process state): in a process of its own, the lock
# held by other real processes.
SCRIPT = """
import json, os, subprocess, sys, threading, torch
from engine.cpu_share import BusyLock, CpuBorrower
own, lent, path = {own}, {lent}, {path!r}
holder = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
          "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)")
seen = []

def step(borrower):
    borrower.activity(True)
    seen.append((sorted(os.sched_getaffinity(0)), torch.get_num_threads()))

def run():
    borrower = CpuBorrower(path, own, lent)
    step(borrower)                                   # nobody holds the lock: own + lent
    decode = subprocess.Popen([sys.executable, "-c", holder, path], stdout=subprocess.PIPE, text=True)
    assert decode.stdout.readline() == "held\\n"
    step(borrower)                                   # a decode worker is busy: own only
    borrower.activity(False)                         # ignored by the borrower
    step(borrower)
    decode.kill(); decode.wait()                     # a dead decode worker drops its lock
    step(borrower)
    busy = BusyLock(path)                            # the decode side, this time in this process
    busy.activity(True); busy.activity(True)         # held once, whatever the repeats
    step(borrower)
    busy.activity(False)
    step(borrower)
    busy.activity(True); busy.close()                # closing drops it
    step(borrower)
    print(json.dumps({{"seen": seen, "steps": borrower.steps}}))

thread = threading.Thread(target=run); thread.start(); thread.join()
"""


@two_cpus
def test_the_borrower_steps_on_the_lent_cpus_only_while_no_decode_worker_holds_the_lock(tmp_path):
    own, lent = [CPUS[0]], [CPUS[1]]
    code = SCRIPT.format(own=own, lent=lent, path=str(tmp_path / "decode-0.busy"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    both, alone = [sorted(own + lent), 2], [own, 1]
    assert result["seen"] == [both, alone, alone, both, alone, both, both]
    assert result["steps"] == {"own": 3, "borrowed": 4}


# Both ways: this process's CpuShare lends (mine) and borrows (partner's); the partner side is played by a BusyLock
# and a CpuBorrower on other open files of the same locks (flock conflicts between open files as between processes).
BOTH_WAYS = """
import json, os, threading, torch
from engine.cpu_share import BusyLock, CpuBorrower, CpuShare
own, lent, mine, partner = {own}, {lent}, {mine!r}, {partner!r}
seen = []

def run():
    share = CpuShare(mine, own, lent, partner)
    partner_busy, partner_borrower = BusyLock(partner), CpuBorrower(mine, lent, own)
    def step():
        share.activity(True)
        seen.append([sorted(os.sched_getaffinity(0)), torch.get_num_threads(), partner_borrower.lender_idle()])
    step()                                  # the partner idles: borrowed; mine is held before the partner tests it
    partner_busy.activity(True)
    step()                                  # the partner works: own CPUs only
    share.activity(False)
    seen.append(partner_borrower.lender_idle())   # idle: the partner may borrow mine
    partner_busy.activity(False)
    step()
    share.close()
    seen.append(partner_borrower.lender_idle())   # closed: lent for good
    print(json.dumps({{"seen": seen, "steps": share.steps}}))

thread = threading.Thread(target=run); thread.start(); thread.join()
"""


@two_cpus
def test_a_worker_that_lends_and_borrows_holds_its_own_lock_while_it_steps_on_either(tmp_path):
    own, lent = [CPUS[0]], [CPUS[1]]
    code = BOTH_WAYS.format(own=own, lent=lent, mine=str(tmp_path / "decode-0.busy"),
                            partner=str(tmp_path / "prefill-0.busy"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    both, alone = [sorted(own + lent), 2, False], [own, 1, False]
    assert result["seen"] == [both, alone, True, both, True]
    assert result["steps"] == {"own": 1, "borrowed": 2}


def test_a_share_that_only_lends_counts_no_steps_and_borrowing_needs_both_settings(tmp_path):
    share = CpuShare(str(tmp_path / "decode-0.busy"))
    assert share.steps is None
    share.activity(True)
    share.close()
    with pytest.raises(ValueError, match="borrow_cpus and borrow_lock go together"):
        CpuShare(None, [0], [1], None)


def test_a_borrower_needs_cpus_of_its_own_and_others_to_borrow(tmp_path):
    path = str(tmp_path / "lock")
    with pytest.raises(ValueError, match="both its own and lent"):
        CpuBorrower(path, [0, 1], [1])
    with pytest.raises(ValueError, match="CPUs of its own and CPUs to borrow"):
        CpuBorrower(path, [0], [])


def test_the_loop_calls_its_activity_hook_before_each_step_and_once_when_the_work_runs_out():
    engine = tiny_engine()
    loop = EngineLoop(engine)
    calls: list[tuple[bool, int]] = []
    loop.set_activity_hook(lambda busy: calls.append((busy, engine.num_steps)))
    loop.start()
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        stream = loop.open_stream("a", lambda e: e.add_request("a", [5, 6, 7, 8, 9], params))
        outputs = list(stream)
        assert outputs and outputs[-1].request_finished
        loop.call(lambda e: None)  # the loop has gone round once more since the request finished
    finally:
        loop.stop()
    busy = [steps for flag, steps in calls if flag]
    assert busy == list(range(len(busy))) and len(busy) == engine.num_steps >= 3  # before each step, none missed
    assert calls[-1] == (False, engine.num_steps)                                # then idle, once
    assert [flag for flag, _ in calls].count(False) == 1


def test_the_busy_lock_is_held_from_the_first_step_until_the_engine_runs_out_of_work(tmp_path):
    path = str(tmp_path / "decode-0.busy")
    engine = tiny_engine()
    loop = EngineLoop(engine)
    busy = BusyLock(path)
    loop.set_activity_hook(busy.activity)
    observer = os.open(path, os.O_RDWR)            # another open file: flock conflicts with it as with a process

    def held() -> bool:
        try:
            fcntl.flock(observer, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(observer, fcntl.LOCK_UN)
        return False

    before = held()
    during: list[bool] = []
    loop.add_step_hook(lambda e, seconds: during.append(held()))   # on the loop thread, right after each step
    loop.start()
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert list(loop.open_stream("a", lambda e: e.add_request("a", [5, 6, 7], params)))[-1].request_finished
        after = loop.call(lambda e: held())    # between steps, the work done
    finally:
        loop.stop()
        busy.close()
        os.close(observer)
    assert not before                      # nothing to do yet
    assert len(during) == engine.num_steps >= 3 and all(during)   # held through every step
    assert not after                       # dropped once it finished
