"""Stop strings over a text stream: hold back what could still become a stop, report a match.

Which match wins: the one that starts earliest in the whole text; among stops starting at the
same position, the shortest (it is complete first; with the stop excluded from the output the
choice does not change the text anyway). The result therefore does not depend on how the text
is chunked into feeds: a match is reported only once no stop starting earlier can still
complete, so a match may be reported a few characters after it was first seen (e.g. stops
["c", "bcd"] on "bc..." wait for the character after "c"). `flush()` settles such a pending match.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Holds back text that could still become a stop string; reports the first match."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        """`stops` must be non-empty strings; with none, text passes straight through."""
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not a string")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._include = include_stop_str_in_output
        self._longest = max((len(s) for s in self._stops), default=0)
        # Invariant: no stop occurrence can start in text already emitted, i.e. `_pending` is
        # all the text from the earliest position where a stop could still begin.
        self._pending = ""
        self._matched = False
        self.stop: str | None = None  # the stop string matched, once one has

    @property
    def matched(self) -> bool:
        """Whether a stop string has been matched (by `feed` or `flush`)."""
        return self._matched

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop has matched).

        After a match the emitted text ends right before the stop (right after it with
        `include_stop_str_in_output`); nothing after it is ever emitted: ('', True) from then on.
        """
        if self._matched:
            return "", True
        if not self._stops:
            return text, False
        self._pending += text
        return self._settle(final=False)

    def flush(self) -> str:
        """End of request: the held-back text (cut at the stop if a pending match settles)."""
        if self._matched:
            return ""
        out, _ = self._settle(final=True)
        return out

    def _settle(self, final: bool) -> tuple[str, bool]:
        buf = self._pending
        match = self._first_match(buf)
        # At end of stream no partial stop can complete, so nothing needs holding back.
        hold = len(buf) if final else self._partial_start(buf)
        if match is not None and match[0] <= hold:
            # No stop starting before match[0] can still complete: the match is final.
            start, length = match
            self._matched = True
            self.stop = buf[start : start + length]
            self._pending = ""
            return buf[: start + length if self._include else start], True
        self._pending = buf[hold:]
        return buf[:hold], False

    def _first_match(self, buf: str) -> tuple[int, int] | None:
        """(start, length) of the complete stop starting first in `buf`, shortest on ties."""
        found = [(i, len(s)) for s in self._stops if (i := buf.find(s)) >= 0]
        return min(found, default=None)

    def _partial_start(self, buf: str) -> int:
        """Start of the longest suffix of `buf` that is a proper prefix of a stop (else len)."""
        for start in range(max(0, len(buf) - self._longest + 1), len(buf)):
            tail = buf[start:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stops):
                return start
        return len(buf)
