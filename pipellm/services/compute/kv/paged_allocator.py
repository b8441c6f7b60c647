"""Paged KV allocation (vLLM's PagedAllocator): fixed-size blocks handed out on demand.

The baseline the predicted-length contiguous allocator is measured against. It has the
`KVAllocator` interface the scheduler uses (`allocate`, `resize`, `free`, `capacity`,
`reserved`, `free_slots`) but a request's slots are `ceil(size / block_size)` blocks anywhere
in the pool, so a segment never moves and never fragments; a handle is an id, not a slot
address. Only the simulated backend runs it (the model runner's kernels read contiguous
segments). Pure logic.

Invariant: free blocks + sum of blocks held == total blocks; `reserved` counts whole blocks.
"""

from __future__ import annotations

import itertools
import operator


class PagedAllocator:
    def __init__(self, capacity: int, block_size: int = 16):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.total_blocks = operator.index(capacity) // block_size
        self.capacity = self.total_blocks * block_size  # whole blocks only
        self._held: dict[int, int] = {}  # handle -> blocks held
        self._free_blocks = self.total_blocks
        self._ids = itertools.count()

    @property
    def reserved(self) -> int:
        return (self.total_blocks - self._free_blocks) * self.block_size

    @property
    def free_slots(self) -> int:
        return self._free_blocks * self.block_size

    def largest_free(self) -> int:
        return self.free_slots  # blocks need not be adjacent

    def blocks(self, size: int) -> int:
        return -(-size // self.block_size)

    def allocate(self, size: int) -> int | None:
        """Blocks for `size` (>= 1) slots; a new handle, or None when too few blocks are free."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        n = self.blocks(size)
        if n > self._free_blocks:
            return None
        handle = next(self._ids)
        self._held[handle] = n
        self._free_blocks -= n
        return handle

    def resize(self, handle: int, new_size: int) -> int | None:
        """Take or give back blocks so that `new_size` slots fit; returns `handle` (never
        moves), or None (unchanged) when too few blocks are free."""
        if new_size < 1:
            raise ValueError(f"new_size must be >= 1, got {new_size}")
        extra = self.blocks(new_size) - self._held[handle]
        if extra > self._free_blocks:
            return None
        self._held[handle] += extra
        self._free_blocks -= extra
        return handle

    def free(self, handle: int) -> None:
        self._free_blocks += self._held.pop(handle)

    def check(self) -> None:
        if self._free_blocks + sum(self._held.values()) != self.total_blocks:
            raise AssertionError("block count mismatch")
        if self._free_blocks < 0 or any(n < 1 for n in self._held.values()):
            raise AssertionError("negative free blocks or an empty holding")
