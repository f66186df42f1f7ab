"""BlockLease: every legal transition on a tiny pool with exact block ids, every illegal one refused, and the
pin a push or transfer holds (deterministic interleavings with threads and events; no sleeps)."""

import threading

import pytest

from engine.block_lease import BlockLease, IllegalTransition, LeaseState as S
from engine.engine_loop import EngineLoop
from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from tiny_model import tiny_engine


def kv_and_seq(num_tokens=5, num_blocks=6):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=2, root_hash=1, enable_caching=False)
    return kv, Sequence("r", list(range(1, num_tokens + 1)), SamplingParams(), seed=0)


def reserved(num_tokens=5):
    kv, seq = kv_and_seq(num_tokens)
    seq.lease = BlockLease(seq, kv, S.RESERVED)
    kv.allocate(seq, seq.num_tokens)
    return kv, seq, seq.lease


def free_ids(kv):
    return list(kv.pool._free)


def test_decode_side_reserved_receiving_committed_running_released():
    kv, seq, lease = reserved()
    assert seq.block_ids == [0, 1, 2] and free_ids(kv) == [3, 4, 5]
    lease.pin(S.RESERVED, S.RECEIVING)
    assert not lease.unpin(S.COMMITTED)
    lease.advance(S.RUNNING, expect=frozenset({S.COMMITTED}))
    assert lease.state is S.RUNNING and seq.block_ids == [0, 1, 2]
    lease.release()
    assert lease.released and seq.block_ids == [] and free_ids(kv) == [3, 4, 5, 2, 1, 0]   # tail first
    with pytest.raises(IllegalTransition, match="released to released"):
        lease.release()                                         # a second release is an error, not a no-op
    assert free_ids(kv) == [3, 4, 5, 2, 1, 0]


def test_failed_transfer_goes_back_to_reserved_and_a_reservation_can_be_released_or_prefilled_locally():
    kv, seq, lease = reserved()
    lease.pin(S.RESERVED, S.RECEIVING)
    with pytest.raises(IllegalTransition):
        lease.pin(S.RESERVED, S.RECEIVING)                      # one transfer per reservation
    assert not lease.unpin(S.RESERVED)
    lease.advance(S.RUNNING, expect=frozenset({S.RESERVED}))    # prefill locally
    lease.release()
    assert free_ids(kv) == [3, 4, 5, 2, 1, 0]


def test_prefill_side_queued_running_held_pushing_held_released():
    kv, seq = kv_and_seq(num_tokens=3)
    seq.lease = lease = BlockLease(seq, kv)
    assert lease.state is S.QUEUED
    kv.allocate(seq, 3)
    lease.advance(S.RUNNING)
    lease.advance(S.HELD)
    lease.pin(S.HELD, S.PUSHING)
    assert not lease.unpin(S.HELD)
    assert seq.block_ids == [0, 1]
    assert lease.request_release() and free_ids(kv) == [2, 3, 4, 5, 1, 0]


def test_preemption_frees_the_blocks_but_keeps_the_lease():
    kv, seq = kv_and_seq(num_tokens=3)
    seq.lease = lease = BlockLease(seq, kv)
    kv.allocate(seq, 3)
    lease.advance(S.RUNNING)
    lease.advance(S.QUEUED, expect=frozenset({S.RUNNING}))
    assert seq.block_ids == [] and free_ids(kv) == [2, 3, 4, 5, 1, 0] and not lease.released
    kv.allocate(seq, 3)
    assert seq.block_ids == [2, 3]
    lease.advance(S.RUNNING)
    lease.release()
    assert kv.pool.get_num_used_blocks() == 0


@pytest.mark.parametrize("state, to", [
    (S.RESERVED, S.HELD), (S.RESERVED, S.COMMITTED), (S.RESERVED, S.QUEUED), (S.COMMITTED, S.RESERVED)])
def test_illegal_transitions_are_refused_and_change_nothing(state, to):
    kv, seq, lease = reserved()
    if state is S.COMMITTED:
        lease.pin(S.RESERVED, S.RECEIVING)
        lease.unpin(S.COMMITTED)
    with pytest.raises(IllegalTransition):
        lease.advance(to)
    assert lease.state is state and seq.block_ids == [0, 1, 2]


def test_pinned_lease_is_not_released_but_marked_and_released_by_the_pin_holder():
    kv, seq, lease = reserved()
    lease.pin(S.RESERVED, S.RECEIVING)
    with pytest.raises(IllegalTransition):
        lease.release()                                         # never while a transfer writes
    assert not lease.request_release()                          # recorded, blocks untouched
    assert seq.block_ids == [0, 1, 2] and free_ids(kv) == [3, 4, 5]
    assert lease.unpin(S.COMMITTED)                             # the holder learns it must release
    lease.release()
    assert free_ids(kv) == [3, 4, 5, 2, 1, 0]


def test_abort_during_a_push_waits_for_the_push_to_end():
    """Thread P pushes (holds the pin) while thread A aborts; A's release waits for P: the blocks stay
    referenced until P unpinned and released them."""
    kv, seq = kv_and_seq(num_tokens=3)
    seq.lease = lease = BlockLease(seq, kv)
    kv.allocate(seq, 3)
    lease.advance(S.RUNNING)
    lease.advance(S.HELD)
    pinned, aborted, read_during_push = threading.Event(), threading.Event(), []

    def push():
        lease.pin(S.HELD, S.PUSHING)
        pinned.set()
        aborted.wait()
        read_during_push.append([kv.pool.get_ref_count(b) for b in seq.block_ids])  # still ours
        if lease.unpin(S.HELD):
            lease.release()

    pusher = threading.Thread(target=push)
    pusher.start()
    pinned.wait()
    assert not lease.request_release()
    aborted.set()
    pusher.join()
    assert read_during_push == [[1, 1]] and lease.released and free_ids(kv) == [2, 3, 4, 5, 1, 0]


def held_request_on_a_loop():
    """A prefill worker's first steps on a real engine loop: a hold_blocks request prefilled to its token."""
    loop = EngineLoop(tiny_engine(num_kv_blocks=8)).start()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    stream = loop.open_stream("p", lambda e: e.add_request("p", list(range(1, 10)), params, hold_blocks=True))
    out = stream.get()
    assert out.finished and out.seq.lease.state is S.HELD and out.seq.block_ids == [0, 1, 2]
    return loop, stream, out.seq


def test_abort_between_the_prefill_result_and_the_push_pin_frees_once_and_refuses_the_pin():
    """The race of issue 11: Abort lands after the stream's result and before the push pins. The abort
    releases; the push's pin is refused, so it never reads freed blocks; closing the stream finds nothing."""
    loop, stream, seq = held_request_on_a_loop()
    try:
        assert loop.abort("p")                                  # Abort RPC, before the pin
        assert seq.lease.released and loop.call(lambda e: e.kv.pool.get_num_used_blocks()) == 0
        with pytest.raises(IllegalTransition):
            seq.lease.pin(S.HELD, S.PUSHING)
        stream.close()
        assert not loop.abort("p")
    finally:
        loop.stop()


def test_abort_during_the_push_is_deferred_until_the_push_unpins():
    loop, stream, seq = held_request_on_a_loop()
    try:
        pinned, aborted, refs_during_push = threading.Event(), threading.Event(), []

        def push():                                            # PrefillWorker.prefill's pin / push / unpin
            seq.lease.pin(S.HELD, S.PUSHING)
            pinned.set()
            aborted.wait()
            refs_during_push.append(loop.call(lambda e: [e.kv.pool.get_ref_count(b) for b in seq.block_ids]))
            assert seq.lease.unpin(S.HELD)                      # the abort is reported to the pin holder
            stream.close()                                      # ... which has the engine release

        pusher = threading.Thread(target=push)
        pusher.start()
        pinned.wait()
        assert loop.abort("p")                                  # found, but only marked: the push reads
        aborted.set()
        pusher.join()
        assert refs_during_push == [[1, 1, 1]]
        assert seq.lease.released and loop.call(lambda e: e.kv.pool.get_num_used_blocks()) == 0
        assert not loop.abort("p")
    finally:
        loop.stop()
