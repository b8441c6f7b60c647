"""KV policies beside the default: paged blocks (the vLLM baseline), static batching, and the
predicted policy's distribution-sized reservations, regrowth and future-peak admission."""

from __future__ import annotations

import random

import pytest

from pipellm.services.compute.core.sequence import SeqStatus, Sequence
from pipellm.services.compute.core.step import StepSample
from pipellm.services.compute.kv import compaction
from pipellm.services.compute.kv.allocator import KVAllocator
from pipellm.services.compute.kv.paged_allocator import PagedAllocator
from pipellm.services.compute.scheduling.kv_space import KVSpace
from pipellm.services.compute.scheduling.scheduler import Scheduler
from pipellm.shared.config import Admission, EngineConfig, SchedulerConfig
from pipellm.shared.length_dist import LEVELS, LengthDist
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.settings import with_settings
from tests.steps import chunks, decodes

WIDE = LengthDist((4, 6, 10, 20, 40, 50, 60))  # median 10, p90 40


def seq(rid: str, prompt_len: int, max_tokens: int = 100, predicted_length=None) -> Sequence:
    return Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    seed=0, max_len=prompt_len + max_tokens,
                    predicted_length=predicted_length or LengthDist.point(4), stop_ids=frozenset())


def make(policy="predicted", capacity=1000, budget=64, max_running=16, batching="merged",
         admission="auto"):
    config = SchedulerConfig(budget, max_running, policy, 2, batching=batching,
                             kv_admission=admission)
    return Scheduler(config, KVSpace(config, capacity))


def run_step(s: Scheduler):
    step = s.schedule()
    s.update(step, StepSample.of(step, [7] * len(step.sampled)))
    s.kv.allocator.check()
    return step


# -- paged -----------------------------------------------------------------------------------
def test_paged_allocator_rounds_to_blocks_and_never_moves():
    a = PagedAllocator(100, block_size=16)
    assert a.capacity == 96 and a.free_slots == 96  # whole blocks only
    h = a.allocate(17)
    assert a.reserved == 32
    assert a.resize(h, 33) == h and a.reserved == 48
    assert a.resize(h, 200) is None and a.reserved == 48  # unchanged on failure
    assert a.allocate(49) is None and a.allocate(48) is not None
    a.free(h)
    a.check()
    assert a.reserved == 48
    with pytest.raises(ValueError):
        a.allocate(0)


def test_paged_policy_grows_a_block_at_a_time_and_preempts_without_moves():
    s = make("paged", capacity=16 * 8, budget=64)
    a, b = seq("a", 20), seq("b", 20)
    s.add(a)
    s.add(b)
    run_step(s)
    assert (a.kv_reserved, s.kv.allocator.reserved) == (20, 64)  # 2 blocks each
    while a.num_cached <= 32:
        assert not run_step(s).moves
    assert s.kv.allocator.reserved == 6 * 16  # each crossed into a third block
    while s.stats.preemptions == 0:
        assert not run_step(s).moves
    assert b.status is SeqStatus.WAITING and a.status is SeqStatus.RUNNING  # b came last
    assert s.kv.stats.moves == 0


def test_paged_admission_keeps_a_watermark():
    s = make("paged", capacity=16 * 100, budget=2048)
    s.add(seq("a", 16 * 98, max_tokens=10))  # leaves 2 of 100 blocks: >= the 1% watermark
    s.add(seq("b", 32, max_tokens=10))  # would leave no block: below the 1-block watermark
    run_step(s)
    assert [x.request_id for x in s.running] == ["a"] and len(s.waiting) == 1


def test_paged_policy_needs_the_simulator():
    with pytest.raises(ValueError, match="paged"):
        EngineConfig(scheduler=SchedulerConfig(kv_policy="paged"))
    EngineConfig(scheduler=SchedulerConfig(kv_policy="paged"), backend="sim")
    for policy, allocator in (("paged", PagedAllocator), ("predicted", KVAllocator)):
        assert type(KVSpace(SchedulerConfig(kv_policy=policy), 64).allocator) is allocator


# -- static batching -------------------------------------------------------------------------
def test_static_batching_admits_only_into_an_empty_batch():
    s = make("max", capacity=1000, budget=16, batching="static")
    first = [seq(f"a{i}", 10, max_tokens=3 + i) for i in range(3)]
    for x in first:
        s.add(x)
    run_step(s)
    assert len(s.running) == 3  # all admitted at once, beyond the 16-token budget
    late = seq("late", 4, max_tokens=2)
    s.add(late)
    while any(x.status is not SeqStatus.FINISHED for x in first):
        assert late.status is SeqStatus.WAITING  # waits although memory is free
        run_step(s)
    run_step(s)
    assert late.status is SeqStatus.RUNNING


# -- predicted: distributions and the future peak --------------------------------------------
def test_reserves_a_quantile_and_regrows_to_the_conditional_quantile():
    s = make("predicted", capacity=1000)
    a = seq("a", 10, predicted_length=WIDE)
    s.add(a)
    run_step(s)
    assert a.kv_reserved == 10 + WIDE.quantile(0.5) == 20
    while a.kv_reserved == 20:
        run_step(s)
    # it ran out with its 11th output token pending: regrown given > 11 tokens of output
    assert a.num_output == 12 and a.kv_reserved == 10 + WIDE.conditional_quantile(11, 0.9)


def test_paged_memory_with_peak_admission():
    def admitted(admission: str) -> list[str]:
        config = SchedulerConfig(64, 16, "paged", 2, kv_admission=admission)
        s = Scheduler(config, KVSpace(config, 16 * 7))  # 112 slots; each may peak at 50
        for x in "abc":
            s.add(seq(x, 10, max_tokens=60, predicted_length=WIDE))
        run_step(s)
        return [x.request_id for x in s.running]

    assert admitted("fit") == admitted("auto") == ["a", "b", "c"]  # vLLM: whatever fits now
    assert admitted("peak") == ["a", "b"]
    with pytest.raises(ValueError, match=r"--kv-admission must be one of \('auto', 'peak', "
                       r"'aggregate', 'fit'\), not 'greedy'"):
        SchedulerConfig(kv_admission="greedy")
    with pytest.raises(ValueError, match="--kv-admission"):  # checked as the config is built
        with_settings(EngineConfig(), kv_admission="greedy")
    with pytest.raises(ValueError, match=r"--batching must be one of \('merged', 'static'\)"):
        SchedulerConfig(batching="dynamic")
    assert SchedulerConfig(kv_admission="peak").kv_admission == Admission.PEAK  # text or enum
    assert SchedulerConfig(kv_admission=Admission.PEAK) == SchedulerConfig(kv_admission="peak")


def test_admission_keeps_the_future_peak_in_memory():
    # each: 10 prompt tokens, 20 reserved; by p90 it may hold 50; two peak at 100 together
    s = make("predicted", capacity=100, admission="peak")
    a, b, c = (seq(x, 10, max_tokens=60, predicted_length=WIDE) for x in "abc")
    for x in (a, b, c):
        s.add(x)
    run_step(s)
    assert [x.request_id for x in s.running] == ["a", "b"] and s.waiting[0] is c
    assert s.kv.allocator.free_slots >= 20  # c's reservation would fit: the peak refuses it
    lone = make("predicted", capacity=40)
    big = seq("big", 10, max_tokens=30, predicted_length=WIDE)
    lone.add(big)
    run_step(lone)
    assert big.status is SeqStatus.RUNNING  # alone, a request always gets its chance


# -- LengthDist --------------------------------------------------------------------------------
def test_length_dist_quantiles_invert_the_cdf():
    rng = random.Random(0)
    for _ in range(200):
        vals = sorted(rng.randint(1, 500) for _ in LEVELS)
        d = LengthDist(tuple(vals))
        qs = [d.quantile(q / 100) for q in range(101)]
        assert qs == sorted(qs) and qs[0] >= 1
        for q in (0.1, 0.5, 0.9, 0.99):
            x = d.quantile(q)
            assert d.cdf(x) >= q - 1e-9 and (x == 1 or d.cdf(x - 1) < q + 1e-9)
        g = rng.randint(0, 1200)
        assert d.conditional_quantile(g, 0.5) > g


def test_length_dist_point_and_samples():
    p = LengthDist.point(64)
    assert p.quantile(0.05) == p.quantile(0.9) == p.median == 64
    assert p.conditional_quantile(10, 0.9) == 64 and p.conditional_quantile(64, 0.5) > 64
    assert LengthDist.from_samples(range(1, 101)).median == 51
    with pytest.raises(ValueError):
        LengthDist((5, 4, 6, 7, 8, 9, 10))
    with pytest.raises(ValueError):
        LengthDist((0,) * len(LEVELS))


@pytest.fixture
def copies_unlimited(monkeypatch):
    monkeypatch.setattr(compaction, "COPY_RATE", 1.0)  # each step may copy the whole cache


def test_split_free_space_moves_the_right_neighbour_instead_of_preempting(copies_unlimited):
    s = make("predicted", capacity=40)
    a_ = s.kv.allocator
    layout = {}
    for name, size in (("p", 10), ("a", 8), ("b", 4), ("c", 6), ("q", 6), ("d", 6)):
        layout[name] = (a_.allocate(size), size)
    a_.free(layout["c"][0])  # holes: [22, 28) and [34, 40); none takes a grown "a"
    a_.free(layout["d"][0])
    for name in ("p", "a", "b", "q"):
        start, size = layout[name]
        x = seq(name, 3, max_tokens=30)
        x.token_ids += [7] * (size - 3 + (name == "a"))  # "a" has one token past its segment
        x.num_cached, x.kv_start, x.kv_reserved = x.num_tokens - 1, start, size
        x.status = SeqStatus.RUNNING
        s.running.append(x)
    a, b = s.running[1], s.running[2]
    step = s.schedule()
    assert step.moves == [(18, 22, b.num_cached)]  # b moved into the hole after it
    assert (a.kv_start, b.kv_start) == (10, 22) and a.kv_reserved >= a.num_tokens
    assert s.stats.preemptions == 0 and len(decodes(step)) == 4
    s.kv.allocator.check()


def test_gather_shifts_neighbours_right_when_no_hole_takes_them(copies_unlimited):
    s = make("predicted", capacity=400)  # a growth's gather may copy 15% of it: 60 slots
    alloc = s.kv.allocator
    starts = {n: alloc.allocate(size) for n, size in (("a", 8), ("b", 12), ("gap", 4))}
    starts["f"] = alloc.allocate(376)
    alloc.free(starts["gap"])  # the only hole: [20, 24); b (12 slots) fits nowhere else
    for name, size in (("a", 8), ("b", 12), ("f", 376)):
        x = seq(name, 3, max_tokens=390)
        x.token_ids += [7] * (size - 3 + (name == "a"))
        x.num_cached, x.kv_start, x.kv_reserved = x.num_tokens - 1, starts[name], size
        x.status = SeqStatus.RUNNING
        s.running.append(x)
    a, b = s.running[0], s.running[1]
    step = s.schedule()
    assert step.moves == [(8, 12, b.num_cached)] and b.kv_start == 12
    assert a.kv_start == 0 and a.num_tokens <= a.kv_reserved <= 12 and s.stats.preemptions == 0
    s.kv.allocator.check()


def place(s: Scheduler, layout: list[tuple[str, int, int]], grow: str) -> dict[str, Sequence]:
    """Make running sequences of `layout` ((name, start, size) in address order, admitted in
    list order unless `admit_order` is set later): each with one pending token that its segment
    holds, except `grow`, whose pending token needs one slot more. Gaps stay free."""
    alloc, out, fillers, pos = s.kv.allocator, {}, [], 0
    for name, start, size in layout:
        if start > pos:
            fillers.append(alloc.allocate(start - pos))
        assert alloc.allocate(size) == start
        x = seq(name, 1, max_tokens=alloc.capacity)
        x.token_ids += [7] * (size - 1 + (name == grow))
        x.num_cached, x.kv_start, x.kv_reserved = x.num_tokens - 1, start, size
        x.status, x.admit_order = SeqStatus.RUNNING, len(out)
        s.running.append(x)
        out[name], pos = x, start + size
    for f in fillers:
        alloc.free(f)
    return out


@pytest.mark.parametrize("copy_rate", [0.1, 0.05])
def test_growth_packs_the_segments_before_it_left_when_nothing_after_it_can_move(
        copy_rate, monkeypatch):
    monkeypatch.setattr(compaction, "COPY_RATE", copy_rate)  # may copy 20 or 10 slots now
    s = make("predicted", capacity=200)  # a growth's gather may shift 30 slots
    x = place(s, [("b", 10, 10), ("a", 20, 10), ("c", 30, 170)], grow="a")
    b_cached, a_cached = x["b"].num_cached, x["a"].num_cached  # 9 + 9: 18 slots to copy
    step = s.schedule()
    if copy_rate == 0.05:  # over the copy budget: the newer right neighbour is preempted
        assert not step.moves and x["c"].status is SeqStatus.WAITING
        assert s.stats.preemptions == 1 and x["a"].kv_start == 20
        return
    # c fits in no hole and nothing is free after it: b and a shift left into [0, 10)
    assert step.moves == [(10, 0, b_cached), (20, 10, a_cached)]
    assert (x["b"].kv_start, x["a"].kv_start) == (0, 10) and x["a"].kv_reserved >= 11
    assert s.stats.preemptions == 0 and len(decodes(step)) == 3
    s.kv.allocator.check()


@pytest.mark.parametrize("c_newer", [True, False])
def test_a_segment_that_cannot_grow_preempts_one_whose_room_holds_it_or_itself(c_newer):
    # a needs 31 slots; its right neighbour b is older; 5 slots are free, in no useful place
    s = make("predicted", capacity=100)  # gathers of up to 15 slots: too few here
    x = place(s, [("a", 0, 30), ("b", 30, 25), ("d", 55, 5), ("c", 65, 35)], grow="a")
    order = ["b", "c", "a", "d"] if not c_newer else ["b", "a", "c", "d"]
    for i, name in enumerate(order):
        x[name].admit_order = i
    s.running.sort(key=lambda q: q.admit_order)
    s.schedule()
    assert x["d"].status is SeqStatus.RUNNING  # the newest, but its room would not hold a
    if c_newer:  # c's 35 slots and the 5 free before them hold a
        assert x["c"].status is SeqStatus.WAITING and x["a"].kv_start == 60
    else:  # nobody newer helps: a itself waits, rather than everyone after it
        assert x["a"].status is SeqStatus.WAITING and x["c"].status is SeqStatus.RUNNING
    assert s.stats.preemptions == 1
    s.kv.allocator.check()


@pytest.mark.parametrize("seed", range(6))
def test_random_runs_keep_every_cached_token_where_its_segment_says(seed, monkeypatch):
    """Model the KV cache as slot labels: apply each step's moves in order (overlap-safe), then
    write the step's tokens at their slots. Whatever grows, moves, slides, gathers or is
    preempted, every running request's cached tokens must sit at [kv_start, kv_start + n)."""
    for share in ("ADMIT_GATHER_SHARE", "GROW_GATHER_SHARE"):  # let small caches gather
        monkeypatch.setattr(compaction, share, 0.5)
    rng = random.Random(seed)
    s = make("predicted", capacity=rng.choice([120, 200, 300]), budget=48, max_running=12)
    cache: list = [None] * s.kv.allocator.capacity
    n = 0
    for _ in range(400):
        if rng.random() < 0.3:
            lengths = LengthDist(tuple(sorted(rng.randint(1, 40) for _ in LEVELS)))
            s.add(seq(f"r{n}", rng.randint(1, 30), max_tokens=rng.randint(1, 60),
                      predicted_length=lengths))
            n += 1
        if not s.has_work():
            continue
        step = s.schedule()
        for src, dst, k in step.moves:
            cache[dst:dst + k] = cache[src:src + k]
        for x in decodes(step):
            cache[x.kv_start + x.num_cached] = (x.request_id, x.num_cached)
        for x, k in chunks(step):
            for p in range(x.num_cached, x.num_cached + k):
                cache[x.kv_start + p] = (x.request_id, p)
        s.update(step, StepSample.of(step, [7] * len(step.sampled)))
        s.kv.allocator.check()
        for x in s.running:
            assert x.num_cached <= x.kv_reserved
            assert s.kv.allocator.segment_size(x.kv_start) == x.kv_reserved
            assert cache[x.kv_start:x.kv_start + x.num_cached] == \
                [(x.request_id, p) for p in range(x.num_cached)]
    assert s.kv.stats.moves > 0 and n > 50
