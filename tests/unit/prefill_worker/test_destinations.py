"""prefill_worker.destinations: only live decode endpoints of the index (or the configured ones) pass."""
from __future__ import annotations

import pytest

from engine.errors import PermissionDeniedError
from prefill_worker.destinations import DecodeDestinations, DestinationRefused


class Index:
    """What the index answers (a list of endpoints, or None while unreachable) and how often it was asked."""

    def __init__(self, endpoints):
        self.endpoints = endpoints
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.endpoints


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_unregistered_allows_only_the_configured_endpoints():
    destinations = DecodeDestinations(static_endpoints=["10.0.0.1:7000"])
    destinations.check("10.0.0.1:7000")
    with pytest.raises(DestinationRefused) as info:
        destinations.check("10.0.0.1:7001")
    assert isinstance(info.value, PermissionDeniedError) and info.value.field == "target.endpoint"
    assert str(info.value).startswith("target.endpoint: '10.0.0.1:7001'")
    with pytest.raises(DestinationRefused):
        DecodeDestinations().check("10.0.0.1:7000")               # nothing configured: nothing allowed


def test_registered_allows_live_decode_endpoints_and_caches_the_lookup():
    index, clock = Index(["d0:1", "d1:1"]), Clock()
    destinations = DecodeDestinations(list_decode_endpoints=index, refresh_s=1.0, min_refresh_s=0.2, clock=clock)
    destinations.check("d0:1")
    destinations.check("d1:1")
    assert index.calls == 1                                        # cached
    with pytest.raises(DestinationRefused):
        destinations.check("evil:1")                               # unknown, but refreshed too recently
    assert index.calls == 1
    clock.now += 0.3
    with pytest.raises(DestinationRefused):
        destinations.check("evil:1")                               # one early refresh, still unknown
    assert index.calls == 2


def test_a_worker_that_left_the_index_is_refused_after_the_refresh():
    index, clock = Index(["d0:1"]), Clock()
    destinations = DecodeDestinations(list_decode_endpoints=index, refresh_s=1.0, clock=clock)
    destinations.check("d0:1")
    index.endpoints = []
    clock.now += 1.0
    with pytest.raises(DestinationRefused):
        destinations.check("d0:1")


def test_a_new_worker_is_found_by_the_early_refresh():
    index, clock = Index(["d0:1"]), Clock()
    destinations = DecodeDestinations(list_decode_endpoints=index, refresh_s=10.0, min_refresh_s=0.2, clock=clock)
    destinations.check("d0:1")
    index.endpoints = ["d0:1", "d2:1"]
    clock.now += 0.2
    destinations.check("d2:1")


def test_an_unreachable_index_keeps_the_last_answer_and_refuses_without_one():
    index, clock = Index(None), Clock()
    destinations = DecodeDestinations(list_decode_endpoints=index, clock=clock)
    with pytest.raises(DestinationRefused):
        destinations.check("d0:1")                                 # never heard of any decode worker
    index.endpoints = ["d0:1"]
    clock.now += 5
    destinations.check("d0:1")
    index.endpoints = None
    clock.now += 5
    destinations.check("d0:1")                                     # the last answer stands
    with pytest.raises(DestinationRefused):
        destinations.check("evil:1")
