"""Closing split free space of the contiguous KV allocator by moving segments. Pure logic.

When free slots are enough but not contiguous where they are needed (for a new request's
segment, or for a running segment to grow), segments move: a KV copy of a segment costs a small
fraction of recomputing its tokens (docs/benchmarks.md), and preempting requests whose slots are
not adjacent would free space nobody can use. Every move is appended to the caller's `moves` as
`(src, dst, kv_extent)` in copy order (an overlap-safe copy in that order is correct) and the
moved sequences' `kv_start` is updated; segments holding no KV yet move without a copy.
"""

from __future__ import annotations

from pipellm.services.compute.core.sequence import Sequence
from pipellm.services.compute.kv.allocator import KVAllocator

# Most of the cache one gather may shift: to admit a request (larger gathers pack segments
# tight, and their regrowth then costs more moves than the gather saved), and to let a running
# request grow (rather than preempt it).
ADMIT_GATHER_SHARE = 0.05
GROW_GATHER_SHARE = 0.15
# Copy budget (a token bucket, in cached slots as a share of the cache): each step adds
# COPY_RATE, at most COPY_BURST is saved. Occasional large gathers pass; sustained compaction
# (a full cache where every packed segment soon needs another gather) is cut to COPY_RATE a
# step, and preemption takes over.
COPY_RATE = 0.05
COPY_BURST = 0.5


class Compactor:
    """Moves segments of `running` (the sequences whose segments `allocator` holds), counting
    each in `stats.moves`, within the copy budget (`refill` once per step)."""

    def __init__(self, allocator: KVAllocator, stats):
        self.allocator, self.stats = allocator, stats
        self.budget = 0  # cached slots it may copy now

    def refill(self) -> None:
        cap = self.allocator.capacity
        self.budget = min(self.budget + int(COPY_RATE * cap), int(COPY_BURST * cap))

    def make_hole(self, running: list[Sequence], size: int,
                  moves: list[tuple[int, int, int]]) -> bool:
        """A free block of `size`: slide out the segment after one of the largest blocks, else
        gather the holes on either side of the largest."""
        blocks = sorted(self.allocator.free_blocks(), key=lambda b: -b[1])[:4]
        if not blocks:
            return False
        b, n = blocks[0]
        return any(self._slide_out(running, s + m, m, size, moves) for s, m in blocks) or \
            self._gather(running, b, size, ADMIT_GATHER_SHARE, moves) or \
            self._gather(running, b + n, size, ADMIT_GATHER_SHARE, moves, left=True)

    def make_room_after(self, running: list[Sequence], seq: Sequence, need: int,
                        moves: list[tuple[int, int, int]]) -> bool:
        """Free slots right after seq's segment so that it can grow in place to `need`: slide
        its right neighbour out, or pack the segments after it right (or before it, seq
        included, left) into the holes beyond."""
        end, extra = seq.kv_start + seq.kv_reserved, need - seq.kv_reserved
        return self._slide_out(running, end, seq.kv_reserved, need, moves) or \
            self._gather(running, end, extra, GROW_GATHER_SHARE, moves) or \
            self._gather(running, end, extra, GROW_GATHER_SHARE, moves, left=True)

    def _slide_out(self, running: list[Sequence], end: int, before: int, need: int,
                   moves: list) -> bool:
        """Move the segment that starts at `end` to a hole elsewhere if that leaves `need`
        contiguous slots from `end - before` (the `before` slots there are the caller's: its
        own segment, or a free block)."""
        a = self.allocator
        nb = segment_at(running, end)
        if nb is None or nb.kv_extent > self.budget:
            return False
        after = a.free_after(nb.kv_start)
        start = a.allocate(nb.kv_reserved)  # nb still holds its range: no overlap
        if start is None:
            return False
        # the room: `before`, nb's range, and the free block after nb unless nb just took it
        # (none if nb landed in the caller's own hole before it)
        room = before + nb.kv_reserved + (0 if start == end + nb.kv_reserved else after)
        if end - before <= start < end or room < need:
            a.free(start)  # undo: the allocator is exactly as before
            return False
        a.free(nb.kv_start)
        self._moved(nb, start, moves)
        return True

    def _gather(self, running: list[Sequence], pos: int, amount: int, share: float,
                moves: list, left: bool = False) -> bool:
        """Pack the segments after `pos` right (with `left`, those before it left) into the
        holes beyond them until `amount` free slots are contiguous next to `pos`. The shifted
        segments may hold at most `share` of the cache, and at most the copy budget (their
        slots bound the cached slots the copies spend)."""
        a = self.allocator
        shifted = a.gather(pos, amount, min(int(share * a.capacity), self.budget), left)
        if shifted is None:
            return False
        by_start = {s.kv_start: s for s in running}
        for old, new in shifted:
            self._moved(by_start[old], new, moves)
        return True

    def _moved(self, seq: Sequence, start: int, moves: list) -> None:
        if seq.kv_extent:
            moves.append((seq.kv_start, start, seq.kv_extent))
            self.budget -= seq.kv_extent
        seq.kv_start = start
        self.stats.moves += 1


def segment_at(running: list[Sequence], start: int) -> Sequence | None:
    """The running sequence whose segment starts at `start`, if any."""
    return next((s for s in running if s.kv_start == start), None)
