"""Scheduler + KV cache manager, driven by a fake model: no torch, exact expectations."""

import pytest

from engine.errors import OverloadedError
from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.structured import StructuredOutputSpec

EOS = 2


def make(num_blocks=16, block_size=4, max_num_seqs=8, max_tokens_per_step=64, max_waiting=100, max_model_len=64,
         caching=True, long_prefill_token_threshold=0):
    kv = KVCacheManager(num_blocks, block_size, root_hash=12345, enable_caching=caching)
    cfg = SchedulerConfig(max_num_seqs, max_tokens_per_step, max_waiting, max_model_len, long_prefill_token_threshold)
    return Scheduler(cfg, kv, eos_token_ids=(EOS,))


def seq(rid, prompt, max_tokens=4, **kw):
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw), seed=0)


def fake_next_token(s: Sequence) -> int:
    """A deterministic 'model': the next token depends only on the sequence's tokens."""
    return 10 + sum(s.token_ids) % 37


def step(sched: Scheduler):
    out = sched.schedule()
    sampled = {c.seq.request_id: fake_next_token(c.seq) for c in out.chunks if c.samples}
    return out, [c.seq for c in out.chunks if sched.update(c, sampled.get(c.seq.request_id))]


def run_all(sched: Scheduler, max_steps=1000):
    steps = 0
    while sched.has_unfinished():
        step(sched)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def test_continuous_batching_new_sequence_joins_running_batch():
    sched = make()
    a = seq("a", range(20, 26), max_tokens=5)
    sched.add(a)
    out, _ = step(sched)
    assert [(c.seq.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 6)]
    b = seq("b", range(30, 33), max_tokens=5)
    sched.add(b)
    out, _ = step(sched)
    assert [(c.seq.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 1), ("b", 3)]
    assert all(c.samples for c in out.chunks)
    run_all(sched)
    assert len(a.output_token_ids) == 5 and len(b.output_token_ids) == 5
    assert sched.kv.pool.get_num_used_blocks() == 0


def test_chunked_prefill_splits_prompt_under_token_budget():
    sched = make(max_tokens_per_step=8)
    s = seq("a", range(100, 120), max_tokens=2)
    sched.add(s)
    chunks = []
    while not s.is_finished:
        out, _ = step(sched)
        chunks.append([(c.num_new_tokens, c.samples) for c in out.chunks])
    assert chunks == [[(8, False)], [(8, False)], [(4, True)], [(1, True)]]


def test_budget_shared_between_decode_and_new_prefill():
    sched = make(max_tokens_per_step=8)
    a = seq("a", range(3, 9), max_tokens=10)      # 6 tokens
    sched.add(a)
    step(sched)
    sched.add(seq("b", range(40, 60)))            # 20 tokens, must chunk around a's decode
    out, _ = step(sched)
    assert [(c.seq.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 1), ("b", 7)]


def test_a_long_prefill_capped_per_step_leaves_the_budget_to_those_behind_it():
    sched = make(num_blocks=32, max_tokens_per_step=16, max_model_len=128, long_prefill_token_threshold=6)
    long_seq = seq("long", range(100, 120), max_tokens=2)
    sched.add(long_seq)
    out, _ = step(sched)
    assert [(c.seq.request_id, c.num_new_tokens) for c in out.chunks] == [("long", 6)]
    sched.add(seq("short", range(30, 34), max_tokens=2))
    out, _ = step(sched)
    assert [(c.seq.request_id, c.num_new_tokens, c.samples) for c in out.chunks] == [("long", 6, False),
                                                                                     ("short", 4, True)]
    out, _ = step(sched)
    assert [(c.seq.request_id, c.num_new_tokens) for c in out.chunks] == [("long", 6), ("short", 1)]
    out, _ = step(sched)
    assert [(c.seq.request_id, c.num_new_tokens, c.samples) for c in out.chunks] == [("long", 2, True)]
    uncapped = make(num_blocks=32, max_tokens_per_step=16, max_model_len=128)
    uncapped.add(seq("long", range(100, 120), max_tokens=2))
    step(uncapped)
    uncapped.add(seq("short", range(30, 34), max_tokens=2))
    out, _ = step(uncapped)
    assert [(c.seq.request_id, c.num_new_tokens) for c in out.chunks] == [("long", 4), ("short", 4)]


def test_max_num_seqs_limits_running():
    sched = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(f"s{i}", [5 + i, 6, 7]))
    out, _ = step(sched)
    assert [c.seq.request_id for c in out.chunks] == ["s0", "s1"]
    assert [s.request_id for s in sched.waiting] == ["s2"]


def test_preemption_by_recompute_gives_same_tokens():
    prompts = [list(range(10 + 7 * i, 18 + 7 * i)) for i in range(4)]  # 8 tokens = 2 blocks each

    def outputs(num_blocks):
        sched = make(num_blocks=num_blocks, caching=False)
        seqs = [seq(f"r{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
        for s in seqs:
            sched.add(s)
        run_all(sched)
        assert sched.kv.pool.get_num_free_blocks() == num_blocks
        return [s.output_token_ids for s in seqs], sum(s.num_preemptions for s in seqs)

    roomy, roomy_preemptions = outputs(64)
    tight, tight_preemptions = outputs(8)   # 4 seqs x 5 blocks needed at the end, only 8 blocks
    assert roomy_preemptions == 0
    assert tight_preemptions > 0
    assert tight == roomy


def test_preempted_sequence_goes_to_front_of_waiting_queue():
    sched = make(num_blocks=4, max_model_len=16)
    a, b = seq("a", range(1, 5), max_tokens=8), seq("b", range(11, 15), max_tokens=8)
    sched.add(a)
    sched.add(b)
    c = seq("c", [50, 51, 52])
    step(sched)                           # a and b prefill: 1 block each (4 tokens)
    sched.add(c)
    out, _ = step(sched)                  # each needs a 2nd block: fits (4 blocks)
    assert len(out.chunks) == 2
    for _ in range(3):
        step(sched)
    # both at 8 tokens and needing a 3rd block: b (latest arrival) is preempted
    out, _ = step(sched)
    assert out.preempted == [b]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert b.status is SequenceStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0


def test_prefix_cache_hit_reports_cached_tokens_and_keeps_tokens():
    prompt = list(range(100, 114))          # 14 tokens: 3 full blocks of 4, 2 left over
    cold = make()
    first = seq("a", prompt)
    cold.add(first)
    run_all(cold)

    sched = cold                           # same pool: its blocks are now cached and free
    second = seq("b", prompt)
    sched.add(second)
    out, _ = step(sched)
    assert second.num_cached_tokens == 12
    assert out.chunks[0].num_new_tokens == 2
    run_all(sched)
    assert second.output_token_ids == first.output_token_ids


def test_full_prompt_hit_still_computes_last_token():
    prompt = list(range(100, 108))          # exactly 2 blocks
    sched = make()
    sched.add(seq("a", prompt))
    run_all(sched)
    b = seq("b", prompt)
    sched.add(b)
    out, _ = step(sched)
    assert b.num_cached_tokens == 4 and out.chunks[0].num_new_tokens == 4


def test_cache_salt_isolates_tenants():
    prompt = list(range(100, 114))
    sched = make()
    a = seq("a", prompt)
    a.cache_salt = "tenant-1"
    sched.add(a)
    run_all(sched)
    b = seq("b", prompt)
    b.cache_salt = "tenant-2"
    sched.add(b)
    step(sched)
    assert b.num_cached_tokens == 0


@pytest.mark.parametrize("kw, reason, n", [
    ({"max_tokens": 3}, FinishReason.LENGTH, 3),
    ({"max_tokens": 50, "stop_token_ids": (10 + (1 + 2 + 3) % 37,)}, FinishReason.STOP, 1),
])
def test_stop_conditions(kw, reason, n):
    sched = make()
    s = seq("a", [1, 2, 3], **kw)
    sched.add(s)
    run_all(sched)
    assert s.finish_reason is reason and len(s.output_token_ids) == n


def test_eos_stops_unless_ignored():
    for ignore, expected in ((False, 1), (True, 4)):
        sched = make()
        sched.eos_token_ids = frozenset({10 + 6 % 37})  # the first token the fake model emits for [1, 2, 3]
        s = seq("a", [1, 2, 3], max_tokens=4, ignore_eos=ignore)
        sched.add(s)
        run_all(sched)
        assert len(s.output_token_ids) == expected


def test_context_length_ends_generation():
    sched = make(max_model_len=10)
    s = seq("a", range(1, 8), max_tokens=100)
    sched.add(s)
    run_all(sched)
    assert s.finish_reason is FinishReason.LENGTH and s.num_tokens == 10


def test_abort_frees_blocks_exactly_once():
    sched = make()
    a, b = seq("a", range(1, 10), max_tokens=50), seq("b", range(20, 30), max_tokens=50)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.abort("a") is a and a.finish_reason is FinishReason.ABORT
    assert sched.abort("a") is None
    assert sched.abort("b") is b
    assert sched.kv.pool.get_num_used_blocks() == 0
    assert not sched.has_unfinished()


def test_waiting_queue_bound_raises_overloaded():
    sched = make(max_waiting=2)
    sched.add(seq("a", [1]))
    sched.add(seq("b", [1]))
    with pytest.raises(OverloadedError):
        sched.add(seq("c", [1]))


def test_a_sequence_awaiting_its_grammar_is_passed_over_without_holding_up_the_queue():
    sched = make()
    a, b = seq("a", range(20, 26)), seq("b", range(30, 33))
    a.awaiting_grammar = True
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert [c.seq.request_id for c in out.chunks] == ["b"] and list(sched.waiting) == [a]
    a.awaiting_grammar = False
    out, _ = step(sched)
    assert [(c.seq.request_id, c.num_new_tokens) for c in out.chunks] == [("b", 1), ("a", 6)]
    b.awaiting_grammar = True                           # a running sequence is skipped too (a reservation adopted)
    out, _ = step(sched)
    assert [c.seq.request_id for c in out.chunks] == ["a"]


def test_eos_ends_a_constrained_sequence_even_with_ignore_eos():
    sched = make()
    free = seq("free", [1, 2, 3], max_tokens=3, ignore_eos=True)
    constrained = seq("con", [1, 2, 3], max_tokens=3, ignore_eos=True,
                      structured_output=StructuredOutputSpec.choice(["a"]))
    for s in (free, constrained):
        s.output_token_ids.append(EOS)
    assert sched.stop_reason(free) is None
    assert sched.stop_reason(constrained) is FinishReason.STOP


def test_a_sequence_holding_its_whole_prompts_blocks_prefills_in_capped_chunks():
    """A decode worker's own prefill: the reservation gave the sequence every prompt block up front."""
    sched = make(num_blocks=32, max_tokens_per_step=16, max_model_len=128, long_prefill_token_threshold=6)
    held = seq("held", range(100, 120), max_tokens=2)
    assert sched.kv.can_allocate(held, 20)
    sched.kv.allocate(held, 20)
    blocks = list(held.block_ids)
    assert sched.kv.can_allocate(held, 6)  # needs no block it does not hold already
    sched.kv.allocate(held, 6)
    assert held.block_ids == blocks
