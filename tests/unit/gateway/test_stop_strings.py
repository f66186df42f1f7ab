"""StopStringMatcher: exact emitted text for deltas that split stop strings every way."""
from __future__ import annotations

import itertools
import random

import pytest

from gateway.stop_strings import StopStringMatcher


def run(stop, deltas):
    """Feed deltas; return (list of emitted pieces, whether stopped, text returned by flush)."""
    matcher = StopStringMatcher(stop)
    pieces = []
    stopped = False
    for delta in deltas:
        text, stopped = matcher.add(delta)
        pieces.append(text)
        if stopped:
            break
    return pieces, stopped, matcher.flush()


def reference(stop, text):
    cuts = [text.find(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


def test_no_stop_strings_passes_text_through():
    assert run([], ["Hello", ", ", "world"]) == (["Hello", ", ", "world"], False, "")


def test_match_inside_one_delta_truncates_before_it():
    assert run(["STOP"], ["abc", "deSTOPfg", "never"]) == (["abc", "de"], True, "")


def test_stop_string_split_over_three_deltas_is_held_then_dropped():
    assert run(["</end>"], ["text </", "en", "d> tail"]) == (["text ", "", ""], True, "")


def test_partial_prefix_that_does_not_complete_is_released():
    # "</" and "</en" are held while they could start "</end>", released when the next char rules it out.
    assert run(["</end>"], ["a</", "en", "x!"]) == (["a", "", "</enx!"], False, "")


def test_flush_returns_held_tail_when_stream_ends():
    assert run(["###"], ["value: 1#", "#"]) == (["value: 1", ""], False, "##")


def test_earliest_start_wins_over_first_listed():
    assert run(["b", "xa"], ["zxab"]) == (["z"], True, "")
    matcher = StopStringMatcher(["ab", "b"])
    assert matcher.add("xab") == ("x", True)
    assert matcher.matched == "ab"


def test_longest_candidate_prefix_is_held_across_stop_strings():
    # "ab" could start "abc"; "b" alone could start "bd": hold the longest, "ab".
    matcher = StopStringMatcher(["abc", "bd"])
    assert matcher.add("xab") == ("x", False)
    assert matcher.add("d") == ("a", True)      # "abd": "bd" starts at 1
    assert matcher.matched == "bd"


def test_stop_string_at_the_very_start():
    assert run(["Q"], ["Q and more"]) == ([""], True, "")


def test_after_stop_everything_is_dropped():
    matcher = StopStringMatcher(["."])
    assert matcher.add("one.") == ("one", True)
    assert matcher.add("two") == ("", True)
    assert matcher.flush() == ""
    assert matcher.stopped


def test_non_ascii_stop_strings():
    assert run(["日本"], ["今日は日", "本語"]) == (["今日は", ""], True, "")


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


@pytest.mark.parametrize("seed", range(40))
def test_every_split_equals_the_reference_cut(seed):
    rng = random.Random(seed)
    alphabet = "ab c"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
    deltas = [text[i:j] for i, j in itertools.pairwise([0, *cuts, len(text)])]
    pieces, stopped, tail = run(stop, deltas)
    assert "".join(pieces) + tail == reference(stop, text)
    assert stopped == any(s in text for s in stop)


def test_include_stop_keeps_the_stop_string_and_drops_what_follows():
    matcher = StopStringMatcher(["</end>"], include_stop=True)
    assert [matcher.add(d) for d in ["text </", "en", "d> tail"]] == [("text ", False), ("", False),
                                                                       ("</end>", True)]
    assert matcher.flush() == ""
    matcher = StopStringMatcher(["ab", "b"], include_stop=True)
    assert matcher.add("xab tail") == ("xab", True)
