"""What one step runs (`ScheduledStep`: one `WorkItem` per sequence, the scheduler's output) and
what it produced (`StepSample`, on the host: what the scheduler commits)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from typing import Any

from pipellm.services.compute.core.sequence import Sequence
from pipellm.shared.codec import float32s, int32s
from pipellm.shared.messages import Tokens


class Work(IntEnum):
    """What a work item runs. Their order is the step's row order: the decode rows first (one
    KV position each, as CUDA graphs capture), the prefill chunks last."""

    DECODE = 0  # its pending token
    VERIFY = 1  # its pending token and k drafts (pipellm/services/compute/speculative/)
    BEAM = 2  # each running beam's last token, in its lane (pipellm/services/compute/beam/)
    PREFILL = 3  # a chunk of its pending tokens


@dataclass(eq=False, slots=True)
class WorkItem:
    """One sequence's share of a step: `tokens` rows of the forward, the last `samples` of
    which sample a token. A verify's row j samples output token num_output + j; a beam
    search's rows (one per running beam) sample one position together."""

    seq: Sequence
    kind: Work
    tokens: int
    samples: int
    drafts: list[int] | tuple = ()  # VERIFY: d1..dk
    token_index: int = -1  # its first sampled token's index in seq.token_ids (set by
    # Scheduler.advance; -1: nothing to sample, the sequence finished since it was scheduled)

    @classmethod
    def decode(cls, seq: Sequence, drafts: list[int] | None = None) -> WorkItem:
        if drafts:
            k = 1 + len(drafts)
            return cls(seq, Work.VERIFY, k, k, drafts)
        return cls(seq, Work.DECODE, 1, 1)

    @classmethod
    def beam(cls, seq: Sequence) -> WorkItem:
        n = len(seq.beams.running)
        return cls(seq, Work.BEAM, n, n)

    @classmethod
    def prefill(cls, seq: Sequence, n: int) -> WorkItem:
        """A chunk of n pending tokens; it samples where it ends them."""
        return cls(seq, Work.PREFILL, n, int(n == seq.pending))

    @property
    def cached(self) -> int:
        """KV positions it adds to the sequence (a beam search's: one, in every lane)."""
        return 1 if self.kind is Work.BEAM else self.tokens

    def decode_rows(self) -> list[tuple[int, int, int]]:
        """(KV start, token, position) of each row of a decode-kind item, attending to the
        slots [start, start + position]."""
        seq, c = self.seq, self.seq.num_cached
        if self.kind is Work.DECODE:
            return [(seq.kv_start, seq.token_ids[c], c)]
        if self.kind is Work.BEAM:
            return [(seq.kv_start + b.lane * seq.max_len, b.tokens[-1], c)
                    for b in seq.beams.running]
        return [(seq.kv_start, t, c + j) for j, t in enumerate([seq.token_ids[c], *self.drafts])]


@dataclass
class ScheduledStep:
    """What one forward runs. `items`: one per sequence, ordered by kind (Work), final once
    the scheduler returns the step (its row views are computed once). Moves (src, dst, n) are
    KV copies to apply, in order, before it."""

    items: list[WorkItem] = field(default_factory=list)
    moves: list[tuple[int, int, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # taken from the queue this step

    def of(self, kind: Work) -> list[WorkItem]:
        return [item for item in self.items if item.kind is kind]

    @cached_property
    def rows(self) -> list[tuple[WorkItem, int]]:
        """The sampled rows, in logits order: (item, the row's place among its samples)."""
        return [(item, j) for item in self.items for j in range(item.samples)]

    @cached_property
    def sampled(self) -> list[Sequence]:
        """The sequence of each sampled row (a verify's or beam search's repeated)."""
        return [item.seq for item in self.items for _ in range(item.samples)]

    @cached_property
    def offsets(self) -> list[int]:
        """Each sampled row's offset in its sequence's output: j of a verify's row j, else 0."""
        return [j if item.kind is Work.VERIFY else 0 for item, j in self.rows]

    @property
    def num_tokens(self) -> int:
        return sum(item.tokens for item in self.items)


@dataclass
class StepSample:
    """What a step produced, on the host, as the records its tokens travel in to the gateway
    (pipellm.shared.messages.Tokens). outputs[i] is step.sampled[i]'s new token: the runner fills in
    the token, its logprob and the top rows the request asked for; the scheduler's commit fills
    in its place (`start`) and `finish_reason`. prompt: the scored prompt pieces, one record per
    ForwardBatch.prompt_spans span."""

    outputs: list[Tokens] = field(default_factory=list)
    prompt: list[Tokens] = field(default_factory=list)
    probes: Any = None  # numpy [C, r]: the length heads' probes at checkpoint rows, or None
    probe_rows: list[int] | None = None  # [C]: their rows in the step's sampled
    drafts: list[list[int]] | None = None  # the draft model's tokens of each verify (in
    # step order), where its drafts were DRAFTED placeholders

    @classmethod
    def of(cls, step: ScheduledStep, tokens: list[int],
           logprobs: list[float] | None = None) -> StepSample:
        """Records of `tokens` [S] for step.sampled's rows (logprobs 0 unless given)."""
        logprobs = logprobs if logprobs is not None else [0.0] * len(tokens)
        return cls([Tokens(seq.request_id, -1, int32s([t]), float32s([lp]))
                    for seq, t, lp in zip(step.sampled, tokens, logprobs, strict=True)])
