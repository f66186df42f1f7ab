"""Worker health as the gateway sees it (gateway.discovery), over a fake index and fake channel states."""
from __future__ import annotations

import asyncio

from gateway.discovery import WorkerDirectory
from gateway.routing import RoutingPolicy
from gateway.worker_types import ChannelState
from kvstore.local_index import PrefixMatch, WorkerInfo

POLICY = RoutingPolicy(block_size=16, fingerprint="fp")


def worker(worker_id: str, role: str = "decode", fingerprint: str = "fp") -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"{worker_id}:1", epoch=1, block_size=16, fingerprint=fingerprint)


class FakeIndex:
    def __init__(self, workers) -> None:
        self.workers = list(workers)
        self.up = True

    def match(self, block_hashes):
        return [PrefixMatch(w, 0) for w in self.workers] if self.up else None

    def close(self) -> None:
        pass


class FakeChannels:
    def __init__(self) -> None:
        self.states: dict[str, ChannelState] = {}

    def state(self, endpoint: str) -> ChannelState:
        return self.states.get(endpoint, ChannelState.IDLE)


def directory(*workers):
    index, channels = FakeIndex(workers), FakeChannels()
    return WorkerDirectory(index, POLICY, channels), index, channels


def test_serving_while_a_usable_decode_worker_is_registered_and_not_seen_failing():
    d, _, channels = directory(worker("d0"), worker("p0", "prefill"))
    assert asyncio.run(d.refresh()) is True
    channels.states["d0:1"] = ChannelState.TRANSIENT_FAILURE
    assert asyncio.run(d.refresh()) is False


def test_a_broken_stream_marks_a_worker_down_until_its_channel_is_ready_again():
    d, _, channels = directory(worker("d0"))
    d.report_unreachable("d0:1")
    channels.states["d0:1"] = ChannelState.CONNECTING
    assert asyncio.run(d.refresh()) is False
    assert d.down_endpoints() == {"d0:1"}
    channels.states["d0:1"] = ChannelState.IDLE                 # not proof of life either
    assert asyncio.run(d.refresh()) is False
    channels.states["d0:1"] = ChannelState.READY
    assert asyncio.run(d.refresh()) is True and d.down_endpoints() == set()


def test_only_decode_workers_of_this_model_count():
    d, index, _ = directory(worker("p0", "prefill"), worker("d-other", fingerprint="other"))
    assert asyncio.run(d.refresh()) is False
    index.workers.append(worker("d1"))
    assert asyncio.run(d.refresh()) is True


def test_while_the_index_is_unreachable_the_last_known_workers_decide():
    d, index, channels = directory(worker("d0"))
    assert asyncio.run(d.refresh()) is True
    index.up = False
    assert asyncio.run(d.refresh()) is True
    channels.states["d0:1"] = ChannelState.TRANSIENT_FAILURE
    assert asyncio.run(d.refresh()) is False


def test_watch_reports_the_first_state_then_each_change():
    d, _, channels = directory(worker("d0"))
    seen: list[bool] = []

    async def scenario():
        async def on_change(serving: bool) -> None:
            seen.append(serving)
            if serving:
                channels.states["d0:1"] = ChannelState.TRANSIENT_FAILURE
            else:
                channels.states["d0:1"] = ChannelState.READY
            if len(seen) == 3:
                raise asyncio.CancelledError

        try:
            await d.watch(on_change, interval_s=0)
        except asyncio.CancelledError:
            pass

    asyncio.run(scenario())
    assert seen == [True, False, True]
