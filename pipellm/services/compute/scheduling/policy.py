"""Scheduling policies: the order waiting requests are served in, and whom to preempt for them.

Each policy is an object behind `SchedulingPolicy`; the scheduler asks it for a request's
urgency key (lower: more urgent) and never switches on its name (`make_scheduling_policy` is
the one place that reads --scheduling-policy). `Fcfs` keeps arrival order and never reorders
(the scheduler then runs exactly as before policies existed); `Priority` is vLLM's
(priority, arrival); `ShortestPredicted` is (priority, predicted remaining work, aged).

Invariants of the reordering policies: keys are compared within one step's `now`; a request's
key does not rise as it waits or runs (its age grows, its remaining work shrinks) unless it is
preempted (its recompute counts as prefill again) or its prediction is refined; a preempted
request's boost is at most `MAX_BOOSTS` x `boost_s` of extra age, never across priorities.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from pipellm.services.compute.core.sequence import Sequence
from pipellm.shared.config import SchedulerConfig, SchedulingPolicyName

MAX_BOOSTS = 2  # preemptions that each add boost_s of age to a request (then no more)
BOOST_SHARE = 0.25  # boost_s as a share of --max-queue-delay-ms
PACE_WEIGHT = 0.05  # StepPace: the newest interval's weight in the average
PREEMPT_MARGIN = 2.0  # ShortestPredicted: a running request's work over a waiting one's to yield


class SchedulingPolicy(Protocol):
    name: SchedulingPolicyName
    reorders: bool  # False: plain FCFS (no keys, no preemption for urgency)

    def key(self, seq: Sequence, now: float) -> tuple:
        """seq's urgency at `now`: lower is served first; a running request is preempted for
        a waiting one whose key is strictly lower."""

    def tick(self, now: float, busy: bool) -> None:
        """A step is scheduled at `now`; `busy`: requests ran since the last one."""

    def displaces(self, urgent: tuple, key: tuple) -> bool:
        """Whether a waiting request of key `urgent` preempts a running one of key `key` (for
        its place; never when key <= urgent). Monotone: true for a key, true for any higher
        one of the same priority."""


def victim_order(policy: SchedulingPolicy, seq: Sequence, now: float) -> tuple:
    """The order in which running requests are preempted, highest first: the least urgent,
    the latest arrival among equals, then the latest admitted."""
    return policy.key(seq, now), seq.arrival or 0.0, seq.admit_order


def boosted_age(seq: Sequence, now: float, boost_s: float) -> float:
    """Seconds since seq arrived, plus boost_s per preemption it suffered (at most
    MAX_BOOSTS of them)."""
    return now - (seq.arrival or 0.0) + min(seq.preemptions, MAX_BOOSTS) * boost_s


class StepPace:
    """The engine's step time, measured: an exponential average (weight PACE_WEIGHT) of the
    intervals between steps scheduled back to back while requests ran (an idle gap is no
    step). 0.0 until one is measured."""

    def __init__(self):
        self.step_s, self._last = 0.0, None

    def tick(self, now: float, busy: bool) -> None:
        if busy and self._last is not None and now > self._last:
            dt = now - self._last
            self.step_s = dt if not self.step_s else \
                self.step_s + PACE_WEIGHT * (dt - self.step_s)
        self._last = now


class _Plain:
    """No step clock; a waiting request preempts any running one strictly less urgent."""

    def tick(self, now: float, busy: bool) -> None:
        return None

    def displaces(self, urgent: tuple, key: tuple) -> bool:
        return key > urgent


@dataclass(frozen=True)
class Fcfs(_Plain):
    name: ClassVar[SchedulingPolicyName] = SchedulingPolicyName.FCFS
    reorders: ClassVar[bool] = False

    def key(self, seq: Sequence, now: float) -> tuple:
        return (-boosted_age(seq, now, 0.0),)


@dataclass(frozen=True)
class Priority(_Plain):
    """vLLM's priority policy: (priority, arrival); a preempted request is re-admitted as if it
    had arrived boost_s earlier per preemption (bounded)."""

    boost_s: float
    name: ClassVar[SchedulingPolicyName] = SchedulingPolicyName.PRIORITY
    reorders: ClassVar[bool] = True

    def key(self, seq: Sequence, now: float) -> tuple:
        return seq.priority, -boosted_age(seq, now, self.boost_s)


@dataclass(frozen=True)
class ShortestPredicted:
    """(priority, work) while a request is younger than its bound, then (priority, -overdue
    seconds). Work is the share of the engine it still needs, in steps of the whole engine,
    always > 0: its tokens left to prefill over the step's token budget (a step prefills at
    most that many) plus its predicted remaining output (the conditional median, capped by
    max_tokens) over the running limit (a step decodes one token of at most that many
    requests). So whichever of prefill and decode is the bottleneck weighs most: within a
    priority the job predicted to take least of the engine goes first.

    A request's bound is max_delay_s or, with a delay_factor, at most that multiple of its own
    predicted service time (`service_steps` at the measured step time), fixed when it is first
    keyed. Once it has waited its bound (boosted age) it goes before every request not
    overdue, the overdue in order of their deadlines (arrival + bound: FCFS when every bound is
    max_delay_s): its wait is at most its bound plus the time to serve the overdue requests
    whose deadlines come first (no starvation; under a sustained overload that tail grows, as
    FCFS's does).

    A waiting request preempts a running one of its priority, neither overdue, only if the
    running one's work exceeds PREEMPT_MARGIN x its own (a margin for the predictions' error,
    so that near-equals do not swap); across priorities, or when either is overdue, the keys
    decide."""

    max_delay_s: float
    step_tokens: int  # --max-batched-tokens: prompt tokens one step prefills
    running_slots: int  # --max-running: requests one step decodes
    boost_s: float
    delay_factor: float = 0.0  # --max-queue-delay-factor (0: max_delay_s alone)
    pace: StepPace = field(default_factory=StepPace, compare=False, repr=False)
    name: ClassVar[SchedulingPolicyName] = SchedulingPolicyName.PREDICTED
    reorders: ClassVar[bool] = True
    # seq -> (its LengthDist, the predicted total output): recomputed once outgrown
    _totals: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary,
                                               compare=False, repr=False)
    _bounds: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary,
                                               compare=False, repr=False)

    def tick(self, now: float, busy: bool) -> None:
        self.pace.tick(now, busy)

    def displaces(self, urgent: tuple, key: tuple) -> bool:
        if key[0] != urgent[0] or key[1] <= 0 or urgent[1] <= 0:
            return key > urgent
        return key[1] > PREEMPT_MARGIN * urgent[1]

    def key(self, seq: Sequence, now: float) -> tuple:
        overdue = boosted_age(seq, now, self.boost_s) - self.bound(seq)
        return seq.priority, self.work(seq) if overdue < 0 else -overdue

    def bound(self, seq: Sequence) -> float:
        """seq's aging bound in seconds (see the class docstring); once the step time is
        measured, at most delay_factor x its service steps x that time."""
        b = self._bounds.get(seq)
        if b is None:
            b = self.max_delay_s
            if self.delay_factor and self.pace.step_s:
                b = min(b, self.delay_factor * self.service_steps(seq) * self.pace.step_s)
            self._bounds[seq] = b
        return b

    def service_steps(self, seq: Sequence) -> int:
        """Steps seq is predicted to take once admitted: its prefill chunks plus one per
        predicted output token."""
        return -(-seq.pending // self.step_tokens) + self.remaining_output(seq)

    def work(self, seq: Sequence) -> float:
        """Predicted engine steps it still takes: prefill left / step_tokens + output left /
        running_slots."""
        return seq.pending / self.step_tokens + self.remaining_output(seq) / self.running_slots

    def remaining_output(self, seq: Sequence) -> int:
        """Tokens seq is predicted to generate still (>= 1 until it finishes)."""
        dist, g = seq.predicted_length, seq.num_output
        cached = self._totals.get(seq)
        if cached is None or cached[0] is not dist or cached[1] <= g:
            cached = dist, dist.conditional_quantile(g, 0.5)
            self._totals[seq] = cached
        return max(min(cached[1], seq.max_len - seq.num_prompt) - g, 1)


def make_scheduling_policy(config: SchedulerConfig) -> SchedulingPolicy:
    """The policy --scheduling-policy names, with its settings from `config`."""
    delay_s = config.max_queue_delay_ms / 1e3
    match config.scheduling_policy:
        case SchedulingPolicyName.FCFS:
            return Fcfs()
        case SchedulingPolicyName.PRIORITY:
            return Priority(BOOST_SHARE * delay_s)
        case SchedulingPolicyName.PREDICTED:
            return ShortestPredicted(delay_s, config.max_batched_tokens, config.max_running,
                                     BOOST_SHARE * delay_s, config.max_queue_delay_factor)
