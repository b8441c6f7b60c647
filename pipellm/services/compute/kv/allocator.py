"""Contiguous best-fit slot allocator for a KV cache (pure logic, O(#free blocks) per operation).

One slot holds one token's K/V; each request owns one segment [start, start + size), placed at
the start of the smallest free block that holds it (lowest address on ties). Invariants
(`KVAllocator.check`): segments and free blocks, each of size >= 1, tile [0, capacity) without
overlap; no two free blocks are adjacent; `_free_starts` is the sorted keys of `_free`;
`_reserved` is the sum of segment sizes.
"""

from __future__ import annotations

import operator
from bisect import bisect_left, insort


def _positive(size: int, what: str) -> int:
    size = operator.index(size)
    if size < 1:
        raise ValueError(f"{what} must be >= 1, got {size}")
    return size


class KVAllocator:
    """Best-fit allocator of contiguous slot segments in ``[0, capacity)``."""

    def __init__(self, capacity: int):
        capacity = operator.index(capacity)
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity: int = capacity
        self._segs: dict[int, int] = {}  # allocated: start -> size
        self._free: dict[int, int] = {}  # free block: start -> size
        self._free_starts: list[int] = []  # sorted keys of _free
        self._reserved = 0  # sum of self._segs.values()
        if capacity:
            self._add_free(0, capacity)

    # ------------------------------------------------------------------ queries
    @property
    def reserved(self) -> int:
        """Total number of slots in allocated segments."""
        return self._reserved

    @property
    def free_slots(self) -> int:
        """Number of free slots (``capacity - reserved``)."""
        return self.capacity - self._reserved

    def largest_free(self) -> int:
        """Size of the largest free block, or 0 if there is none."""
        return max(self._free.values(), default=0)

    def free_after(self, start: int) -> int:
        """Size of the free block right after the segment at ``start`` (0 if none)."""
        return self._free.get(start + self._segs[start], 0)

    def free_around(self, start: int) -> int:
        """Free slots adjacent to the segment at ``start``: the free blocks just before and
        just after it."""
        idx = bisect_left(self._free_starts, start) - 1
        left = self._free_starts[idx] if idx >= 0 else -1
        before = self._free[left] if left >= 0 and left + self._free[left] == start else 0
        return before + self.free_after(start)

    def segment_size(self, start: int) -> int:
        """Size of the segment starting at ``start``; KeyError if there is none."""
        return self._segs[start]

    def segments(self) -> list[tuple[int, int]]:
        """Allocated ``(start, size)`` pairs, sorted by start."""
        return sorted(self._segs.items())

    def free_blocks(self) -> list[tuple[int, int]]:
        """Free ``(start, size)`` blocks, sorted by start."""
        return [(s, self._free[s]) for s in self._free_starts]

    # ---------------------------------------------------------------- mutation
    def allocate(self, size: int) -> int | None:
        """Best-fit: place a new segment of ``size`` (>= 1) slots in the smallest free block that
        holds it (ties: lowest address), at the block's start. Return its start, or None if no
        free block fits (the allocator is then unchanged)."""
        size = _positive(size, "size")
        best = self._best_fit(size)
        if best is None:
            return None
        block = self._pop_free(best)
        if block > size:
            # The remainder's right neighbour is allocated (or the end), so no merge is needed.
            self._add_free(best + size, block - size)
        self._segs[best] = size
        self._reserved += size
        return best

    def free(self, start: int) -> None:
        """Free the segment starting at ``start`` (KeyError if none), coalescing with free
        neighbours."""
        if start not in self._segs:
            raise KeyError(f"no segment starts at {start}")
        size = self._segs.pop(start)
        self._reserved -= size
        self._release(start, size)

    def resize(self, start: int, new_size: int) -> int | None:
        """Give the segment at ``start`` ``new_size`` slots (>= 1; may be smaller or larger).

        Shrinking, or growing into a free right neighbour that is big enough, happens in place and
        returns ``start``. Otherwise the segment moves: conceptually it is freed (coalescing with
        free neighbours) and ``new_size`` is best-fit allocated; the new range MAY overlap the old
        one, so the caller must copy the first ``used`` slots with an overlap-safe copy. Return the
        new start, or None when nothing fits, in which case the allocator is left exactly as it
        was. KeyError if no segment starts at ``start``; ValueError if ``new_size < 1``.
        """
        if start not in self._segs:
            raise KeyError(f"no segment starts at {start}")
        new_size = _positive(new_size, "new_size")
        size = self._segs[start]
        if new_size <= size:  # shrink (or no-op) in place
            if new_size < size:
                self._segs[start] = new_size
                self._reserved -= size - new_size
                self._release(start + new_size, size - new_size)
            return start
        extra = new_size - size
        right = start + size
        right_size = self._free.get(right, 0)
        if right_size >= extra:  # grow in place into the free right neighbour
            self._pop_free(right)
            if right_size > extra:
                self._add_free(right + extra, right_size - extra)
            self._segs[start] = new_size
            self._reserved += extra
            return start
        return self._move(start, size, new_size)

    def gather(self, pos: int, amount: int, max_moved: int,
               left: bool = False) -> list[tuple[int, int]] | None:
        """Make ``amount`` free slots contiguous next to ``pos`` (a block boundary: a segment's
        end or a free block's start) by packing the segments of the shortest window that holds
        that much free space away from ``pos``: the window ``[pos, end)`` packed against its
        right end, or with ``left`` the window ``[start, pos)`` packed against its left end (the
        free space then ends at ``pos``). Returns ``(old_start, new_start)`` of the segments
        that moved, in copy order: each moves away from ``pos``, farthest first, so copying in
        this order with an overlap-safe copy never overwrites data not yet copied. None
        (nothing changed) if the free space on that side is short, or the window's segments
        hold more than ``max_moved`` slots."""
        window = self._window(pos, amount, left)
        if window is None or sum(n for _, n, f in window if not f) > max_moved:
            return None
        # pack from the far end of the window back towards pos
        moves, cursor = [], window[-1][0] if left else window[-1][0] + window[-1][1]
        for start, n, is_free in reversed(window):
            if is_free:
                self._pop_free(start)
                continue
            if not left:
                cursor -= n
            del self._segs[start]
            self._segs[cursor] = n
            if cursor != start:
                moves.append((start, cursor))
            if left:
                cursor += n
        self._release(*((cursor, pos - cursor) if left else (pos, cursor - pos)))
        return moves

    def _window(self, pos: int, amount: int, left: bool) -> list[tuple[int, int, bool]] | None:
        """The blocks ``(start, size, is_free)`` from ``pos`` outwards (to the right, or with
        ``left`` to the left), nearest first, until they hold ``amount`` free slots; None if
        that side of ``pos`` has fewer."""
        if left:
            ends = {s + n: (s, n, False) for s, n in self._segs.items()}
            ends |= {s + n: (s, n, True) for s, n in self._free.items()}
        window, free, p = [], 0, pos
        while free < amount and (p > 0 if left else p < self.capacity):
            if left:
                block = ends[p]
            else:
                block = (p, self._free[p], True) if p in self._free else (p, self._segs[p], False)
            window.append(block)
            free += block[1] if block[2] else 0
            p = block[0] if left else p + block[1]
        return window if free >= amount else None

    def _move(self, start: int, size: int, new_size: int) -> int | None:
        """Free the segment and best-fit ``new_size``; on failure restore the exact old state."""
        self.free(start)
        new_start = self.allocate(new_size)
        if new_start is not None:
            return new_start
        # allocate() changed nothing, so the free list holds the merged block covering the old
        # segment; split it back into (left part, segment, right part). Since the old state was
        # fully coalesced, those parts are exactly the old free neighbours.
        idx = bisect_left(self._free_starts, start + 1) - 1
        merged = self._free_starts[idx]
        merged_end = merged + self._pop_free(merged)
        if merged < start:
            self._add_free(merged, start - merged)
        if start + size < merged_end:
            self._add_free(start + size, merged_end - start - size)
        self._segs[start] = size
        self._reserved += size
        return None

    # ----------------------------------------------------------------- helpers
    def _best_fit(self, size: int) -> int | None:
        """Start of the smallest free block with >= ``size`` slots (lowest address on ties)."""
        best: int | None = None
        best_size = 0
        for s in self._free_starts:  # ascending, so strict < keeps the lowest address on ties
            bsize = self._free[s]
            if bsize >= size and (best is None or bsize < best_size):
                best, best_size = s, bsize
                if bsize == size:
                    break  # exact fit cannot be beaten
        return best

    def _add_free(self, start: int, size: int) -> None:
        """Insert a free block; the caller guarantees it has no free neighbour."""
        self._free[start] = size
        insort(self._free_starts, start)

    def _pop_free(self, start: int) -> int:
        """Remove the free block at ``start`` and return its size."""
        del self._free_starts[bisect_left(self._free_starts, start)]
        return self._free.pop(start)

    def _release(self, start: int, size: int) -> None:
        """Mark ``[start, start + size)`` free, coalescing with free neighbours."""
        idx = bisect_left(self._free_starts, start)
        if idx < len(self._free_starts) and self._free_starts[idx] == start + size:
            size += self._pop_free(start + size)  # merge right neighbour
        if idx > 0:
            left = self._free_starts[idx - 1]
            if left + self._free[left] == start:  # merge into left neighbour
                self._free[left] += size
                return
        self._add_free(start, size)

    # -------------------------------------------------------------- invariants
    def check(self) -> None:
        """Raise AssertionError unless all invariants hold: segments and free blocks sorted,
        within ``[0, capacity)``, non-overlapping, together tiling ``[0, capacity)`` exactly
        (reserved + free == capacity), no two adjacent free blocks, all sizes >= 1."""

        def require(cond: bool, msg: str) -> None:
            if not cond:  # not `assert`: must also work under python -O
                raise AssertionError(msg)

        require(self._free_starts == sorted(self._free), "free start list out of sync")
        require(self._reserved == sum(self._segs.values()), "reserved counter out of sync")
        blocks = [(s, n, True) for s, n in self._free.items()]
        blocks += [(s, n, False) for s, n in self._segs.items()]
        blocks.sort()
        pos, prev_free = 0, False
        for s, n, is_free in blocks:
            require(n >= 1, f"block at {s} has size {n}")
            require(s == pos, f"gap or overlap at {pos} (next block starts at {s})")
            require(not (is_free and prev_free), f"adjacent free blocks at {s}")
            pos, prev_free = s + n, is_free
        require(pos == self.capacity, f"blocks end at {pos}, capacity is {self.capacity}")
        require(self._reserved + sum(self._free.values()) == self.capacity, "slot count mismatch")
