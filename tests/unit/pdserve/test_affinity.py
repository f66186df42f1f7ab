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
from pdserve import cli, cli_args
from pdserve.affinity import allowed_cpus, format_cpu_list, parse_cpu_list, split_cpus
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


def test_lend_idle_cpus_pairs_each_prefill_worker_with_a_decode_workers_cpus_and_lock(tmp_path):
    config = LocalClusterConfig(pin_workers=True, lend_idle_cpus=True, num_prefill=2, num_decode=1,
                                engine=EngineConfig(model="default"))
    roles, ids = ["prefill", "prefill", "decode"], ["prefill-0", "prefill-1", "decode-0"]
    flags = lending_flags(config, roles, ids, [(0,), (1,), (2, 3)], tmp_path)
    lock = str(tmp_path / "decode-0.busy")
    assert flags == [["--borrow-cpus", "2-3", "--borrow-lock", lock], [], ["--busy-lock", lock]]
    prefill = cli_args.parse_args(worker_argv("prefill", "prefill-0", 4100, config, 1, None, (0,)) + flags[0])
    decode = cli_args.parse_args(worker_argv("decode", "decode-0", 4101, config, 2, None, (2, 3)) + flags[2])
    assert (prefill.borrow_cpus, prefill.borrow_lock, prefill.cpu_affinity) == ((2, 3), lock, (0,))
    assert cli_args.worker_config(DecodeWorkerConfig, "decode", decode).busy_lock == lock
    plain = dataclasses.replace(config, lend_idle_cpus=False)
    assert lending_flags(plain, roles, ids, [(0,), (1,), (2, 3)], tmp_path) == [[], [], []]
    assert cli_args.cluster_config(cli_args.parse_args(["up", "--pin-workers", "--lend-idle-cpus"])).lend_idle_cpus


def test_lend_idle_cpus_without_pinned_workers_exits_2_naming_the_flag(capsys):
    assert cli.main(["up", "--lend-idle-cpus"]) == 2
    assert capsys.readouterr().err.startswith("pdserve: error: argument --lend-idle-cpus: ")


@pytest.mark.parametrize("extra, message", [
    (["--borrow-cpus", "1", "--borrow-lock", "x"], "argument --borrow-cpus: needs --cpu-affinity"),
    (["--cpu-affinity", "0", "--borrow-cpus", "0", "--borrow-lock", "x"],
     "argument --borrow-cpus: CPU(s) 0 are this worker's own"),
    (["--cpu-affinity", "0", "--borrow-cpus", "4096", "--borrow-lock", "x"],
     "argument --borrow-cpus: CPU(s) 4096 not available to this process"),
    (["--borrow-lock", "x"], "argument --borrow-cpus: PrefillWorkerConfig.borrow_cpus and borrow_lock go together"),
])
def test_bad_borrowing_exits_2_naming_the_flag_before_anything_starts(extra, message, capsys):
    assert cli.main(["prefill-worker", *INSECURE, *extra]) == 2
    assert capsys.readouterr().err.startswith(f"pdserve: error: {message}")
