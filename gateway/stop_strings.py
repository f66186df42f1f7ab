"""Incremental stop-string matching over streamed text deltas (pure).

Text reaches the gateway in deltas; a stop string may straddle two or more of them. `StopStringMatcher.add`
returns only text that can no longer be part of a stop string and holds back the longest tail of the stream that
is a proper prefix of some stop string. When a stop string completes, the text before its first character is
released and the stream is over: everything after the stop string is dropped, and the stop string itself too
unless the matcher keeps it (`include_stop`, the OpenAI field include_stop_str_in_output).

Invariant: for any split of a text T into deltas, the concatenation of everything returned (add outputs, then
`flush` when no stop string matched) equals T cut just before the earliest occurrence of any stop string, or T
when none occurs. "Earliest" is by start position, so with stop strings "ab" and "b" the text "xab" stops at "x".
Work per delta is O((len(delta) + longest stop string) x number of stop strings).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Holds back text that could start a stop string and truncates at the first match."""

    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        """`stop`: the stop strings; each must be non-empty (the gateway validates that). `include_stop`: the
        text released on a match ends with the stop string instead of just before it."""
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(dict.fromkeys(stop))
        self._include_stop = include_stop
        self._held = ""
        self._stopped = False
        self.matched: str | None = None
        """The stop string that ended the stream, once one has."""

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; later `add` calls return ("", True)."""
        return self._stopped

    def add(self, delta: str) -> tuple[str, bool]:
        """Feed the next delta; return (text safe to emit now, whether a stop string matched)."""
        if self._stopped:
            return "", True
        if not self._stop:
            return delta, False
        # Any match starts inside held + delta: text before it was released only after no suffix of it
        # could begin a stop string.
        text = self._held + delta
        cut = self._earliest_match(text)
        if cut is not None:
            self._held = ""
            self._stopped = True
            if self._include_stop:
                cut += len(self.matched)
            return text[:cut], True
        keep = self._longest_partial_suffix(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """End of stream without a match: the held-back text (it never completed a stop string)."""
        if self._stopped:
            return ""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> int | None:
        best = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.matched = best[1]
        return best[0]

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string (0 if none)."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
