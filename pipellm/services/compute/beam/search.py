"""`BeamSearch`: transformers' beam search (GenerationMixin._beam_search, greedy, one prompt)
on the host, one decode step at a time, rule for rule: of the K best extensions over all beams,
those among the first W that end become hypotheses (scored cum / length ** length_penalty), the
W best that do not end go on; the search stops when transformers' would.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Beam:
    """A running beam: its output tokens, their log-probabilities and their sum; `lane`: the
    KV lane holding its K/V."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    score: float
    lane: int


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its output tokens (a stop id last if it ended on one), their
    log-probabilities, its length-penalised score and why it ended ("stop" | "length")."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    score: float
    finish_reason: str


class BeamSearch:
    """The search of one request; `running` in score order, best first. `step` takes the
    rows of the running beams and returns the lane copies the next step needs."""

    def __init__(self, width: int, max_new: int, stop_ids: frozenset[int],
                 length_penalty: float = 1.0, early_stopping: bool | str = False):
        self.width, self.max_new, self.stop_ids = width, max_new, stop_ids
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.k = max(2, 1 + len(stop_ids)) * width  # candidates each row returns
        self.restart()

    def restart(self) -> None:
        """Back to the prompt (a new search: after a preemption, its K/V is gone)."""
        self.running = [Beam((), (), 0.0, 0)]  # the prompt, in lane 0
        self.finished: list[Hypothesis] = []  # at most width, best first
        self.open = True  # whether a running beam may still beat the finished ones
        self.done = False
        self.copies: list[tuple[int, int]] = []  # lane copies the last step asks for

    @property
    def generated(self) -> int:
        return len(self.running[0].tokens)

    def step(self, rows: list[tuple[list[int], list[float]]]) -> None:
        """rows[i]: the K most likely next tokens of running[i] and their log-probabilities.
        Advance the search; `copies` then holds the (source lane, destination lane) copies:
        the K/V a new beam takes over from its parent, to make before the next step."""
        g = self.generated
        candidates = sorted(
            ((b.score + lp, i, t, lp) for i, (b, (ids, lps)) in
             enumerate(zip(self.running, rows, strict=True))
             for t, lp in zip(ids, lps, strict=True)),
            key=lambda c: -c[0])[: self.k]
        ends = [t in self.stop_ids or g + 1 >= self.max_new for _, _, t, _ in candidates]
        if self._takes_more():  # as the search stood before this step
            for (score, i, t, lp), end in zip(candidates[: self.width], ends, strict=False):
                if end:
                    self._finish(self.running[i], t, lp, score)
        survivors = [c for c, end in zip(candidates, ends, strict=True) if not end]
        self.done = all(ends) or (self.early_stopping is True and self._full)
        self.copies = [] if self.done else self._continue(survivors[: self.width])
        if not self.done:
            self._update_open()
            self.done = not self.open
            self.copies = self.copies if self.open else []

    @property
    def _full(self) -> bool:
        return len(self.finished) == self.width

    def _takes_more(self) -> bool:
        return self.open and not (self.early_stopping is True and self._full)

    def _finish(self, beam: Beam, token: int, lp: float, score: float) -> None:
        """Add beam + token as a hypothesis if it is among the W best."""
        length = len(beam.tokens) + 1
        reason = "stop" if token in self.stop_ids else "length"
        hyp = Hypothesis((*beam.tokens, token), (*beam.logprobs, lp),
                         score / length**self.length_penalty, reason)
        self.finished = sorted([*self.finished, hyp], key=lambda h: -h.score)[: self.width]

    def _continue(self, chosen: list[tuple]) -> list[tuple[int, int]]:
        """The next running beams (each a parent extended by a token); the first child of a
        parent keeps its lane, the others take lanes no child keeps, copied from the parent's
        (sources are kept lanes, destinations are not: the copies may run in any order)."""
        kept: dict[int, int] = {}  # parent index -> its lane, kept by its first child
        for _, i, _, _ in chosen:
            kept.setdefault(i, self.running[i].lane)
        free = [lane for lane in range(self.width) if lane not in kept.values()]
        beams, copies, seen = [], [], set()
        for score, i, t, lp in chosen:
            parent = self.running[i]
            lane = parent.lane if i not in seen else free.pop(0)
            if i in seen:
                copies.append((parent.lane, lane))
            seen.add(i)
            beams.append(Beam((*parent.tokens, t), (*parent.logprobs, lp), score, lane))
        self.running = beams
        return copies

    def _update_open(self) -> None:
        """transformers' early-stop heuristic (sticky): can the best running beam still beat
        the worst of W finished hypotheses?"""
        if not self.open or not self._full:
            return
        lp = self.length_penalty
        length = self.max_new if self.early_stopping == "never" and lp > 0 else self.generated
        self.open = self.running[0].score / length**lp > self.finished[-1].score

    def results(self, n: int) -> list[Hypothesis]:
        """The n best hypotheses, best first (once `done`)."""
        return self.finished[:n]
