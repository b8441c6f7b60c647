"""The KV cache's slots and their one owner: the allocator, the placement policy (kv_policy.py),
the prefix cache and the compactor, built together once from the scheduler's config and the
capacity. The scheduler asks it for a new segment, to grow one, to release one; the engine
reads its stats. Pure logic.

A new segment takes free space, else evicts prefix-cache entries (least recently used first),
else compacts. A segment that outgrows itself is resized in place or moved, evicts the cache
entry after it, has its neighbours moved aside, and only then names the request the policy
would preempt (the scheduler preempts it and asks again).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipellm.services.compute.core.sequence import Sequence
from pipellm.services.compute.kv.compaction import Compactor
from pipellm.services.compute.kv.prefix_cache import PrefixCache
from pipellm.services.compute.scheduling.kv_policy import make_policy
from pipellm.shared.config import SchedulerConfig

Moves = list[tuple[int, int, int]]  # (src, dst, n) KV copies for the step to apply first


@dataclass
class KVStats:
    moves: int = 0
    grows_in_place: int = 0


class KVSpace:
    def __init__(self, config: SchedulerConfig, capacity: int):
        self.policy = make_policy(config)
        self.allocator = self.policy.allocator(capacity)
        self.stats = KVStats()
        self.compactor = Compactor(self.allocator, self.stats) if self.policy.compacts else None
        self.prefix_cache = PrefixCache(self.allocator) if config.enable_prefix_caching else None

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def reserved(self) -> int:
        """Slots held by requests (the prefix cache's entries not counted)."""
        return self.allocator.reserved - (self.prefix_cache.slots if self.prefix_cache else 0)

    def allocate(self, size: int, running: list[Sequence], moves: Moves,
                 spare: Sequence | None = None) -> int | None:
        """The start of a new segment of `size`: in free space, after evicting cached entries
        (least recently used first, never `spare`) until enough slots are free; when they are
        split, by evicting older entries that join free blocks, then by compaction; evicting
        more as long as that fails. None when nothing makes room."""
        a, cache = self.allocator, self.prefix_cache
        while True:
            if a.free_slots >= size:
                start = a.allocate(size)
                while start is None and cache is not None and cache.evict_beside_free(spare):
                    start = a.allocate(size)
                if start is None and self.compactor is not None and \
                        self.compactor.make_hole(self.segments(running), size, moves):
                    start = a.allocate(size)
                if start is not None:
                    return start
            if cache is None or not cache.evict_lru(spare):
                return None

    def grow(self, seq: Sequence, running: list[Sequence], moves: Moves,
             candidates: list[Sequence] | None = None) -> Sequence | None:
        """Make seq's segment hold its pending token: None when it does, else the request to
        preempt before asking again (seq itself, possibly; `candidates`: KVPolicy.victim's)."""
        need = seq.num_tokens
        if need <= seq.kv_reserved:
            return None
        target = self.policy.grow_target(seq)
        while True:
            for size in (target, need):
                start = self.allocator.resize(seq.kv_start, size)
                if start is not None:
                    self._relocated(seq, start, size, moves)
                    return None
            if self._evict_for(seq):
                continue
            if self.compactor is not None and \
                    self.allocator.free_slots >= need - seq.kv_reserved and \
                    self.compactor.make_room_after(self.segments(running), seq, need, moves):
                continue  # seq now grows in place
            return self.policy.victim(running, seq, need, self.allocator, candidates)

    def release(self, seq: Sequence, keep: bool = False) -> None:
        """Free seq's segment, or with `keep` and a prefix cache keep it cached (a finished
        request's)."""
        if self.prefix_cache is not None:
            self.prefix_cache.unshare(seq)
            if keep:
                self.prefix_cache.keep(seq)  # shrinks the segment in place
                return
        self.allocator.free(seq.kv_start)

    def segments(self, running: list[Sequence]) -> list[Sequence]:
        """Whose segments the allocator holds: the running requests and the cached entries."""
        if self.prefix_cache is None:
            return running
        return running + self.prefix_cache.entries()

    def _evict_for(self, seq: Sequence) -> bool:
        """Evict a cached entry so that seq may grow: the one right after its segment, else
        the least recently used. False if none is cached."""
        cache = self.prefix_cache
        if cache is None:
            return False
        after = cache.entry_at(seq.kv_start + seq.kv_reserved)
        if after is not None:
            cache.evict(after)
            return True
        return cache.evict_lru()

    def _relocated(self, seq: Sequence, start: int, size: int, moves: Moves) -> None:
        if start == seq.kv_start:
            self.stats.grows_in_place += 1
        else:
            moves.append((seq.kv_start, start, seq.kv_extent))
            self.stats.moves += 1
        seq.kv_start, seq.kv_reserved = start, size
