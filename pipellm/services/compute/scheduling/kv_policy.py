"""KV policies: how much of the cache a request's segment holds, and what happens when it runs out.

Each policy is an object behind the `KVPolicy` protocol; the scheduler asks it and never
switches on its name (`make_policy(config)` is the one place that reads it). `Predicted` sizes
segments by the predicted length and regrows them, `MaxLength` reserves prompt + max_tokens and
never grows, `Paged` is the vLLM baseline on a `PagedAllocator`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from pipellm.services.compute.core.sequence import Sequence
from pipellm.services.compute.kv.allocator import KVAllocator
from pipellm.services.compute.kv.compaction import segment_at
from pipellm.services.compute.kv.paged_allocator import PagedAllocator
from pipellm.shared.config import KVPolicyName, SchedulerConfig

PAGED_WATERMARK = 0.01  # vLLM's default share of blocks kept free at admission


class KVPolicy(Protocol):
    name: KVPolicyName
    compacts: bool  # moves segments to close holes (the scheduler then runs a Compactor)
    peak_admission: bool  # what admission "auto" means under this policy

    def allocator(self, capacity: int) -> KVAllocator | PagedAllocator:
        """A fresh allocator of `capacity` slots of the kind this policy manages."""

    def reservation(self, seq: Sequence) -> int:
        """Slots to reserve for seq when it is admitted (or readmitted)."""

    def grow_target(self, seq: Sequence) -> int:
        """The new segment size for seq, whose pending token found no slot."""

    def can_admit(self, allocator, size: int) -> bool:
        """Whether a new segment of `size` slots may be taken now (headroom rules)."""

    def victim(self, running: list[Sequence], seq: Sequence, need: int, allocator,
               candidates: list[Sequence] | None = None) -> Sequence:
        """Whom to preempt so that seq can grow to `need` slots (seq itself if nobody helps).
        `candidates`: those the scheduling policy lets seq preempt (less urgent than seq and
        not yet served this step), least urgent first: the victim is one of them or seq;
        None (FCFS): the policy's own choice among those admitted after seq (the others
        already have their token in this step)."""


@dataclass(frozen=True)
class Predicted:
    reserve_quantile: float
    grow_quantile: float
    horizon: int  # reserve at most this many output slots ahead (0: all)
    min_grow: int
    name: ClassVar[KVPolicyName] = KVPolicyName.PREDICTED
    compacts: ClassVar[bool] = True
    peak_admission: ClassVar[bool] = True

    def allocator(self, capacity: int) -> KVAllocator:
        return KVAllocator(capacity)

    def reservation(self, seq: Sequence) -> int:
        # not finished, so its output will be longer than num_output (0 for a new request)
        total = seq.predicted_length.conditional_quantile(seq.num_output, self.reserve_quantile)
        return min(seq.max_len, seq.num_prompt + self._ahead(seq, total))

    def grow_target(self, seq: Sequence) -> int:
        total = seq.predicted_length.conditional_quantile(seq.num_output, self.grow_quantile)
        return min(seq.max_len, max(seq.num_prompt + self._ahead(seq, total),
                                    seq.kv_reserved + self.min_grow))

    def _ahead(self, seq: Sequence, total: int) -> int:
        return min(total, seq.num_output + self.horizon) if self.horizon else total

    def can_admit(self, allocator, size: int) -> bool:
        return True

    def victim(self, running: list[Sequence], seq: Sequence, need: int, allocator,
               candidates: list[Sequence] | None = None) -> Sequence:
        """Its right neighbour if admitted after it (adjacent slots), else the newest request
        whose slots with the free space around them would hold seq, else seq itself:
        preempting others whose slots are not adjacent frees space seq cannot use. With
        `candidates`: the least urgent of them whose slots would hold seq, directly (its
        right neighbour, or with the free space around them) or once compacted (enough free
        slots in all), else seq itself."""
        if candidates is not None:
            short = need - seq.kv_reserved
            nb = segment_at(running, seq.kv_start + seq.kv_reserved)
            for s in candidates:
                if s is nb or allocator.free_around(s.kv_start) + s.kv_reserved >= need or \
                        allocator.free_slots + s.kv_reserved >= short:
                    return s
            return seq
        nb = segment_at(running, seq.kv_start + seq.kv_reserved)
        if nb is not None and nb.admit_order > seq.admit_order:
            return nb
        for s in reversed(running):
            if s.admit_order <= seq.admit_order:
                break
            if allocator.free_around(s.kv_start) + s.kv_reserved >= need:
                return s
        return seq


@dataclass(frozen=True)
class MaxLength:
    name: ClassVar[KVPolicyName] = KVPolicyName.MAX
    compacts: ClassVar[bool] = False
    peak_admission: ClassVar[bool] = False

    def allocator(self, capacity: int) -> KVAllocator:
        return KVAllocator(capacity)

    def reservation(self, seq: Sequence) -> int:
        return seq.max_len

    def grow_target(self, seq: Sequence) -> int:
        return seq.max_len  # never reached: the reservation holds every token

    def can_admit(self, allocator, size: int) -> bool:
        return True

    def victim(self, running: list[Sequence], seq: Sequence, need: int, allocator,
               candidates: list[Sequence] | None = None) -> Sequence:
        if candidates is not None:
            return candidates[0] if candidates else seq
        return running[-1]


@dataclass(frozen=True)
class Paged:
    name: ClassVar[KVPolicyName] = KVPolicyName.PAGED
    compacts: ClassVar[bool] = False
    peak_admission: ClassVar[bool] = False

    def allocator(self, capacity: int) -> PagedAllocator:
        return PagedAllocator(capacity)

    def reservation(self, seq: Sequence) -> int:
        return seq.num_tokens

    def grow_target(self, seq: Sequence) -> int:
        return seq.num_tokens  # one more token: a new block when it crosses into one

    def can_admit(self, allocator: PagedAllocator, size: int) -> bool:
        free_after = allocator.free_slots - allocator.blocks(size) * allocator.block_size
        return free_after >= PAGED_WATERMARK * allocator.capacity

    def victim(self, running: list[Sequence], seq: Sequence, need: int, allocator,
               candidates: list[Sequence] | None = None) -> Sequence:
        if candidates is not None:  # any block will do: the least urgent, else seq
            return candidates[0] if candidates else seq
        return running[-1]  # the most recently admitted: any block will do


def make_policy(config: SchedulerConfig) -> KVPolicy:
    """The policy config.kv_policy names, with its settings from `config` (only `Predicted`
    has any)."""
    match config.kv_policy:
        case KVPolicyName.PREDICTED:
            return Predicted(config.kv_reserve_quantile, config.kv_grow_quantile,
                             config.kv_reserve_horizon, config.kv_min_grow)
        case KVPolicyName.MAX:
            return MaxLength()
        case KVPolicyName.PAGED:
            return Paged()
