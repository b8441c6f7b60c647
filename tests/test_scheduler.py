"""Scheduler as pure logic: no model, no torch. Tokens are fed back by hand."""

from __future__ import annotations

import pytest

from pipellm.services.compute.core.sequence import SeqStatus, Sequence
from pipellm.services.compute.core.step import StepSample
from pipellm.services.compute.scheduling.kv_space import KVSpace
from pipellm.services.compute.scheduling.scheduler import Scheduler
from pipellm.shared.config import SchedulerConfig
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.sampling import SamplingParams
from tests.steps import chunks, decodes


def seq(rid: str, prompt_len: int, max_tokens: int = 8, predicted: int = 4, stop=(), **kw):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, **kw)
    return Sequence(rid, list(range(1, prompt_len + 1)), params, seed=0,
                    max_len=prompt_len + max_tokens, predicted_length=LengthDist.point(predicted),
                    stop_ids=frozenset(stop))


def make(capacity=1000, budget=16, max_running=8, policy="predicted", min_grow=2):
    config = SchedulerConfig(budget, max_running, policy, min_grow)
    return Scheduler(config, KVSpace(config, capacity))


def run_step(s: Scheduler, token: int = 7):
    step = s.schedule()
    n = len(step.sampled)
    s.update(step, StepSample.of(step, [token] * n))
    s.kv.allocator.check()
    return step


def test_long_prompt_is_chunked_and_interleaved_with_decodes():
    s = make(budget=16)
    a, b = seq("a", 4), seq("b", 40)
    s.add(a)
    first = run_step(s)
    assert [x.request_id for x, _ in chunks(first)] == ["a"] and a.num_output == 1
    s.add(b)
    sizes = []
    while b.num_output == 0:
        step = run_step(s)
        assert step.num_tokens <= 16
        if a.status is SeqStatus.RUNNING:
            assert decodes(step) == [a]  # a decodes in every step b prefills
        sizes += [n for x, n in chunks(step) if x is b]
    assert sizes == [15, 15, 10]  # 16-token budget minus a's decode token
    assert b.num_cached == 40 and b.num_output == 1


def test_fcfs_admission_stops_at_head_that_does_not_fit():
    s = make(capacity=30, budget=64)
    big, small = seq("big", 20, predicted=4), seq("small", 2, predicted=2)
    s.add(seq("first", 8, predicted=4))  # takes 12 slots
    s.add(big)  # needs 24: does not fit beside the first
    s.add(small)  # would fit, but may not overtake
    run_step(s)
    assert [x.request_id for x in s.running] == ["first"]
    assert list(s.waiting) == [big, small]


def test_max_running_and_budget_limit_admission():
    s = make(budget=10, max_running=2)
    for i in range(4):
        s.add(seq(f"r{i}", 3))
    step = s.schedule()
    assert len(chunks(step)) == 2 and len(s.waiting) == 2
    s2 = make(budget=5, max_running=3)
    for i in range(3):
        s2.add(seq(f"r{i}", 3))
    step = s2.schedule()
    assert [n for _, n in chunks(step)] == [3, 2]  # the budget cuts the second prompt's chunk


@pytest.mark.parametrize("policy,expected", [("predicted", 10 + 4), ("max", 10 + 50)])
def test_reservation_policy(policy, expected):
    s = make(policy=policy)
    a = seq("a", 10, max_tokens=50, predicted=4)
    s.add(a)
    s.schedule()
    assert a.kv_reserved == expected and s.kv.allocator.reserved == expected


def test_grow_move_and_preempt_most_recent():
    s = make(capacity=24, budget=64, min_grow=2)
    a, b = seq("a", 6, max_tokens=18, predicted=1), seq("b", 6, max_tokens=18, predicted=1)
    s.add(a)
    run_step(s)  # a: [0, 7)
    s.add(b)
    run_step(s)  # b: [7, 14); a decodes into its last slot
    assert run_step(s).moves == [(0, 14, 7)]  # a is full and b blocks it: a moves right
    # b is full; its left neighbour is free now, so it moves left, overlapping its old range
    assert run_step(s).moves == [(7, 0, 7)] and (a.kv_start, b.kv_start) == (14, 0)
    while s.stats.preemptions == 0:
        run_step(s)
    assert b.status is SeqStatus.WAITING and b.num_cached == 0  # b was admitted last
    assert a.status is SeqStatus.RUNNING


def test_segment_grows_in_place_when_right_neighbour_is_free():
    s = make(capacity=100, min_grow=3)
    a = seq("a", 5, max_tokens=20, predicted=2)
    s.add(a)
    for _ in range(4):
        run_step(s)
    assert (a.kv_start, a.kv_reserved) == (0, 10)  # 7, then grown by 3 slots in place
    assert s.kv.stats.grows_in_place == 1 and s.kv.stats.moves == 0


def test_preempted_request_recomputes_all_its_tokens():
    s = make(capacity=16, budget=64, min_grow=1)
    a, b = seq("a", 4, max_tokens=12, predicted=1), seq("b", 4, max_tokens=12, predicted=1)
    s.add(a)
    s.add(b)
    run_step(s)
    while s.stats.preemptions == 0:
        outputs_before = {x.request_id: x.num_output for x in (a, b)}
        run_step(s)
    assert s.stats.preemptions == 1  # both cannot fit: one of them waits
    (victim,) = [x for x in (a, b) if x.status is SeqStatus.WAITING]
    assert outputs_before[victim.request_id] >= 1
    while victim.status is SeqStatus.WAITING:
        run_step(s)
    # readmitted: its first chunk covers prompt + everything generated so far
    assert victim.num_cached == victim.num_tokens - 1
    assert victim.num_output == outputs_before[victim.request_id] + 1


def test_finish_conditions():
    s = make()
    eos = seq("eos", 3, stop=(9,))
    s.add(eos)
    run_step(s, token=9)
    assert eos.finish_reason == "stop" and eos.status is SeqStatus.FINISHED
    assert s.kv.allocator.reserved == 0

    m = seq("min", 3, stop=(9,), min_tokens=2)
    s.add(m)
    run_step(s, token=9)
    assert m.finish_reason is None  # min_tokens not reached
    run_step(s, token=9)
    run_step(s, token=9)
    assert m.finish_reason == "stop" and m.num_output == 3

    ln = seq("len", 3, max_tokens=2)
    s.add(ln)
    run_step(s)
    run_step(s)
    assert ln.finish_reason == "length" and ln.num_output == 2

    ctx = Sequence("ctx", [1, 2, 3], SamplingParams(max_tokens=50), seed=0, max_len=5,
                   predicted_length=LengthDist.point(4), stop_ids=frozenset())
    s.add(ctx)
    run_step(s)
    run_step(s)
    assert ctx.finish_reason == "length" and ctx.num_tokens == 5


def test_abort_frees_kv_and_request_too_large_is_refused():
    s = make(capacity=20)
    a = seq("a", 5)
    s.add(a)
    run_step(s)
    s.abort(a)
    assert a.status is SeqStatus.FINISHED and a.finish_reason == "abort"
    assert s.kv.allocator.reserved == 0 and not s.has_work()
    with pytest.raises(ValueError, match="KV slots"):
        s.add(seq("huge", 15, max_tokens=10))


def test_kv_policies_are_objects_named_once():
    from pipellm.services.compute.kv.paged_allocator import PagedAllocator
    from pipellm.services.compute.scheduling.kv_policy import (
        MaxLength,
        Paged,
        Predicted,
        make_policy,
    )

    assert isinstance(make_policy(SchedulerConfig(kv_policy="paged")), Paged)
    assert make_policy(SchedulerConfig(kv_policy="max")) == MaxLength()
    assert make_policy(SchedulerConfig(kv_reserve_horizon=8)) == Predicted(0.5, 0.9, 8, 16)
    with pytest.raises(ValueError, match=r"--kv-policy must be one of \('predicted', 'max', "
                       r"'paged'\), not 'lru'"):
        SchedulerConfig(kv_policy="lru")
    assert type(KVSpace(SchedulerConfig(kv_policy="paged"), 64).allocator) is PagedAllocator
    # the horizon caps what a long predicted output reserves at admission
    a = seq("a", 10, max_tokens=500, predicted=300)
    assert Predicted(0.5, 0.9, 8, 16).reservation(a) == 18
    assert Predicted(0.5, 0.9, 0, 16).reservation(a) == 310
    # paged keeps 1% of the blocks free at admission
    paged = PagedAllocator(1600)
    assert Paged().can_admit(paged, 1584) and not Paged().can_admit(paged, 1585)
