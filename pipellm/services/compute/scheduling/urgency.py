"""One step's urgency under a reordering scheduling policy (policy.py): the keys, the waiting
order, and the running requests to preempt for the head of the queue. Pure logic.

Invariants: within a step every key is computed at one `now` and cached (a preempted request's
key is forgotten: its work changed); the waiting queue is sorted by key, stable (equal keys
keep their order); a request is preempted for the head only while the head is blocked (the
running limit is reached, or its reservation does not fit free and cached KV, or the future
peak check refuses it) and only if the policy lets the head displace it (strictly less urgent,
by a margin under predicted: SchedulingPolicy.displaces), least urgent first (latest arrival
among equals). A running request whose KV must grow mid-decode may
preempt only requests strictly less urgent than it that have no token in this step yet (the
scheduler serves decodes most urgent first), else it yields itself (`yielding`).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from pipellm.services.compute.core.sequence import SeqStatus, Sequence
from pipellm.services.compute.scheduling.policy import SchedulingPolicy, victim_order

if TYPE_CHECKING:
    from pipellm.services.compute.scheduling.scheduler import Scheduler


class Urgency:
    def __init__(self, policy: SchedulingPolicy):
        self.policy = policy
        self.now = 0.0
        self._keys: dict[Sequence, tuple] = {}

    def start(self, now: float, waiting: deque[Sequence], busy: bool) -> None:
        """A new step at `now` (`busy`: requests ran since the last one): fresh keys, the
        queue sorted by them."""
        self.policy.tick(now, busy)
        self.now, self._keys = now, {}
        self.order(waiting)

    def key(self, seq: Sequence) -> tuple:
        k = self._keys.get(seq)
        if k is None:
            k = self._keys[seq] = self.policy.key(seq, self.now)
        return k

    def forget(self, seq: Sequence) -> None:
        self._keys.pop(seq, None)

    def order(self, waiting: deque[Sequence]) -> None:
        """Sort `waiting` in place, most urgent first."""
        ordered = sorted(waiting, key=self.key)
        waiting.clear()
        waiting.extend(ordered)

    def yielding(self, seq: Sequence, later: list[Sequence]) -> list[Sequence]:
        """Those of `later` (running requests not yet served this step) that seq may preempt
        to grow its KV: the strictly less urgent, least urgent first (victim_order)."""
        urgent = self.key(seq)
        less = [s for s in later if s.status is SeqStatus.RUNNING and self.key(s) > urgent]
        return sorted(less, key=lambda s: victim_order(self.policy, s, self.now), reverse=True)

    def victims(self, sched: Scheduler) -> list[Sequence]:
        """Running requests to preempt so that the head of sched's queue may be admitted
        (module docstring); none when it is not blocked or nobody is less urgent."""
        if not sched.waiting or not sched.running:
            return []
        head = sched.waiting[0]
        if not _blocked(sched, head, sched.running):
            return []
        urgent = self.key(head)
        order = sorted(sched.running, key=lambda s: victim_order(self.policy, s, self.now),
                       reverse=True)
        chosen: list[Sequence] = []
        for seq in order:
            if not self.policy.displaces(urgent, self.key(seq)):
                break
            chosen.append(seq)
            left = [s for s in sched.running if s not in chosen]
            if not _blocked(sched, head, left, freed=sum(s.kv_reserved for s in chosen)):
                break
        return chosen


def _blocked(sched: Scheduler, head: Sequence, running: list[Sequence], freed: int = 0,
             ) -> bool:
    """Whether `head` could not be admitted beside `running` (holding all but `freed` of the
    slots the scheduler's requests hold now)."""
    if len(running) >= sched.config.max_running:
        return True
    kv, size = sched.kv, sched.reservation(head)
    free = kv.allocator.free_slots + freed + \
        (kv.prefix_cache.slots if kv.prefix_cache is not None else 0)
    if free < size or not kv.policy.can_admit(kv.allocator, max(size - freed, 0)):
        return True
    check = sched.peak_check
    return check is not None and \
        not check(running, sched.config.kv_peak_quantile, kv.capacity).fits(head)
