"""Worker CPU pinning: CPU lists, the --cpu-affinity checks, the whole process pinned, `up --pin-workers` slices,
and `up --lend-idle-cpus`'s flags (--busy-lock, --borrow-cpus, --borrow-lock) and their checks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from decode_worker.config import DecodeWorkerConfig
from prefill_worker.config import PrefillWorkerConfig
from pdserve import cli, cli_args
from pdserve.affinity import (BORROWING_SPIN_COUNT, allowed_cpus, format_cpu_list, parse_cpu_list,
                              split_cpus)
from pdserve.cluster_config import LocalClusterConfig
from pdserve.launch_plan import ClusterError, lending_flags, worker_argv, worker_cpus

ROOT = Path(__file__).resolve().parents[3]
INSECURE = ["--insecure-internal"]


@pytest.mark.parametrize("text, cpus", [("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0-3,6", (0, 1, 2, 3, 6)),
                                        ("6,0-1,1", (0, 1, 6)), (" 2 - 3 , 5", (2, 3, 5))])
def test_cpu_lists_parse_and_format_back(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize("text", ["", "a", "0-", "3-1", "0,,1", "-1"])
def test_malformed_cpu_lists_are_refused(text):
    with pytest.raises(ValueError):
        parse_cpu_list(text)


def test_split_cpus_gives_consecutive_disjoint_slices_or_refuses():
    assert split_cpus((0, 1, 2, 3, 4), [2, 2]) == [(0, 1), (2, 3)]
    with pytest.raises(ValueError, match="3 CPUs needed"):
        split_cpus((0, 1), [2, 1])


def test_a_pinned_worker_runs_one_thread_per_cpu_by_default():
    cpu = allowed_cpus()[0]
    args = cli_args.parse_args(["decode-worker", *INSECURE, "--cpu-affinity", str(cpu)])
    assert cli_args.cpu_affinity(args) == (cpu,)
    assert cli_args.engine_config(args).num_threads == 1
    unpinned = cli_args.parse_args(["decode-worker", *INSECURE])
    assert cli_args.cpu_affinity(unpinned) is None and cli_args.engine_config(unpinned).num_threads is None


@pytest.mark.parametrize("extra, message", [
    (["--cpu-affinity", "4096"], "argument --cpu-affinity: CPU(s) 4096 not available to this process"),
    (["--cpu-affinity", "0", "--threads", "2"], "argument --threads: 2 threads on the 1 CPU(s) of --cpu-affinity 0"),
    (["--cpu-affinity", "0", "--tensor-parallel-size", "2"], "argument --cpu-affinity: not supported"),
])
def test_bad_pinning_exits_2_naming_the_flag_before_anything_starts(extra, message, capsys):
    assert cli.main(["prefill-worker", *INSECURE, *extra]) == 2
    assert capsys.readouterr().err.startswith(f"pdserve: error: {message}")


def test_a_malformed_cpu_list_exits_2_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exc_info:
        cli.main(["decode-worker", *INSECURE, "--cpu-affinity", "1-0"])
    assert exc_info.value.code == 2
    assert "--cpu-affinity" in capsys.readouterr().err


def test_pin_process_moves_threads_started_before_it_and_after_it():
    cpu = allowed_cpus()[-1]
    script = ("import os, threading, time\n"
              "from pdserve.affinity import pin_process\n"
              "early = threading.Thread(target=time.sleep, args=(2,), daemon=True); early.start()\n"
              f"pin_process([{cpu}])\n"
              "late = threading.Thread(target=time.sleep, args=(2,), daemon=True); late.start()\n"
              "print(sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir('/proc/self/task')}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert out.strip() == f"[({cpu},)]"


# Pinned to one CPU, then stepping on two with two torch threads, as a borrowing worker does (engine.cpu_share):
# the count of times torch's OpenMP threads went to sleep in the kernel over 200 parallel ops.
SLEEPS = """
import os, sys, threading
from pdserve.affinity import pin_process
own, lent = {own}, {lent}
pin_process(own, borrowed=lent if sys.argv[1] == "borrowed" else ())
import torch
def run():
    os.sched_setaffinity(0, own + lent)
    torch.set_num_threads(2); torch.get_num_threads(); torch.set_num_threads(2)
    a = torch.ones(1 << 20); out = torch.empty_like(a)
    torch.add(a, a, out=out)  # starts the OpenMP team
    me = str(threading.get_native_id())
    team = [t for t in os.listdir("/proc/self/task") if t not in (me, str(os.getpid()))]
    def sleeps():
        return sum(int(line.split()[1]) for t in team for line in open(f"/proc/self/task/{{t}}/status")
                   if line.startswith("voluntary_ctxt_switches"))
    before = sleeps()
    for _ in range(200):
        torch.add(a, a, out=out)
    print(sorted(os.sched_getaffinity(os.getpid())), os.environ.get("GOMP_SPINCOUNT"), sleeps() - before)
thread = threading.Thread(target=run); thread.start(); thread.join()
"""


@pytest.mark.skipif(len(allowed_cpus()) < 2, reason="borrowing needs two CPUs")
def test_a_borrowing_process_loads_libgomp_on_both_cpus_so_its_threads_spin_between_parallel_ops():
    own, lent = [allowed_cpus()[0]], [allowed_cpus()[1]]

    def run(mode: str, **env: str) -> list[str]:
        base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
        out = subprocess.run([sys.executable, "-c", SLEEPS.format(own=own, lent=lent), mode], capture_output=True,
                             text=True, timeout=120, check=True, cwd=ROOT,
                             env={**base, "PYTHONPATH": str(ROOT), **env}).stdout
        return out.split()

    # The team's spinning, set far longer than the test: a sleep then means libgomp throttled it, which it does
    # when it has more threads than the CPUs it counted as it loaded (its spin then stays at 100 polls), and
    # the counts do not depend on how busy the machine is (a thread preempted while spinning did not sleep).
    spin = "100000000"
    plain, borrowed = run("plain", GOMP_SPINCOUNT=spin), run("borrowed", GOMP_SPINCOUNT=spin)
    assert plain[:2] == borrowed[:2] == [f"[{own[0]}]", spin]   # the user's own setting stays
    # libgomp loaded on one CPU throttles a two-thread team: it sleeps after every op (one futex wake-up each)
    assert int(plain[2]) >= 100
    assert int(borrowed[2]) * 4 < int(plain[2])
    assert run("borrowed")[:2] == [f"[{own[0]}]", BORROWING_SPIN_COUNT]


def test_up_pin_workers_slices_the_cpus_in_start_order_and_passes_them_on():
    config = LocalClusterConfig(pin_workers=True, num_cpus=4, engine=EngineConfig(model="default"))
    assert worker_cpus(config, [2, 2], (0, 1, 2, 3, 4, 5)) == [(0, 1), (2, 3)]
    assert worker_cpus(LocalClusterConfig(), [1, 1], (0, 1)) == [None, None]
    argv = worker_argv("decode", "decode-0", 4100, config, num_threads=2, tls=None, cpus=(2, 3))
    args = cli_args.parse_args(argv)
    assert args.cpu_affinity == (2, 3) and cli_args.engine_config(args).num_threads == 2
    with pytest.raises(ClusterError, match="--pin-workers"):
        worker_cpus(config, [3, 2], (0, 1, 2, 3))
    with pytest.raises(ClusterError, match="--cpus 4: only 2"):
        worker_cpus(config, [1, 1], (0, 1))
    assert cli_args.cluster_config(cli_args.parse_args(["up", "--pin-workers"])).pin_workers


def test_lend_idle_cpus_pairs_each_prefill_worker_with_a_decode_worker_both_ways(tmp_path, monkeypatch):
    monkeypatch.setattr(cli_args, "allowed_cpus", lambda: tuple(range(4)))  # --borrow-cpus must exist here
    config = LocalClusterConfig(pin_workers=True, lend_idle_cpus=True, num_prefill=2, num_decode=1,
                                engine=EngineConfig(model="default"))
    roles, ids = ["prefill", "prefill", "decode"], ["prefill-0", "prefill-1", "decode-0"]
    flags = lending_flags(config, roles, ids, [(0,), (1,), (2, 3)], tmp_path)
    p_lock, d_lock = str(tmp_path / "prefill-0.busy"), str(tmp_path / "decode-0.busy")
    assert flags == [["--busy-lock", p_lock, "--borrow-cpus", "2-3", "--borrow-lock", d_lock], [],
                     ["--busy-lock", d_lock, "--borrow-cpus", "0", "--borrow-lock", p_lock]]
    prefill = cli_args.parse_args(worker_argv("prefill", "prefill-0", 4100, config, 1, None, (0,)) + flags[0])
    decode = cli_args.parse_args(worker_argv("decode", "decode-0", 4101, config, 2, None, (2, 3)) + flags[2])
    p_config = cli_args.worker_config(PrefillWorkerConfig, "prefill", prefill)
    d_config = cli_args.worker_config(DecodeWorkerConfig, "decode", decode)
    assert (p_config.busy_lock, p_config.borrow_cpus, p_config.borrow_lock, prefill.cpu_affinity) == \
        (p_lock, (2, 3), d_lock, (0,))
    assert (d_config.busy_lock, d_config.borrow_cpus, d_config.borrow_lock, decode.cpu_affinity) == \
        (d_lock, (0,), p_lock, (2, 3))
    plain = dataclasses.replace(config, lend_idle_cpus=False)
    assert lending_flags(plain, roles, ids, [(0,), (1,), (2, 3)], tmp_path) == [[], [], []]
    assert cli_args.cluster_config(cli_args.parse_args(["up", "--pin-workers", "--lend-idle-cpus"])).lend_idle_cpus


@pytest.mark.parametrize("extra, message", [([], "it needs pin_workers"),
                                            (["--pin-workers", "--prefill", "0"], "it needs num_prefill >= 1")])
def test_lend_idle_cpus_without_pinned_workers_or_a_prefill_worker_exits_2_naming_the_flag(extra, message, capsys):
    assert cli.main(["up", "--lend-idle-cpus", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve: error: argument --lend-idle-cpus: ") and message in err


@pytest.mark.parametrize("extra, message", [
    (["--borrow-cpus", "1", "--borrow-lock", "x"], "argument --borrow-cpus: needs --cpu-affinity"),
    (["--cpu-affinity", "0", "--borrow-cpus", "0", "--borrow-lock", "x"],
     "argument --borrow-cpus: CPU(s) 0 are this worker's own"),
    (["--cpu-affinity", "0", "--borrow-cpus", "4096", "--borrow-lock", "x"],
     "argument --borrow-cpus: CPU(s) 4096 not available to this process"),
    (["--borrow-lock", "x"], "argument --borrow-cpus: {config}.borrow_cpus and borrow_lock go together"),
])
@pytest.mark.parametrize("role, config", [("prefill", "PrefillWorkerConfig"), ("decode", "DecodeWorkerConfig")])
def test_bad_borrowing_exits_2_naming_the_flag_before_anything_starts(extra, message, role, config, capsys):
    assert cli.main([f"{role}-worker", *INSECURE, *extra]) == 2
    assert capsys.readouterr().err.startswith(f"pdserve: error: {message.format(config=config)}")
