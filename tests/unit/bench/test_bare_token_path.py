"""The bare Python-grpc token path that bench/bench_cluster.py runs beside the engine: real processes, real sockets."""

from __future__ import annotations

import threading

import pytest

from pdserve.bench.bare_token_path import BareTokenPath


@pytest.fixture(scope="module")
def bare():
    with BareTokenPath() as path:
        yield path


@pytest.mark.parametrize("hops", [2, 3])
def test_every_message_arrives(bare, hops):
    assert bare.stream(20, 0.005, hops=hops) == 20


@pytest.mark.parametrize("hops", [2, 3])
def test_stop_cancels_a_stream_at_its_next_message(bare, hops):
    stop = threading.Event()
    stop.set()
    assert bare.stream(1 << 30, 0.001, hops=hops, stop=stop) == 1
    assert bare.stream(3, 0.0, hops=hops) == 3  # the cancelled call left both processes serving


def test_close_ends_both_processes():
    path = BareTokenPath()
    processes = list(path._processes)
    assert len(processes) == 2 and all(p.is_alive() for p in processes)
    assert set(path.pids.values()) == {p.pid for p in processes}
    path.close()
    assert not any(p.is_alive() for p in processes)
