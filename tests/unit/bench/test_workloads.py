"""Workload generators: deterministic for a seed, lengths as asked, shared prefixes really shared."""

from __future__ import annotations

import pytest

from pdserve.bench.workloads import (TemplateFormat, multi_turn_workload, random_workload, sessions,
                                     shared_prefix_workload, warmup_request)


def chatml(messages: list[dict]) -> str:
    """A ChatML-like template that adds a default system prompt when there is none (as SmolLM2's does)."""
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": "DEFAULT"}] + messages
    text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
    return text + "<assistant>"


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]  # one id per character


FMT = TemplateFormat(chatml, encode)


def test_random_is_deterministic_and_seed_dependent():
    a = random_workload(8, 32, 16, seed=1)
    assert a == random_workload(8, 32, 16, seed=1)
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in random_workload(8, 32, 16, seed=2)]
    assert len({r.request_id for r in a}) == 8


def test_random_lengths_as_asked():
    fixed = random_workload(20, 50, 7, seed=0)
    assert {r.prompt_len for r in fixed} == {50}
    assert {r.max_tokens for r in fixed} == {7}
    ranged = random_workload(200, 100, 40, seed=0, range_ratio=0.5)
    assert all(50 <= r.prompt_len <= 150 for r in ranged)
    assert all(20 <= r.max_tokens <= 60 for r in ranged)
    assert len({r.prompt_len for r in ranged}) > 20
    assert all(1000 <= t < 30000 for r in ranged for t in r.prompt_ids)


def test_random_length_counts_the_template():
    overhead = len(encode("<system>DEFAULT</><user></><assistant>"))
    requests = random_workload(5, overhead + 10, 4, seed=0, fmt=FMT, token_range=(200000, 200100))
    for r in requests:
        assert r.prompt_len == overhead + 10
        ids = list(r.prompt_ids)
        assert ids[:len(encode("<system>DEFAULT</><user>"))] == encode("<system>DEFAULT</><user>")
        assert ids[-len(encode("</><assistant>")):] == encode("</><assistant>")
        assert all(200000 <= t < 200100 for t in ids[len(encode("<system>DEFAULT</><user>")):-14])


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    w = shared_prefix_workload(num_groups=3, prompts_per_group=4, prefix_len=40, suffix_len=8, output_len=5, seed=7)
    assert w == shared_prefix_workload(3, 4, 40, 8, 5, seed=7)
    assert w.shared_len == 40
    assert len(w.requests) == 12
    assert all(r.prompt_len == 48 and r.max_tokens == 5 for r in w.requests)
    by_group: dict[int, list] = {}
    for r in w.requests:
        by_group.setdefault(r.group_id, []).append(r.prompt_ids)
    assert sorted(by_group) == [0, 1, 2] and all(len(v) == 4 for v in by_group.values())
    heads = {g: {p[:40] for p in prompts} for g, prompts in by_group.items()}
    assert all(len(h) == 1 for h in heads.values())  # one shared prefix per group
    assert len({next(iter(h)) for h in heads.values()}) == 3  # and they differ across groups
    suffixes = [p[40:] for prompts in by_group.values() for p in prompts]
    assert len(set(suffixes)) == 12  # unique suffixes
    groups_in_order = [r.group_id for r in w.requests]
    assert groups_in_order != sorted(groups_in_order)  # interleaved, not grouped


def test_shared_prefix_with_template_reports_the_shared_length():
    w = shared_prefix_workload(2, 3, prefix_len=10, suffix_len=5, output_len=2, seed=0, fmt=FMT,
                               token_range=(200000, 200100))
    # "<system>" + 10 ids + "</><user>" are common to the group; the suffix follows
    assert w.shared_len == len(encode("<system>")) + 10 + len(encode("</><user>"))
    for g in (0, 1):
        prompts = [r.prompt_ids for r in w.requests if r.group_id == g]
        assert len({p[:w.shared_len] for p in prompts}) == 1
        assert len({p[w.shared_len] for p in prompts}) == 3  # unique suffixes start right after


def test_multi_turn_histories_grow_and_are_sessions():
    requests = multi_turn_workload(num_conversations=2, num_turns=3, user_len=6, output_len=4, seed=5)
    assert requests == multi_turn_workload(2, 3, 6, 4, seed=5)
    assert [r.session_id for r in requests] == [0, 0, 0, 1, 1, 1]
    turns = requests[:3]
    assert [r.prompt_len for r in turns] == [6, 6 + 4 + 6, 6 + 4 + 6 + 4 + 6]
    for earlier, later in zip(turns, turns[1:]):
        assert later.prompt_ids[:earlier.prompt_len] == earlier.prompt_ids  # each turn extends the last
    assert requests[3].prompt_ids[:6] != requests[0].prompt_ids[:6]
    units = sessions(requests)
    assert [[r.request_id for r in u] for u in units] == [["chat-0-0", "chat-0-1", "chat-0-2"],
                                                          ["chat-1-0", "chat-1-1", "chat-1-2"]]


def test_sessions_keep_lone_requests_alone_in_order():
    requests = random_workload(3, 8, 2, seed=0)
    assert sessions(requests) == [[r] for r in requests]


def test_template_format_caches_per_shape_and_checks_content():
    ids = FMT.prompt_ids([("user", [1, 2]), ("assistant", [3]), ("user", [4])])
    assert ids == (encode("<system>DEFAULT</><user>") + [1, 2] + encode("</><assistant>") + [3]
                   + encode("</><user>") + [4] + encode("</><assistant>"))
    dropping = TemplateFormat(lambda messages: "<assistant>", encode)
    with pytest.raises(ValueError, match="dropped"):
        dropping.prompt_ids([("user", [1])])


def test_warmup_shares_no_leading_tokens():
    requests = random_workload(4, 64, 8, seed=0)
    warm = warmup_request(requests)
    assert warm.prompt_len == 16 and warm.max_tokens == 4
    assert all(warm.prompt_ids[:4] != r.prompt_ids[:4] for r in requests)


def test_bad_arguments():
    with pytest.raises(ValueError):
        random_workload(0, 8, 2)
    with pytest.raises(ValueError):
        random_workload(1, 8, 2, range_ratio=1.0)
    with pytest.raises(ValueError):
        shared_prefix_workload(1, 1, 0, 1, 1)
    with pytest.raises(ValueError):
        random_workload(1, 8, 2, token_range=(5, 6))
