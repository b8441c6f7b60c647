"""Merged-step scheduler over the contiguous KV allocator. Pure logic: no torch, sockets or Redis.

Each step: every running request with one pending token contributes a decode token (growing,
moving or, as a last resort, preempting to make room for it); then running requests still in
prefill continue their chunks; then waiting requests are admitted FCFS while the token budget,
the running limit and free KV allow. A prompt larger than the budget is prefilled in chunks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.compute.allocator import KVAllocator
from services.compute.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_batched_tokens: int = 512  # tokens per step (decodes + prefill chunks)
    max_running: int = 256
    # "predicted": reserve prompt + predicted output; "max": prompt + max_tokens
    kv_policy: str = "predicted"
    kv_min_grow: int = 16  # a segment that runs out grows by at least this many slots

    def __post_init__(self):
        if self.kv_policy not in ("predicted", "max"):
            raise ValueError(f"kv_policy must be 'predicted' or 'max', not {self.kv_policy!r}")
        if not 1 <= self.max_running <= self.max_batched_tokens:
            raise ValueError("need 1 <= max_running <= max_batched_tokens")


@dataclass
class ScheduledStep:
    """What one forward runs. Moves (src, dst, n) are KV copies to apply, in order, before it."""

    decodes: list[Sequence] = field(default_factory=list)  # one token each
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, chunk length)
    moves: list[tuple[int, int, int]] = field(default_factory=list)
    # sequences whose next token this step samples: all decodes, then chunks ending their prompt
    sampled: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # taken from the queue this step

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)


@dataclass
class SchedulerStats:
    moves: int = 0
    grows_in_place: int = 0
    preemptions: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: KVAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.stats = SchedulerStats()
        self._admitted = 0

    def add(self, seq: Sequence) -> None:
        if seq.max_len > self.allocator.capacity:
            raise ValueError(
                f"request needs up to {seq.max_len} KV slots but the cache holds "
                f"{self.allocator.capacity}"
            )
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def used_slots(self) -> int:
        return sum(s.num_cached for s in self.running)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        i = 0
        while i < len(self.running):  # victims of preemption are removed from the tail
            seq = self.running[i]
            if seq.pending == 1 and self._make_room(seq, step):
                step.decodes.append(seq)
            i += 1
        budget = self.config.max_batched_tokens - len(step.decodes)
        for seq in self.running:
            if seq.pending > 1 and budget > 0:
                n = min(seq.pending, budget)
                step.prefills.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            if not self._admit(seq):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            step.admitted.append(seq)
            n = min(seq.pending, budget)
            step.prefills.append((seq, n))
            budget -= n
        step.sampled = step.decodes + [s for s, n in step.prefills if n == s.pending]
        return step

    def update(self, step: ScheduledStep, tokens: list[int],
               logprobs: list[float]) -> list[Sequence]:
        """Apply a finished forward: advance caches, append sampled tokens, retire finished."""
        for seq in step.decodes:
            seq.num_cached += 1
        for seq, n in step.prefills:
            seq.num_cached += n
        for seq, tok, lp in zip(step.sampled, tokens, logprobs, strict=True):
            seq.append(tok, lp)
            if seq.finish_reason is not None:
                self._retire(seq)
        return step.sampled

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.allocator.free(seq.kv_start)
        seq.finish_reason = seq.finish_reason or reason
        seq.status = SeqStatus.FINISHED

    def _retire(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.kv_start)
        seq.status = SeqStatus.FINISHED

    def _reservation(self, seq: Sequence) -> int:
        if self.config.kv_policy == "max":
            return seq.max_len
        remaining = max(seq.predicted_output_len - seq.num_output, 1)
        return min(seq.max_len, seq.num_tokens + remaining)

    def _admit(self, seq: Sequence) -> bool:
        size = self._reservation(seq)
        start = self.allocator.allocate(size)
        if start is None:
            return False
        seq.kv_start, seq.kv_reserved = start, size
        seq.status = SeqStatus.RUNNING
        seq.admit_order = self._admitted
        self._admitted += 1
        self.running.append(seq)
        return True

    def _make_room(self, seq: Sequence, step: ScheduledStep) -> bool:
        """Ensure seq's segment holds its pending token. False if seq itself had to be preempted."""
        need = seq.num_tokens
        if need <= seq.kv_reserved:
            return True
        grow = max(self.config.kv_min_grow, seq.kv_reserved // 4)
        target = min(seq.max_len, seq.kv_reserved + grow)
        while True:
            for size in (target, need):
                start = self.allocator.resize(seq.kv_start, size)
                if start is not None:
                    self._relocated(seq, start, size, step)
                    return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False

    def _relocated(self, seq: Sequence, start: int, size: int, step: ScheduledStep) -> None:
        if start == seq.kv_start:
            self.stats.grows_in_place += 1
        else:
            step.moves.append((seq.kv_start, start, seq.num_cached))
            self.stats.moves += 1
        seq.kv_start, seq.kv_reserved = start, size

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's KV and requeue it first in line; it recomputes prompt + output later."""
        self.running.remove(seq)
        self.allocator.free(seq.kv_start)
        seq.num_cached, seq.kv_start, seq.kv_reserved = 0, -1, 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
