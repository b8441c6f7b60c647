"""Scheduling policies (services/compute/scheduling/policy.py, urgency.py) through the real
scheduler: queue order, whom an urgent request preempts (KV and running-cap cases), the budget
order, aging and the re-admission boost. Time is a fake clock the tests move."""

from __future__ import annotations

import pytest

from services.compute.core.sequence import SeqStatus, Sequence
from services.compute.core.step import StepSample
from services.compute.scheduling.kv_space import KVSpace
from services.compute.scheduling.policy import (
    MAX_BOOSTS,
    Fcfs,
    Priority,
    ShortestPredicted,
    make_scheduling_policy,
)
from services.compute.scheduling.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.length_dist import LengthDist
from shared.sampling import SamplingParams
from tests.steps import chunks


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def seq(rid: str, prompt: int = 4, max_tokens: int = 8, predicted: int | None = None,
        priority: int = 0, arrival: float | None = None) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Sequence(rid, list(range(1, prompt + 1)), params, seed=0, max_len=prompt + max_tokens,
                    predicted_length=LengthDist.point(predicted or max_tokens),
                    stop_ids=frozenset(), priority=priority, arrival=arrival)


def make(policy="priority", capacity=1000, budget=64, max_running=8, kv="max", delay_ms=10000.0):
    config = SchedulerConfig(budget, max_running, kv, scheduling_policy=policy,
                             max_queue_delay_ms=delay_ms)
    clock = Clock()
    return Scheduler(config, KVSpace(config, capacity), clock=clock), clock


def run_step(s: Scheduler):
    step = s.schedule()
    s.update(step, StepSample.of(step, [7] * len(step.sampled)))
    s.kv.allocator.check()
    return step


def ids(seqs) -> list[str]:
    return [x.request_id for x in seqs]


def test_policies_are_objects_named_once():
    for name, cls in (("fcfs", Fcfs), ("priority", Priority), ("predicted", ShortestPredicted)):
        assert isinstance(make_scheduling_policy(SchedulerConfig(scheduling_policy=name)), cls)
    with pytest.raises(ValueError, match="--scheduling-policy"):
        SchedulerConfig(scheduling_policy="sjf")
    with pytest.raises(ValueError, match="max-queue-delay"):
        SchedulerConfig(max_queue_delay_ms=0)


def test_priority_orders_queue_by_priority_then_arrival():
    s, clock = make(max_running=1)
    s.add(seq("x", priority=-5))
    run_step(s)  # x runs and holds the only place; nobody is more urgent than x
    for i, (rid, p) in enumerate((("a", 5), ("b", 1), ("c", 1), ("d", -1))):
        clock.t = i + 1.0
        s.add(seq(rid, priority=p))
    run_step(s)
    assert ids(s.running) == ["x"] and ids(s.waiting) == ["d", "b", "c", "a"]


def test_fcfs_keeps_arrival_order_and_never_preempts_for_priority():
    s, clock = make("fcfs", max_running=1)
    s.add(seq("x", priority=9))
    run_step(s)
    s.add(seq("a", priority=5))
    s.add(seq("b", priority=-5))
    run_step(s)
    assert ids(s.running) == ["x"] and ids(s.waiting) == ["a", "b"]
    assert s.stats.preemptions == 0


def test_predicted_orders_by_priority_then_shortest_predicted_work():
    s, clock = make("predicted", max_running=1, budget=64)
    s.add(seq("x", priority=-1))
    run_step(s)
    s.add(seq("long", max_tokens=100, predicted=80))
    s.add(seq("short", max_tokens=100, predicted=5))
    s.add(seq("mid", max_tokens=100, predicted=20))
    s.add(seq("long-prompt", prompt=640, max_tokens=100, predicted=5))  # +10 steps of prefill
    s.add(seq("urgent-long", max_tokens=100, predicted=90, priority=-1))
    run_step(s)
    assert ids(s.waiting) == ["urgent-long", "short", "long-prompt", "mid", "long"]


def test_urgent_request_preempts_least_urgent_latest_when_kv_binds():
    s, clock = make(capacity=60, max_running=8)  # max KV: each takes prompt + max_tokens = 12
    for i, (rid, p) in enumerate((("r1", 1), ("r2", 1), ("r0", 0), ("r3", 2), ("r4", 1))):
        clock.t = float(i)
        s.add(seq(rid, priority=p))
    run_step(s)  # 60 slots: all five run
    assert len(s.running) == 5
    clock.t = 10.0
    s.add(seq("u", priority=0))
    step = run_step(s)
    assert ids(s.waiting) == ["r3"] and s.waiting[0].preemptions == 1  # lowest priority only
    assert "u" in ids(s.running) and ids(x for x, _ in chunks(step)) == ["u"]
    s.add(seq("v", priority=0))
    run_step(s)
    # among the priority-1 ones, the latest arrival (r4) goes, and waits before r3
    assert ids(s.waiting) == ["r4", "r3"] and "v" in ids(s.running)
    assert s.stats.preemptions == 2


def test_urgent_request_preempts_when_running_cap_binds_but_equals_do_not():
    s, clock = make(max_running=2)
    s.add(seq("a", priority=1))
    clock.t = 1.0
    s.add(seq("b", priority=1))
    run_step(s)
    clock.t = 2.0
    s.add(seq("c", priority=1))  # as urgent as they are: it waits
    run_step(s)
    assert ids(s.running) == ["a", "b"] and s.stats.preemptions == 0
    s.add(seq("u", priority=0))
    run_step(s)
    assert ids(s.running) == ["a", "u"] and ids(s.waiting) == ["b", "c"]
    assert s.waiting[0].status is SeqStatus.WAITING and s.waiting[0].num_cached == 0


def test_urgent_request_gets_the_prefill_budget_first():
    for policy, first in (("priority", "u"), ("fcfs", "low")):
        s, clock = make(policy, budget=16)
        s.add(seq("low", prompt=100, priority=1))
        run_step(s)
        s.add(seq("u", prompt=8, priority=0))
        step = run_step(s)
        assert ids(x for x, _ in chunks(step))[0] == first
        if policy == "priority":
            assert [n for _, n in chunks(step)] == [8, 8]


def test_predicted_work_weighs_prefill_by_the_step_budget_and_decode_by_the_running_limit():
    policy = make_scheduling_policy(SchedulerConfig(512, 256, scheduling_policy="predicted"))
    long_prompt = seq("p", prompt=4096, max_tokens=10, arrival=0.0)  # 8 + 10/256 steps
    long_output = seq("o", prompt=10, max_tokens=1000, arrival=0.0)  # 10/512 + 1000/256
    assert policy.work(long_prompt) == pytest.approx(8 + 10 / 256)
    assert policy.key(long_output, 1.0) < policy.key(long_prompt, 1.0)
    long_prompt.num_cached = 4000  # most of its prompt prefilled: now the shorter job
    assert policy.key(long_prompt, 1.0) < policy.key(long_output, 1.0)


def test_aging_puts_a_request_waiting_the_bound_before_all_younger_ones():
    policy = ShortestPredicted(max_delay_s=2.0, step_tokens=64, running_slots=8, boost_s=0.5)
    long = seq("long", max_tokens=1000, predicted=1000, arrival=0.0)
    for t in (0.5, 1.0, 1.9):  # before the bound a fresh short request goes first
        short = seq("short", max_tokens=2, predicted=1, arrival=t)
        assert policy.key(short, t) < policy.key(long, t)
    for t in (2.0, 2.5, 50.0):  # from the bound on, the long one goes first
        short = seq("short", max_tokens=2, predicted=1, arrival=t - 1.99)
        assert policy.key(long, t) < policy.key(short, t)
        assert policy.key(long, t)[1] <= 0 < policy.key(short, t)[1]
    urgent = seq("urgent", max_tokens=1000, predicted=1000, arrival=50.0, priority=-1)
    assert policy.key(urgent, 50.0) < policy.key(long, 50.0)  # aging never crosses priorities


def test_readmission_boost_is_bounded_and_stays_within_priority():
    policy = Priority(boost_s=1.0)
    x, y = seq("x", arrival=5.0), seq("y", arrival=4.5)
    assert policy.key(y, 6.0) < policy.key(x, 6.0)
    x.preemptions = 1  # as if it had arrived at 4.0
    assert policy.key(x, 6.0) < policy.key(y, 6.0)
    z = seq("z", arrival=2.5)
    x.preemptions = 100  # at most MAX_BOOSTS boosts: as if it had arrived at 3.0
    assert policy.key(x, 6.0) == (0, -(6.0 - 5.0 + MAX_BOOSTS))
    assert policy.key(z, 6.0) < policy.key(x, 6.0)
    w = seq("w", arrival=6.0, priority=-1)
    assert policy.key(w, 6.0) < policy.key(x, 6.0)


def test_a_preempted_request_is_readmitted_before_later_equals():
    s, clock = make(max_running=1)
    s.add(seq("a", priority=1, max_tokens=20))
    run_step(s)
    clock.t = 1.0
    s.add(seq("u", priority=0, max_tokens=1))
    run_step(s)  # u preempts a
    clock.t = 2.0
    s.add(seq("b", priority=1))  # arrived after a: behind it
    clock.t = 0.0  # even had b arrived first, a's boost (2.5 s) puts it before b
    s.waiting[-1].arrival = -1.0
    while "u" in ids(s.running) or not s.running:
        run_step(s)
    assert ids(s.running) == ["a"] and ids(s.waiting) == ["b"]


def _serve_stream(delay_ms: float, steps: int) -> tuple[Sequence, Clock]:
    """A long request at t=0 among two short ones arriving every 50 ms step (more than two
    places can serve): the short ones alone would keep the long one waiting forever."""
    s, clock = make("predicted", max_running=2, kv="predicted", delay_ms=delay_ms)
    long = seq("long", max_tokens=200, predicted=200)
    s.add(long)
    for i in range(steps):
        s.add(seq(f"s{2 * i}", max_tokens=4, predicted=4))
        s.add(seq(f"s{2 * i + 1}", max_tokens=4, predicted=4))
        run_step(s)
        clock.t += 0.05
        if long.admit_order >= 0 and long.status is not SeqStatus.WAITING:
            break
    return long, clock


def test_a_stream_of_short_requests_never_keeps_a_long_one_past_the_bound():
    long, clock = _serve_stream(delay_ms=1000, steps=400)
    assert long.status is SeqStatus.RUNNING
    assert 1.0 <= clock.t <= 1.0 + 3 * 0.05  # admitted within a step or two of the bound
    starved, _ = _serve_stream(delay_ms=1e9, steps=200)  # (no aging: it would starve)
    assert starved.status is SeqStatus.WAITING


def test_the_simulated_engine_runs_the_policy_on_its_virtual_clock():
    """The sim backend's engine: arrivals and aging on the VirtualClock, priority from
    add_request; an urgent request arriving at a full batch preempts the latest batch one."""
    from services.compute.backend import build_engine
    from shared.config import EngineConfig
    from shared.settings import with_settings

    engine = build_engine(with_settings(EngineConfig(), backend="sim", sim_clock="virtual",
                                        scheduling_policy="priority", max_running=2))
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request([1] * 8, params, "a", priority=1)
    engine.add_request([1] * 8, params, "b", priority=1)
    engine.step()
    clock = engine.runner.clock
    assert clock.now > 0 and engine.requests["a"].arrival == 0.0
    engine.add_request([1] * 8, params, "u", priority=0)
    assert engine.requests["u"].arrival == clock.now
    engine.step()
    s = engine.scheduler
    assert ids(s.running) == ["a", "u"] and ids(s.waiting) == ["b"]
    assert engine.requests["b"].preemptions == 1
