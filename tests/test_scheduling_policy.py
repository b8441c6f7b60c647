"""Scheduling policies (pipellm/services/compute/scheduling/policy.py, urgency.py) through the real
scheduler: queue order, whom an urgent request preempts (KV and running-cap cases), the budget
order, aging and the re-admission boost. Time is a fake clock the tests move."""

from __future__ import annotations

import pytest

from pipellm.services.compute.core.sequence import SeqStatus, Sequence
from pipellm.services.compute.core.step import StepSample
from pipellm.services.compute.scheduling.kv_space import KVSpace
from pipellm.services.compute.scheduling.policy import (
    MAX_BOOSTS,
    PACE_WEIGHT,
    PREEMPT_MARGIN,
    Fcfs,
    Priority,
    ShortestPredicted,
    StepPace,
    make_scheduling_policy,
)
from pipellm.services.compute.scheduling.scheduler import Scheduler
from pipellm.shared.config import SchedulerConfig
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.sampling import SamplingParams
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
    from pipellm.services.compute.backend import build_engine
    from pipellm.shared.config import EngineConfig
    from pipellm.shared.settings import with_settings

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


def _grow_until_preemption(s: Scheduler, limit: int = 50) -> None:
    for _ in range(limit):
        run_step(s)
        if s.stats.preemptions:
            return
    raise AssertionError("no request ever had to grow past the cache")


@pytest.mark.parametrize("kv", ["paged", "predicted"])
def test_a_request_growing_mid_decode_preempts_the_least_urgent_never_a_more_urgent_one(kv):
    """Batch requests a and c (priority 1, a first) and the urgent u fill the cache; each step
    every one needs one more slot. u is placed where the KV policy alone would take it for a:
    paged, the newest (admitted last); predicted, a's right neighbour (admitted after a,
    before c). Decodes are served most urgent first, and one that must grow preempts only
    those less urgent: the victim is c (the latest batch arrival), never u."""
    s, clock = make(capacity=64, max_running=8, kv=kv, budget=64)
    s.add(seq("a", prompt=8, max_tokens=40, predicted=8, priority=1))
    if kv == "paged":
        clock.t = 1.0
        s.add(seq("c", prompt=8, max_tokens=40, predicted=8, priority=1))
    run_step(s)
    clock.t = 2.0
    if kv == "predicted":
        s.add(seq("c", prompt=8, max_tokens=40, predicted=8, priority=1, arrival=1.0))
    s.add(seq("u", prompt=9 if kv == "paged" else 8, max_tokens=40, predicted=7, priority=0))
    run_step(s)
    assert ids(s.running) == (["a", "c", "u"] if kv == "paged" else ["a", "u", "c"])
    _grow_until_preemption(s)
    assert "u" in ids(s.running) and ids(s.waiting) == ["c"]
    for _ in range(3):
        run_step(s)
    u = next(x for x in s.running if x.request_id == "u")
    assert u.preemptions == 0 and u.num_output >= 10


def test_mid_decode_growth_under_fcfs_keeps_the_kv_policys_choice():
    """No reordering policy: the victim is the KV policy's (paged: the newest), as before."""
    s, clock = make("fcfs", capacity=64, max_running=8, kv="paged", budget=64)
    s.add(seq("a", prompt=8, max_tokens=40, predicted=8))
    s.add(seq("c", prompt=8, max_tokens=40, predicted=8))
    run_step(s)
    s.add(seq("u", prompt=9, max_tokens=40, predicted=7))
    run_step(s)
    _grow_until_preemption(s)
    assert ids(s.waiting) == ["u"] and ids(s.running) == ["a", "c"]


def test_step_pace_averages_busy_intervals_and_skips_idle_gaps():
    pace = StepPace()
    pace.tick(0.0, busy=False)
    pace.tick(0.02, busy=True)
    assert pace.step_s == pytest.approx(0.02)
    pace.tick(5.0, busy=False)  # idle until an arrival: no step
    assert pace.step_s == pytest.approx(0.02)
    pace.tick(5.04, busy=True)
    assert pace.step_s == pytest.approx(0.02 + PACE_WEIGHT * 0.02)


def test_delay_factor_bounds_a_wait_by_a_multiple_of_its_own_predicted_time():
    """Bound = min(max_delay_s, F x (prefill chunks + predicted output) x step time), fixed
    when first keyed; overdue requests go first, earliest deadline (arrival + bound) first."""
    policy = ShortestPredicted(max_delay_s=30.0, step_tokens=64, running_slots=8, boost_s=0.0,
                               delay_factor=4.0)
    early = seq("early", prompt=64, max_tokens=100, predicted=9, arrival=0.0)
    assert policy.bound(early) == 30.0  # no step time measured yet
    policy.tick(0.0, busy=True)
    policy.tick(0.1, busy=True)  # 100 ms steps
    short = seq("short", prompt=64, max_tokens=100, predicted=9, arrival=0.0)  # 1 + 9 steps
    long = seq("long", prompt=64, max_tokens=2000, predicted=999, arrival=0.0)
    assert policy.bound(short) == pytest.approx(4 * 10 * 0.1)
    assert policy.bound(long) == 30.0  # 4 x 100 s, capped
    policy.tick(0.2, busy=True)
    policy.tick(10.0, busy=True)  # a slow step later does not move a fixed bound
    assert policy.bound(short) == pytest.approx(4.0)
    assert policy.key(short, 3.9)[1] > 0 and policy.key(short, 4.1)[1] < 0  # overdue at 4 s
    older = seq("older", prompt=64, max_tokens=2000, predicted=999, arrival=-26.5)
    assert policy.bound(older) == 30.0
    # at t = 5: short is 1 s past its deadline (4 s), older 1.5 s past its (3.5 s): EDF
    assert policy.key(older, 5.0) < policy.key(short, 5.0) < policy.key(long, 5.0)
    # without the factor the same short request would wait its 30 s
    plain = ShortestPredicted(max_delay_s=30.0, step_tokens=64, running_slots=8, boost_s=0.0)
    plain.tick(0.0, busy=True)
    plain.tick(0.1, busy=True)
    assert plain.bound(seq("s", prompt=64, max_tokens=100, predicted=9, arrival=0.0)) == 30.0


def test_delay_factor_is_a_setting_resolved_once():
    policy = make_scheduling_policy(SchedulerConfig(scheduling_policy="predicted",
                                                    max_queue_delay_factor=8))
    assert policy.delay_factor == 8.0 and policy.max_delay_s == 30.0
    with pytest.raises(ValueError, match="max-queue-delay-factor"):
        SchedulerConfig(max_queue_delay_factor=-1)


def _stream_past(delay_factor: float, steps: int = 400) -> tuple[Sequence, Clock]:
    """`mid` (20 tokens) among a stream of 2-token requests, one every other 50 ms step, as
    fast as one place (max_running=1) serves them: always a shorter one waiting."""
    s, clock = make("predicted", max_running=1, budget=64, delay_ms=1e9)
    s.urgency.policy = ShortestPredicted(1e6, 64, 1, 0.0, delay_factor=delay_factor)
    mid = seq("mid", max_tokens=20, predicted=20)
    for i in range(steps):
        if i % 2 == 0:
            s.add(seq(f"s{i}", max_tokens=2, predicted=2))
        if i == 6:
            s.add(mid)
        run_step(s)
        clock.t += 0.05
        if mid.admit_order >= 0:
            break
    return mid, clock


def test_a_request_gets_in_within_a_multiple_of_its_own_predicted_time():
    """Through the scheduler, the aging bound at F x its own time: 3 x (1 prefill chunk + 20
    outputs) x 50 ms steps = 3.15 s after it arrived (0.3 s); without F it starves."""
    mid, clock = _stream_past(3.0)
    assert mid.admit_order >= 0 and 0.3 + 3.15 <= clock.t <= 0.3 + 3.15 + 0.15
    starved, _ = _stream_past(0.0, steps=200)
    assert starved.admit_order < 0


def test_predicted_preempts_for_a_waiting_request_only_past_the_margin():
    """max_running=1, a running request of 40 predicted tokens left: a waiting one predicted
    at 25 (more than half its work) waits; one at 10 (less than half) takes its place; an
    overdue one takes it whatever its length; across priorities the keys decide."""
    policy = make_scheduling_policy(SchedulerConfig(64, 1, scheduling_policy="predicted"))
    assert PREEMPT_MARGIN == 2.0
    assert not policy.displaces((0, 1.0), (0, 1.9)) and policy.displaces((0, 1.0), (0, 2.1))
    assert policy.displaces((0, -1.0), (0, 0.5)) and policy.displaces((0, 9.0), (1, 0.1))
    assert not policy.displaces((0, 1.0), (0, -5.0))  # an overdue running one stays
    s, clock = make("predicted", max_running=1, budget=64, delay_ms=10000)
    s.add(seq("run", prompt=4, max_tokens=40, predicted=40))
    run_step(s)
    s.add(seq("near", prompt=4, max_tokens=40, predicted=25))
    run_step(s)
    assert ids(s.running) == ["run"] and s.stats.preemptions == 0
    s.add(seq("short", prompt=4, max_tokens=40, predicted=10))
    run_step(s)
    assert ids(s.running) == ["short"] and s.stats.preemptions == 1
