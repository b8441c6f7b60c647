"""The engine's step counts and compute's periodic stats line
(pipellm/services/compute/step_stats.py), with a clock the test moves: the first line after the
interval, throughputs over it, nothing for an idle interval."""

from __future__ import annotations

from pipellm.services.compute.core.step import ScheduledStep, Work, WorkItem
from pipellm.services.compute.engine import EngineStats
from pipellm.services.compute.step_stats import StatsLine, StepCounts


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _step(decode: int, prefill: list[int]) -> ScheduledStep:
    """A step of `decode` decode rows and prefill chunks of these sizes (the items' kinds and
    sizes are all the counts read)."""
    items = [WorkItem(None, Work.DECODE, 1, 1) for _ in range(decode)]
    items += [WorkItem(None, Work.PREFILL, n, 0) for n in prefill]
    return ScheduledStep(items)


def _stats(running: int, waiting: int, **kw) -> EngineStats:
    fields = dict(capacity=1000, reserved=0, used=0, running=running, waiting=waiting,
                  moves=0, grows_in_place=0, preemptions=0)
    return EngineStats(**{**fields, **kw})


def test_counts_add_steps_by_kind():
    c = StepCounts()
    for step, launch_s in ((_step(3, [100, 28]), 0.01), (_step(4, []), 0.02)):
        c.add_step(step, step.num_tokens, launch_s)
    assert (c.steps, c.decode_rows, c.prompt_tokens) == (2, 7, 128)
    assert abs(c.launch_s - 0.03) < 1e-12
    assert c.minus(StepCounts(steps=1, decode_rows=3)).decode_rows == 4


def test_the_line_gives_the_interval_s_rates_and_where_the_time_went():
    clock, counts = Clock(), StepCounts()
    line = StatsLine(10.0, clock)
    for _ in range(20):
        counts.add_step(_step(50, [200]), 250, 0.3)
    counts.generated, counts.wait_s = 1000, 2.0
    stats = _stats(50, 7, used=250, reserved=750, demand=3260, prefix_queries=400,
                   prefix_hits=200)
    clock.t += 5
    assert line.line(counts, stats, True) is None  # not yet due
    clock.t += 5
    assert line.line(counts, stats, True) == (
        "Avg prompt throughput: 400.0 tokens/s, Avg generation throughput: 100.0 tokens/s, "
        "Running: 50 reqs, Waiting: 7 reqs, KV cache usage: 25.0% (reserved 75.0%, predicted "
        "demand 326.0%), Prefix cache hit rate: 50.0%; steps: 2.0/s, 50.0 decode rows and "
        "200.0 prompt tokens a step, launch 60% and wait 20% of the time")
    clock.t += 10  # the next interval counts only its own steps
    counts.add_step(_step(1, []), 1, 0.0)
    counts.generated += 10
    text = line.line(counts, _stats(1, 0), False)
    assert "Avg generation throughput: 1.0 tokens/s" in text and "Prefix" not in text


def test_an_idle_interval_logs_nothing():
    clock = Clock()
    line = StatsLine(10.0, clock)
    clock.t += 11
    assert line.line(StepCounts(), _stats(0, 0), False) is None
    clock.t += 11
    assert "Waiting: 3 reqs" in line.line(StepCounts(), _stats(0, 3), False)  # held, not run
