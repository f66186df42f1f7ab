"""Routing decisions: exact orders for small pools of workers (no sockets, no Redis)."""
from __future__ import annotations

import pytest

from gateway.routing import (LOCAL_NO_PREFILL_WORKER, LOCAL_SATURATED, LOCAL_SHORT, DispatchedPrefixes,
                             PrefillRanking, RoutingPolicy, blocks_needed, incompatibility, plan_prefill, rank_decode_workers,
                             rank_prefill_workers)
from kvstore.local_index import PrefixMatch, WorkerInfo

FP = "fp-abc"
POLICY = RoutingPolicy(block_size=16, fingerprint=FP, local_prefill_threshold=32, max_prefill_load=4,
                       prefill_load_penalty_tokens=100, decode_load_penalty_blocks=2)


def worker(worker_id, role, *, free=100, running=0, waiting=0, block_size=16, fingerprint=FP, grpc=True):
    endpoint = f"127.0.0.1:{5000 + len(worker_id)}" if grpc else ""
    return WorkerInfo(worker_id, role, endpoint, epoch=1, capacity_blocks=100, free_blocks=free,
                      running=running, waiting=waiting, block_size=block_size, fingerprint=fingerprint,
                      host_id="h")


def match(w, blocks=0):
    return PrefixMatch(w, blocks)


def ids(candidates):
    return [c.worker_id for c in candidates]


# --------------------------------------------------------------------------------------------- compatibility
def test_incompatible_workers_are_named_and_ignored():
    good = worker("d-good", "decode")
    wrong_bs = worker("d-bs", "decode", block_size=32)
    wrong_fp = worker("d-fp", "decode", fingerprint="other")
    no_grpc = worker("d-nogrpc", "decode", grpc=False)
    missing = WorkerInfo("d-old", "decode", "x:1")
    assert incompatibility(good, POLICY) is None
    assert "block_size" in incompatibility(wrong_bs, POLICY)
    assert "fingerprint" in incompatibility(wrong_fp, POLICY)
    assert "grpc" in incompatibility(no_grpc, POLICY)
    assert "block_size" in incompatibility(missing, POLICY)
    ranked = rank_decode_workers([match(w, 5) for w in (wrong_bs, wrong_fp, no_grpc, missing, good)], POLICY, 10)
    assert ids(ranked) == ["d-good"]


def test_roles_are_kept_apart():
    matches = [match(worker("p0", "prefill")), match(worker("d0", "decode"))]
    assert ids(rank_decode_workers(matches, POLICY, 10)) == ["d0"]
    assert ids(rank_prefill_workers(matches, POLICY).candidates) == ["p0"]


# --------------------------------------------------------------------------------------------- decode workers
def test_blocks_needed_counts_prompt_plus_first_token():
    assert [blocks_needed(n, 16) for n in (1, 15, 16, 31, 32)] == [1, 1, 2, 2, 3]


def test_decode_prefers_cached_prefix_when_loads_are_equal():
    matches = [match(worker("d0", "decode"), 0), match(worker("d1", "decode"), 3), match(worker("d2", "decode"), 1)]
    ranked = rank_decode_workers(matches, POLICY, 64)
    assert ids(ranked) == ["d1", "d2", "d0"]
    assert [c.score for c in ranked] == [3, 1, 0]


def test_decode_load_outweighs_a_small_prefix_hit():
    # d1 holds 3 blocks more but runs 2 sequences: 3 - 2*2 = -1 < 0.
    matches = [match(worker("d0", "decode"), 0), match(worker("d1", "decode", running=2), 3)]
    assert ids(rank_decode_workers(matches, POLICY, 64)) == ["d0", "d1"]


def test_decode_ties_broken_by_free_blocks_then_id():
    matches = [match(worker("d2", "decode", free=50)), match(worker("d1", "decode", free=80)),
               match(worker("d0", "decode", free=50))]
    assert ids(rank_decode_workers(matches, POLICY, 10)) == ["d1", "d0", "d2"]


def test_decode_gateway_inflight_counts_when_above_reported_load():
    matches = [match(worker("d0", "decode")), match(worker("d1", "decode", running=1))]
    ranked = rank_decode_workers(matches, POLICY, 10, inflight={"d0": 3, "d1": 0})
    assert ids(ranked) == ["d1", "d0"]
    assert [c.load for c in ranked] == [1, 3]


def test_decode_that_cannot_fit_goes_last_but_stays():
    # 64-token prompt + 1 needs 5 blocks; d0 has 4 free and nothing cached, d1 has 2 free + 3 cached.
    matches = [match(worker("d0", "decode", free=4), 0), match(worker("d1", "decode", free=2, running=5), 3),
               match(worker("d2", "decode", free=2), 0)]
    ranked = rank_decode_workers(matches, POLICY, 64)
    assert ids(ranked) == ["d1", "d0", "d2"]


def test_suspects_rank_last():
    matches = [match(worker("d0", "decode"), 4), match(worker("d1", "decode"), 0)]
    assert ids(rank_decode_workers(matches, POLICY, 64, suspects={"d0"})) == ["d1", "d0"]
    pm = [match(worker("p0", "prefill"), 4), match(worker("p1", "prefill"), 0)]
    assert ids(rank_prefill_workers(pm, POLICY, suspects={"p0"}).candidates) == ["p1", "p0"]


def test_no_decode_worker_gives_empty_ranking():
    assert rank_decode_workers([match(worker("p0", "prefill"))], POLICY, 10) == []


# --------------------------------------------------------------------------------------------- prefill workers
def test_prefill_score_is_cached_tokens_minus_load_penalty():
    matches = [match(worker("p0", "prefill", running=1), 10),      # 160 - 100 = 60
               match(worker("p1", "prefill"), 2),                  # 32
               match(worker("p2", "prefill", waiting=2), 13)]      # 208 - 200 = 8
    ranking = rank_prefill_workers(matches, POLICY)
    assert ids(ranking.candidates) == ["p0", "p1", "p2"]
    assert [c.score for c in ranking.candidates] == [60, 32, 8]
    assert ranking.num_saturated == 0


def test_saturated_prefill_workers_are_left_out_and_counted():
    matches = [match(worker("p0", "prefill", running=1, waiting=3), 10), match(worker("p1", "prefill"), 0),
               match(worker("p2", "prefill"), 0)]
    ranking = rank_prefill_workers(matches, POLICY, inflight={"p2": 4})
    assert ids(ranking.candidates) == ["p1"]
    assert ranking.num_saturated == 2


def test_dispatched_blocks_count_as_cached_when_the_index_lags():
    # p0 is computing a 10-block prefix for an earlier request (load 1), the index knows nothing yet: without
    # the dispatched count the idle p1 would win and compute the prefix a second time.
    matches = [match(worker("p0", "prefill"), 0), match(worker("p1", "prefill"), 0)]
    assert ids(rank_prefill_workers(matches, POLICY, inflight={"p0": 1}).candidates) == ["p1", "p0"]
    ranking = rank_prefill_workers(matches, POLICY, inflight={"p0": 1}, dispatched={"p0": 10})
    assert ids(ranking.candidates) == ["p0", "p1"]
    assert [(c.num_cached_blocks, c.score) for c in ranking.candidates] == [(10, 160 - 100), (0, 0)]
    # the index's own answer wins when it is larger
    ranking = rank_prefill_workers([match(worker("p0", "prefill"), 12)], POLICY, dispatched={"p0": 10})
    assert ranking.candidates[0].num_cached_blocks == 12


def test_dispatched_prefixes_remember_until_hold_after_finish():
    d = DispatchedPrefixes(hold_s=5.0)
    d.start("p0", [1, 2, 3])
    d.start("p1", [1, 9])
    assert d.leading_blocks([1, 2, 3, 4], now=0.0) == {"p0": 3, "p1": 1}
    assert d.leading_blocks([1, 2, 3], now=1e9) == {"p0": 3, "p1": 1}   # running: no expiry
    d.finish("p0", [1, 2, 3], now=10.0, held=True)
    assert d.leading_blocks([1, 2, 3], now=14.9) == {"p0": 3, "p1": 1}
    assert d.leading_blocks([1, 2, 3], now=15.0) == {"p1": 1}
    d.finish("p1", [1, 9], now=16.0, held=False)                        # failed: forgotten at once
    assert d.leading_blocks([1, 9], now=16.0) == {}
    assert len(d) == 0


def test_dispatched_prefixes_overlapping_prefills_on_one_worker():
    d = DispatchedPrefixes(hold_s=5.0)
    d.start("p0", [1, 2])
    d.start("p0", [1, 2, 3])
    d.finish("p0", [1, 2], now=0.0, held=False)          # the other Prefill of 1, 2 still runs
    assert d.leading_blocks([1, 2, 3], now=100.0) == {"p0": 3}
    d.finish("p0", [1, 2, 3], now=100.0, held=True)
    d.start("p0", [1])                                   # renewed while the hold runs: kept past the old expiry
    assert d.leading_blocks([1, 2], now=105.0) == {"p0": 1}
    d.finish("p0", [1], now=106.0, held=True)
    assert d.leading_blocks([1, 2], now=110.0) == {"p0": 1}
    assert d.leading_blocks([1, 2], now=111.0) == {}
    assert len(d) == 0


def test_prefill_tie_broken_by_id():
    matches = [match(worker("p1", "prefill")), match(worker("p0", "prefill"))]
    assert ids(rank_prefill_workers(matches, POLICY).candidates) == ["p0", "p1"]


# --------------------------------------------------------------------------------------------- local prefill
def test_short_missing_part_prefills_locally():
    ranking = rank_prefill_workers([match(worker("p0", "prefill"))], POLICY)
    plan = plan_prefill(100, 80, ranking, POLICY)         # 20 missing < 32
    assert (plan.local, plan.reason, plan.candidates) == (True, LOCAL_SHORT, ())


def test_missing_part_at_threshold_goes_to_a_prefill_worker():
    ranking = rank_prefill_workers([match(worker("p0", "prefill"))], POLICY)
    plan = plan_prefill(112, 80, ranking, POLICY)         # 32 missing: not < 32
    assert (plan.local, plan.reason, ids(plan.candidates)) == (False, "", ["p0"])


def test_no_prefill_worker_prefills_locally():
    plan = plan_prefill(500, 0, PrefillRanking((), 0), POLICY)
    assert (plan.local, plan.reason) == (True, LOCAL_NO_PREFILL_WORKER)


def test_all_prefill_workers_saturated_prefills_locally():
    ranking = rank_prefill_workers([match(worker("p0", "prefill", waiting=9))], POLICY)
    plan = plan_prefill(500, 0, ranking, POLICY)
    assert (plan.local, plan.reason) == (True, LOCAL_SATURATED)


def test_short_prompt_goes_to_an_idle_prefill_worker_while_decode_is_busy():
    matches = [match(worker("p0", "prefill")), match(worker("p1", "prefill", running=1)),
               match(worker("p2", "prefill"))]
    ranking = rank_prefill_workers(matches, POLICY, inflight={"p2": 1})
    plan = plan_prefill(100, 80, ranking, POLICY, decode_load=3)     # 20 missing < 32, >= 16
    assert (plan.local, plan.reason, ids(plan.candidates)) == (False, "", ["p0"])   # only the idle one


@pytest.mark.parametrize("decode_load, p0_running, num_prompt, min_tokens", [
    (0, 0, 100, 16),     # D decodes nothing: a local prefill stalls nobody
    (2, 1, 100, 16),     # no idle prefill worker: its queue would cost this request more
    (2, 0, 95, 16),      # 15 missing < idle_offload_min_tokens
    (2, 0, 100, 0),      # turned off
])
def test_short_prompt_stays_local(decode_load, p0_running, num_prompt, min_tokens):
    policy = RoutingPolicy(block_size=16, fingerprint=FP, local_prefill_threshold=32,
                           idle_offload_min_tokens=min_tokens)
    ranking = rank_prefill_workers([match(worker("p0", "prefill", running=p0_running))], policy)
    plan = plan_prefill(num_prompt, 80, ranking, policy, decode_load=decode_load)
    assert (plan.local, plan.reason) == (True, LOCAL_SHORT)


def test_threshold_zero_never_prefills_locally_while_a_prefill_worker_lives():
    policy = RoutingPolicy(block_size=16, fingerprint=FP, local_prefill_threshold=0)
    ranking = rank_prefill_workers([match(worker("p0", "prefill"))], policy)
    assert plan_prefill(5, 0, ranking, policy).local is False


@pytest.mark.parametrize("field, value", [("block_size", 0), ("max_prefill_load", 0),
                                          ("local_prefill_threshold", -1), ("idle_offload_min_tokens", -1),
                                          ("prefill_load_penalty_tokens", -1)])
def test_policy_validation(field, value):
    kwargs = {"block_size": 16, "fingerprint": FP, field: value}
    with pytest.raises(ValueError, match=field):
        RoutingPolicy(**kwargs)


# --------------------------------------------------------------------------------------------- round robin
RR = RoutingPolicy(block_size=16, fingerprint=FP, max_prefill_load=4, mode="round-robin")


def test_round_robin_ignores_prefix_hits_and_load_and_rotates():
    pm = [match(worker("p1", "prefill"), 9), match(worker("p0", "prefill", running=3), 0),
          match(worker("p2", "prefill"), 0)]
    assert [ids(rank_prefill_workers(pm, RR, turn=t).candidates) for t in range(4)] == [
        ["p0", "p1", "p2"], ["p1", "p2", "p0"], ["p2", "p0", "p1"], ["p0", "p1", "p2"]]
    dm = [match(worker("d1", "decode"), 5), match(worker("d0", "decode", running=9), 0)]
    assert [ids(rank_decode_workers(dm, RR, 10, turn=t)) for t in range(3)] == [["d0", "d1"], ["d1", "d0"],
                                                                                ["d0", "d1"]]


def test_round_robin_still_puts_suspects_last_and_drops_saturated():
    pm = [match(worker("p0", "prefill")), match(worker("p1", "prefill")), match(worker("p2", "prefill", waiting=4))]
    ranking = rank_prefill_workers(pm, RR, suspects={"p1"}, turn=1)
    assert ids(ranking.candidates) == ["p0", "p1"] and ranking.num_saturated == 1


def test_unknown_routing_mode_is_refused():
    with pytest.raises(ValueError, match="mode"):
        RoutingPolicy(block_size=16, fingerprint=FP, mode="random")
