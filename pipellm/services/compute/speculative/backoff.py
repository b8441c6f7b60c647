"""Back-off: a verify that accepts fewer than half its drafts cost more rows than it saved
steps, so a request whose verifies keep doing that proposes nothing for its next 2, 4, ... 32
decode steps (doubling with each such verify in a row, reset by a good one): where the
proposals miss (text that does not copy from its context, a draft model that disagrees with
the target), speculation fades out instead of slowing every step."""

from __future__ import annotations

from weakref import WeakKeyDictionary

from pipellm.services.compute.core.sequence import Sequence

MAX_SKIP = 32  # decode steps without proposals after poor verifies, at most


class Backoff:
    """Per request: decode steps to propose nothing for, and poor verifies in a row."""

    def __init__(self):
        self._state: WeakKeyDictionary[Sequence, list[int]] = WeakKeyDictionary()

    def skipping(self, seq: Sequence) -> bool:
        """Whether seq proposes nothing for this decode step (counts the step)."""
        state = self._state.get(seq)
        if state is None or not state[0]:
            return False
        state[0] -= 1
        return True

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """seq's verify of `drafted` drafts accepted `accepted`: back off after a poor one."""
        state = self._state.setdefault(seq, [0, 0])  # [skip, poor]
        if 2 * accepted >= drafted:
            state[1] = 0
            return
        state[1] += 1
        state[0] = min(2 ** state[1], MAX_SKIP)
