"""What an engine's steps did (`StepCounts`, running totals the engine keeps) and the stats line
the compute service logs from them every few seconds, as vLLM logs its engine: prompt and
generation throughput, requests running and waiting, KV cache usage and prefix cache hit rate,
then where the steps' time went. `launch` is the host's part of a step (scheduling excluded;
on a CPU the forward too), `wait` the time spent waiting for a launched step's results (on a
GPU, the device's part the host did not overlap); the rest of the wall time is the loop's
own: receiving requests, sending tokens, scheduling, or idle."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace

from pipellm.services.compute.core.step import ScheduledStep, Work


@dataclass
class StepCounts:
    """Totals since start; `StatsLine` logs their differences."""

    steps: int = 0
    prompt_tokens: int = 0  # prefill tokens run
    decode_rows: int = 0  # decode, verify and beam rows run
    generated: int = 0  # output tokens committed
    launch_s: float = 0.0
    wait_s: float = 0.0

    def add_step(self, step: ScheduledStep, tokens: int, launch_s: float) -> None:
        """A launched step of `tokens` rows (its num_tokens). Its items are ordered by kind,
        the prefill chunks last: only those are read, not every decode row."""
        prompt = 0
        for item in reversed(step.items):
            if item.kind is not Work.PREFILL:
                break
            prompt += item.tokens
        self.steps += 1
        self.launch_s += launch_s
        self.prompt_tokens += prompt
        self.decode_rows += tokens - prompt

    def minus(self, other: StepCounts) -> StepCounts:
        return StepCounts(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                             for f in fields(self)})


class StatsLine:
    """Every `interval_s` (of `clock`), the counts' change since the last line as one line;
    nothing where nothing ran and no request is held."""

    def __init__(self, interval_s: float, clock=time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self._last, self._at = StepCounts(), clock()

    def line(self, counts: StepCounts, stats, prefix_cache: bool) -> str | None:
        """The line, once the interval has passed (None before, and for an idle interval).
        `stats`: the engine's EngineStats (requests running and waiting; KV slots: capacity,
        used, reserved by the running requests' segments, and the demand that every held
        request's predicted length makes, what admission weighs); `prefix_cache`: whether to
        give the prefix cache's hit rate since start."""
        now = self.clock()
        if now - self._at < self.interval_s:
            return None
        d, dt = counts.minus(self._last), now - self._at
        self._last, self._at = replace(counts), now
        if not d.steps and not stats.running and not stats.waiting:
            return None
        slots = max(stats.capacity, 1)
        text = (f"Avg prompt throughput: {d.prompt_tokens / dt:.1f} tokens/s, "
                f"Avg generation throughput: {d.generated / dt:.1f} tokens/s, "
                f"Running: {stats.running} reqs, Waiting: {stats.waiting} reqs, "
                f"KV cache usage: {100 * stats.used / slots:.1f}% (reserved "
                f"{100 * stats.reserved / slots:.1f}%, predicted demand "
                f"{100 * stats.demand / slots:.1f}%)")
        if prefix_cache:
            hit = stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0
            text += f", Prefix cache hit rate: {100 * hit:.1f}%"
        if d.steps:
            text += (f"; steps: {d.steps / dt:.1f}/s, {d.decode_rows / d.steps:.1f} decode rows "
                     f"and {d.prompt_tokens / d.steps:.1f} prompt tokens a step, "
                     f"launch {100 * d.launch_s / dt:.0f}% and wait "
                     f"{100 * d.wait_s / dt:.0f}% of the time")
        return text
