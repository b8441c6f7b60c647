"""Tests for pipellm.services.compute.kv.allocator.KVAllocator (unit tests + hypothesis state
machine)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from pipellm.services.compute.kv.allocator import KVAllocator


def layout(a: KVAllocator, *sizes: int) -> list[int]:
    """Allocate consecutive segments of the given sizes from an empty allocator."""
    starts = [a.allocate(n) for n in sizes]
    assert starts == [sum(sizes[:i]) for i in range(len(sizes))]
    a.check()
    return starts


def snapshot(a: KVAllocator) -> tuple:
    return a.segments(), a.free_blocks(), a.reserved, a.free_slots, a.largest_free()


# ---------------------------------------------------------------------------- unit tests
def test_empty_allocator():
    a = KVAllocator(10)
    a.check()
    assert (a.capacity, a.reserved, a.free_slots, a.largest_free()) == (10, 0, 10, 10)
    assert a.segments() == [] and a.free_blocks() == [(0, 10)]
    z = KVAllocator(0)
    z.check()
    assert z.free_blocks() == [] and z.largest_free() == 0 and z.allocate(1) is None


def test_allocate_fills_and_reports_none_when_full():
    a = KVAllocator(8)
    assert a.allocate(5) == 0
    assert a.allocate(4) is None
    assert a.allocate(3) == 5
    assert a.allocate(1) is None
    assert (a.reserved, a.free_slots, a.largest_free()) == (8, 0, 0)
    assert a.segment_size(0) == 5 and a.segment_size(5) == 3
    a.check()


def test_best_fit_prefers_smallest_block_then_lowest_address():
    a = KVAllocator(20)
    s = layout(a, 4, 1, 3, 1, 3, 1, 7)  # blocks at 0, 4, 5, 8, 9, 12, 13
    for start in (s[0], s[2], s[4]):  # free blocks of size 4, 3, 3
        a.free(start)
    assert a.free_blocks() == [(0, 4), (5, 3), (9, 3)]
    assert a.allocate(2) == 5  # size-3 blocks beat the size-4 one; lowest address wins
    assert a.free_blocks() == [(0, 4), (7, 1), (9, 3)]
    assert a.allocate(1) == 7  # exact fit
    assert a.allocate(4) == 0  # only the 4-block fits, even though it comes first
    assert a.allocate(3) == 9
    assert a.allocate(1) is None
    a.check()


def test_best_fit_exact_fit_beyond_larger_earlier_block():
    a = KVAllocator(12)
    s = layout(a, 6, 1, 2, 3)
    a.free(s[0])
    a.free(s[2])
    assert a.free_blocks() == [(0, 6), (7, 2)]
    assert a.allocate(2) == 7


def test_free_coalesces_with_both_neighbours():
    a = KVAllocator(10)
    s = layout(a, 2, 3, 4, 1)
    a.free(s[0])
    a.free(s[2])
    assert a.free_blocks() == [(0, 2), (5, 4)]
    a.free(s[1])
    assert a.free_blocks() == [(0, 9)]
    assert a.segments() == [(9, 1)]
    assert a.largest_free() == 9 and a.reserved == 1
    a.check()
    a.free(9)
    assert a.free_blocks() == [(0, 10)] and a.segments() == []


def test_free_coalesces_with_trailing_free_space():
    a = KVAllocator(10)
    layout(a, 3, 3)
    a.free(3)
    assert a.free_blocks() == [(3, 7)]
    a.check()


def test_free_errors_on_bad_start():
    a = KVAllocator(10)
    s = layout(a, 4)
    with pytest.raises(KeyError):
        a.free(1)  # inside a segment, not its start
    with pytest.raises(KeyError):
        a.free(4)  # start of a free block
    a.free(s[0])
    with pytest.raises(KeyError):
        a.free(s[0])  # double free
    a.check()


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_sizes_raise(bad):
    a = KVAllocator(10)
    a.allocate(3)
    before = snapshot(a)
    with pytest.raises(ValueError):
        a.allocate(bad)
    with pytest.raises(ValueError):
        a.resize(0, bad)
    assert snapshot(a) == before
    with pytest.raises(KeyError):
        a.resize(1, 2)
    with pytest.raises(ValueError):
        KVAllocator(-1)


def test_grow_in_place_into_free_right_neighbour():
    a = KVAllocator(10)
    s = layout(a, 2, 5, 1)
    a.free(s[1])
    assert a.resize(0, 4) == 0
    assert a.segments() == [(0, 4), (7, 1)]
    assert a.free_blocks() == [(4, 3), (8, 2)]
    assert a.resize(0, 7) == 0  # consumes the whole right neighbour
    assert a.free_blocks() == [(8, 2)]
    assert a.reserved == 8
    a.check()


def test_grow_in_place_even_if_a_better_fit_exists_elsewhere():
    a = KVAllocator(10)
    s = layout(a, 3, 1, 3, 3)
    a.free(s[0])  # exact 3-block at 0 would be a better fit for a moved segment
    a.free(s[3])  # free tail block of 3 to the right of s[2]
    assert a.resize(s[2], 5) == s[2]
    assert a.free_blocks() == [(0, 3), (9, 1)]


def test_move_when_right_neighbour_taken():
    a = KVAllocator(12)
    s = layout(a, 2, 2, 2)  # free tail at [6, 12)
    assert a.resize(s[0], 4) == 6
    assert a.segments() == [(2, 2), (4, 2), (6, 4)]
    assert a.free_blocks() == [(0, 2), (10, 2)]
    a.check()


def test_move_when_right_neighbour_too_small():
    a = KVAllocator(12)
    s = layout(a, 2, 1, 2, 5)
    a.free(s[1])  # 1 free slot right of s[0]
    a.free(s[3])  # free tail [5, 12)
    assert a.resize(0, 4) == 5
    assert a.free_blocks() == [(0, 3), (9, 3)]
    a.check()


def test_move_overlaps_old_range_when_left_neighbour_free():
    a = KVAllocator(10)
    s = layout(a, 3, 2, 1, 4)
    a.free(s[0])
    assert a.free_blocks() == [(0, 3)]
    # Right neighbour is allocated; the coalesced block [0, 5) is the only (and best) fit.
    new = a.resize(s[1], 4)
    assert new == 0
    assert new < s[1] < new + 4  # overlaps the old range [3, 5)
    assert a.segments() == [(0, 4), (5, 1), (6, 4)]
    assert a.free_blocks() == [(4, 1)]
    a.check()


def test_move_uses_left_and_right_neighbours_together():
    a = KVAllocator(10)
    s = layout(a, 2, 2, 2, 4)
    a.free(s[0])
    a.free(s[2])
    assert a.resize(s[1], 6) == 0
    assert a.segments() == [(0, 6), (6, 4)]
    assert a.free_blocks() == []
    a.check()


def test_resize_none_leaves_state_untouched():
    a = KVAllocator(12)
    s = layout(a, 1, 2, 3, 1, 2, 3)
    a.free(s[0])
    a.free(s[2])
    a.free(s[5])  # free: [0,1) [3,6) [9,12); s[1] has free neighbours on both sides
    before = snapshot(a)
    assert a.resize(s[1], 7) is None  # 1 + 2 + 3 = 6 < 7 and no other block fits
    assert snapshot(a) == before
    a.check()
    assert a.resize(s[3], 9) is None
    assert snapshot(a) == before
    assert a.resize(s[1], 6) == 0  # but exactly the coalesced size fits
    a.check()


def test_shrink_in_place_and_coalesce():
    a = KVAllocator(10)
    s = layout(a, 5, 2)
    assert a.resize(s[0], 2) == 0
    assert a.free_blocks() == [(2, 3), (7, 3)]
    assert a.resize(s[1], 1) == s[1]
    assert a.free_blocks() == [(2, 3), (6, 4)]
    a.free(s[1])
    assert a.free_blocks() == [(2, 8)]
    assert a.resize(0, 2) == 0  # same size: no-op
    assert a.segments() == [(0, 2)]
    a.check()


def test_check_detects_corruption():
    a = KVAllocator(10)
    layout(a, 3, 3)
    a.free(0)
    a._segs[3] = 4  # overlaps the free tail
    with pytest.raises(AssertionError):
        a.check()
    b = KVAllocator(10)
    layout(b, 3)
    b._free[3] = 2  # leaves a gap at [5, 10), free-list bookkeeping still consistent
    with pytest.raises(AssertionError):
        b.check()


# ------------------------------------------------------------------- reference model
class Model:
    """Owner-per-slot reference: slots[i] is the owning segment id or None."""

    def __init__(self, capacity: int):
        self.slots: list[int | None] = [None] * capacity
        self.where: dict[int, tuple[int, int]] = {}  # segment id -> (start, size)

    def runs(self, ignore: int | None = None) -> list[tuple[int, int]]:
        """Maximal free runs (start, size), treating segment `ignore` as free."""
        out: list[tuple[int, int]] = []
        for i, owner in enumerate(self.slots):
            if owner is None or owner == ignore:
                if out and out[-1][0] + out[-1][1] == i:
                    out[-1] = (out[-1][0], out[-1][1] + 1)
                else:
                    out.append((i, 1))
        return out

    def best_fit(self, size: int, ignore: int | None = None) -> int | None:
        fits = [(n, s) for s, n in self.runs(ignore) if n >= size]
        return min(fits)[1] if fits else None

    def place(self, sid: int, start: int, size: int) -> None:
        for i in range(start, start + size):
            assert self.slots[i] is None or self.slots[i] == sid, "overlaps a live segment"
            self.slots[i] = sid
        self.where[sid] = (start, size)

    def remove(self, sid: int) -> None:
        start, size = self.where.pop(sid)
        for i in range(start, start + size):
            assert self.slots[i] == sid
            self.slots[i] = None

    def expected_resize(self, sid: int, new_size: int) -> int | None:
        start, size = self.where[sid]
        if new_size <= size:
            return start
        end = start + size
        right = next((n for s, n in self.runs() if s == end), 0)
        if right >= new_size - size:
            return start
        return self.best_fit(new_size, ignore=sid)


class AllocatorMachine(RuleBasedStateMachine):
    segs = Bundle("segs")

    def __init__(self):
        super().__init__()
        self.next_id = 0

    @initialize(capacity=st.integers(0, 48))
    def init(self, capacity):
        self.a, self.m = KVAllocator(capacity), Model(capacity)

    @rule(target=segs, size=st.integers(1, 20))
    def allocate(self, size):
        expected = self.m.best_fit(size)
        assert (expected is None) == (self.a.largest_free() < size)
        got = self.a.allocate(size)
        assert got == expected
        if got is None:
            return multiple()
        sid, self.next_id = self.next_id, self.next_id + 1
        self.m.place(sid, got, size)  # asserts no overlap with a live segment
        return sid

    @rule(sid=consumes(segs))
    def free(self, sid):
        start, _ = self.m.where[sid]
        self.a.free(start)
        self.m.remove(sid)
        with pytest.raises(KeyError):
            self.a.free(start)

    @rule(sid=segs, new_size=st.integers(1, 24))
    def resize(self, sid, new_size):
        start, size = self.m.where[sid]
        expected = self.m.expected_resize(sid, new_size)
        before = (self.a.segments(), self.a.free_blocks())
        got = self.a.resize(start, new_size)
        assert got == expected
        if got is None:
            assert (self.a.segments(), self.a.free_blocks()) == before
            return
        self.m.remove(sid)
        self.m.place(sid, got, new_size)
        assert self.a.segment_size(got) == new_size

    @invariant()
    def agrees_with_model(self):
        self.a.check()
        m = self.m
        assert self.a.segments() == sorted(m.where.values())
        assert self.a.free_blocks() == m.runs()
        assert self.a.reserved == sum(n for _, n in m.where.values())
        assert self.a.free_slots == m.slots.count(None)
        assert self.a.largest_free() == max((n for _, n in m.runs()), default=0)


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestAllocatorMachine = AllocatorMachine.TestCase


# --------------------------------------------------------------------- @given op lists
ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "resize"]), st.integers(0, 64), st.integers(1, 30)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 64), ops=ops)
def test_random_op_sequences_tile_and_never_overlap(capacity, ops):
    a = KVAllocator(capacity)
    owner: list[int | None] = [None] * capacity  # slot -> segment start in allocator
    for op, pick, size in ops:
        live = a.segments()
        if op == "alloc" or not live:
            fits = [(n, s) for s, n in a.free_blocks() if n >= size]
            got = a.allocate(size)
            assert got == (min(fits)[1] if fits else None)
            if got is not None:
                assert all(owner[i] is None for i in range(got, got + size))
        elif op == "free":
            start, _ = live[pick % len(live)]
            a.free(start)
        else:
            start, _ = live[pick % len(live)]
            before = (a.segments(), a.free_blocks())
            got = a.resize(start, size)
            if got is None:
                assert (a.segments(), a.free_blocks()) == before
        a.check()
        owner = [None] * capacity
        for s, n in a.segments():
            for i in range(s, s + n):
                assert owner[i] is None
                owner[i] = s
        assert a.free_slots == owner.count(None) == capacity - a.reserved


@pytest.mark.parametrize("left", [False, True])
def test_gather_packs_the_window_and_copies_safely(left):
    import random

    rng = random.Random(int(left))
    for _ in range(300):
        a = KVAllocator(rng.randint(20, 80))
        ids = []
        while (start := a.allocate(rng.randint(1, 8))) is not None:
            ids.append(start)
        for s in rng.sample(ids, len(ids) // 2):
            a.free(s)
        memory = [None] * a.capacity  # slot -> label of the segment holding it
        for s, n in a.segments():
            memory[s:s + n] = [s] * n
        before = a.segments()
        bounds = [s for s, _ in a.free_blocks()] + [s + n for s, n in before]
        edge = 0 if left else a.capacity
        pos = rng.choice([b for b in bounds if b != edge] or [a.capacity - edge])
        amount = rng.randint(1, 30)
        moves = a.gather(pos, amount, max_moved=a.capacity, left=left)
        a.check()
        if moves is None:
            assert a.segments() == before
            continue
        lo, hi = (pos - amount, pos) if left else (pos, pos + amount)
        assert any(s <= lo and hi <= s + n for s, n in a.free_blocks())
        for old, new in moves:  # in the returned order, an overlap-safe copy
            n = dict(before)[old]
            assert new < old if left else new > old
            memory[new:new + n] = list(memory[old:old + n])
        after = dict(a.segments())
        relocated = dict(moves)
        for s, n in before:
            new = relocated.get(s, s)
            assert after[new] == n and memory[new:new + n] == [s] * n


def test_gather_refuses_short_space_or_too_much_copying():
    a = KVAllocator(30)
    x, y, z = a.allocate(10), a.allocate(10), a.allocate(5)
    a.free(x)  # free: [0, 10) and [25, 30)
    before = (a.segments(), a.free_blocks())
    assert a.gather(0, 16, max_moved=100) is None  # only 15 free
    assert a.gather(0, 12, max_moved=10) is None  # would copy 15 slots
    assert (a.segments(), a.free_blocks()) == before
    assert a.gather(25, 11, max_moved=100, left=True) is None  # only 10 free left of 25
    assert a.gather(0, 12, max_moved=15) == [(z, 25), (y, 15)]
    assert a.free_blocks() == [(0, 15)]
    assert a.gather(30, 15, max_moved=15, left=True) == [(15, 0), (25, 10)]
    assert a.free_blocks() == [(15, 15)]


def test_free_around_counts_the_free_blocks_beside_a_segment():
    a = KVAllocator(30)
    x, y, z = a.allocate(5), a.allocate(10), a.allocate(5)
    a.free(x)  # free: [0, 5) and [20, 30)
    assert (a.free_around(y), a.free_around(z)) == (5, 10)
    a.free(z)
    assert a.free_around(y) == 20
