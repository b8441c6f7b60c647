"""Finding KV room for the scheduler's segments (a mixin of Scheduler, which holds the state
it reads: allocator, policy, prefix cache, compactor, running and waiting requests, stats).

A new segment takes free space, else evicts prefix-cache entries (least recently used
first), else compacts; a segment that outgrows itself is resized in place or moved, evicts
the cache entry after it, has its neighbours moved aside, and only then preempts the victim
the KV policy names. A preempted request frees its segment and waits first in line to
recompute its tokens (a beam search starts over). Pure logic.
"""

from __future__ import annotations

from services.compute.beam.group import restart
from services.compute.core.sequence import SeqStatus, Sequence
from services.compute.core.step import ScheduledStep


class KVRoom:
    def _release(self, seq: Sequence, keep: bool = False) -> None:
        """Take seq out of the running batch and free its KV segment, or with `keep` and a
        prefix cache keep it cached (a finished request's)."""
        self.running.remove(seq)
        if self.prefix_cache is not None:
            self.prefix_cache.unshare(seq)
            if keep:
                self.prefix_cache.keep(seq)  # shrinks the segment in place
                return
        self.allocator.free(seq.kv_start)

    def _allocate(self, size: int, moves: list, spare: Sequence | None) -> int | None:
        """A new segment of `size`: in free space, after evicting cached entries (least
        recently used first, never `spare`) until enough slots are free; when they are split,
        by evicting older entries that join free blocks, then by compaction; evicting more as
        long as that fails."""
        a, cache = self.allocator, self.prefix_cache
        while True:
            if a.free_slots >= size:
                start = a.allocate(size)
                while start is None and cache is not None and cache.evict_beside_free(spare):
                    start = a.allocate(size)
                if start is None and self.compactor is not None and \
                        self.compactor.make_hole(self._segments(), size, moves):
                    start = a.allocate(size)
                if start is not None:
                    return start
            if cache is None or not cache.evict_lru(spare):
                return None

    def _segments(self) -> list[Sequence]:
        """Whose segments the allocator holds: the running requests and the cached entries."""
        if self.prefix_cache is None:
            return self.running
        return self.running + self.prefix_cache.entries()

    def _make_room(self, seq: Sequence, step: ScheduledStep) -> bool:
        """Ensure seq's segment holds its pending token. False if seq itself had to be preempted."""
        need = seq.num_tokens
        if need <= seq.kv_reserved:
            return True
        target = self.policy.grow_target(seq)
        while True:
            for size in (target, need):
                start = self.allocator.resize(seq.kv_start, size)
                if start is not None:
                    self._relocated(seq, start, size, step)
                    return True
            if self._evict_for(seq):
                continue
            if self.compactor is not None and \
                    self.allocator.free_slots >= need - seq.kv_reserved and \
                    self.compactor.make_room_after(self._segments(), seq, need, step.moves):
                continue  # seq now grows in place
            victim = self.policy.victim(self.running, seq, need, self.allocator)
            self._preempt(victim)
            if victim is seq:
                return False

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

    def _relocated(self, seq: Sequence, start: int, size: int, step: ScheduledStep) -> None:
        if start == seq.kv_start:
            self.stats.grows_in_place += 1
        else:
            step.moves.append((seq.kv_start, start, seq.kv_extent))
            self.stats.moves += 1
        seq.kv_start, seq.kv_reserved = start, size

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's KV and requeue it first in line; it recomputes prompt + output later."""
        self._release(seq)
        if seq.beams is not None:
            restart(seq)
        seq.num_cached, seq.kv_start, seq.kv_reserved = 0, -1, 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
