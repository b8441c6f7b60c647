"""What one step runs (`ScheduledStep`, the scheduler's output) and what it produced
(`StepSample`, on the host: what the scheduler commits)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.compute.core.sequence import Sequence


@dataclass
class ScheduledStep:
    """What one forward runs. Moves (src, dst, n) are KV copies to apply, in order, before it."""

    decodes: list[Sequence] = field(default_factory=list)  # one token each
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, chunk length)
    moves: list[tuple[int, int, int]] = field(default_factory=list)
    # sequences whose next token this step samples: all decodes, then chunks ending their prompt
    sampled: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # taken from the queue this step
    # where each sampled token goes in its seq.token_ids (set by Scheduler.advance)
    token_index: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)


Top = tuple[list[int], list[float]]  # the k most likely tokens at a position, and their logprobs


@dataclass
class StepSample:
    """What a step produced, on the host. tokens/logprobs/top follow step.sampled; top[i] is
    None unless that request asked for top logprobs. prompt: per batch.prompt_spans span, its
    first scored prompt position, the scored tokens' logprobs and their top k."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[Top | None] = field(default_factory=list)
    prompt: list[tuple[Sequence, int, list[float], list[Top]]] = field(default_factory=list)
    probes: Any = None  # numpy [C, r]: the length heads' probes at checkpoint rows, or None
    probe_rows: list[int] | None = None  # [C]: their rows in the step's sampled

    def tops(self) -> list[Top | None]:
        """`top` aligned with `tokens` (a runner that computes none leaves `top` empty)."""
        return self.top or [None] * len(self.tokens)


@dataclass
class Committed:
    """The part of a StepSample the scheduler applied: requests that finished or were aborted
    while the step was in flight are left out. `sampled`: (request, its token, the token's top
    logprobs) per request that got one; `prompt` is StepSample.prompt's."""

    sampled: list[tuple[Sequence, int, Top | None]] = field(default_factory=list)
    prompt: list[tuple[Sequence, int, list[float], list[Top]]] = field(default_factory=list)
