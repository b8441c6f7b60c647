"""What one step runs (`ScheduledStep`, the scheduler's output) and what it produced
(`StepSample`, on the host: what the scheduler commits)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.compute.core.sequence import Sequence
from shared.codec import float32s, int32s
from shared.messages import Tokens


@dataclass
class ScheduledStep:
    """What one forward runs. Moves (src, dst, n) are KV copies to apply, in order, before it."""

    decodes: list[Sequence] = field(default_factory=list)  # one token each
    # speculative decodes (services/compute/speculative/): (seq, its drafts d1..dk), k + 1
    # decode rows: its pending token and the k drafts
    verifies: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    # beam searches (services/compute/beam/): a decode row per running beam, each in its lane
    beams: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, chunk length)
    moves: list[tuple[int, int, int]] = field(default_factory=list)
    # one per logits row the step samples: all decodes, each verify's k + 1 rows (the seq
    # repeated), each beam search's rows (likewise), then chunks ending their prompt
    sampled: list[Sequence] = field(default_factory=list)
    # parallel to sampled: the row's place among its sequence's rows (j of a verify's k + 1;
    # 0 for the others): it samples the output token num_output + j
    offsets: list[int] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # taken from the queue this step
    # where each sampled token goes in its seq.token_ids (set by Scheduler.advance)
    token_index: list[int] = field(default_factory=list)

    @property
    def row_offsets(self) -> list[int]:
        """`offsets`, or all 0 for a step built without them (no speculative verifies)."""
        return self.offsets or [0] * len(self.sampled)

    @property
    def num_tokens(self) -> int:
        return (len(self.decodes) + sum(1 + len(d) for _, d in self.verifies)
                + sum(len(s.beams.running) for s in self.beams)
                + sum(n for _, n in self.prefills))


@dataclass
class StepSample:
    """What a step produced, on the host, as the records its tokens travel in to the gateway
    (shared.messages.Tokens). outputs[i] is step.sampled[i]'s new token: the runner fills in
    the token, its logprob and the top rows the request asked for; the scheduler's commit fills
    in its place (`start`) and `finish_reason`. prompt: the scored prompt pieces, one record per
    ForwardBatch.prompt_spans span."""

    outputs: list[Tokens] = field(default_factory=list)
    prompt: list[Tokens] = field(default_factory=list)
    probes: Any = None  # numpy [C, r]: the length heads' probes at checkpoint rows, or None
    probe_rows: list[int] | None = None  # [C]: their rows in the step's sampled
    drafts: list[list[int]] | None = None  # the draft model's tokens of each verify (in
    # ScheduledStep.verifies order), where its drafts were DRAFTED placeholders

    @classmethod
    def of(cls, step: ScheduledStep, tokens: list[int],
           logprobs: list[float] | None = None) -> StepSample:
        """Records of `tokens` [S] for step.sampled's rows (logprobs 0 unless given)."""
        logprobs = logprobs if logprobs is not None else [0.0] * len(tokens)
        return cls([Tokens(seq.request_id, -1, int32s([t]), float32s([lp]))
                    for seq, t, lp in zip(step.sampled, tokens, logprobs, strict=True)])
