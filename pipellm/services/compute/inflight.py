"""A launched step's results: on the device while the step runs, on the host after `result()`.

On a GPU, `launch` queues the forward and the sampling and returns at once; the results are
copied into pinned host memory behind them (non-blocking) and `result()` waits for that copy,
the one point per step where the host waits for the device. The next step may be scheduled and
launched before: its inputs read the sampled ids where they are (`tokens`, on the device).
On a CPU everything has run by the time `launch` returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipellm.services.compute.core.sequence import Sequence
from pipellm.services.compute.core.step import ScheduledStep, StepSample, Work
from pipellm.shared.codec import float32s, int32s
from pipellm.shared.messages import Tokens


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy on the host, without waiting for it on a GPU (pinned memory)."""
    return t.to("cpu", non_blocking=True) if t.is_cuda else t


@dataclass
class TopRows:
    """The k most likely tokens of some rows: row rows[j] keeps ks[j] of ids/values[j]."""

    rows: list[int]
    ks: list[int]
    ids: torch.Tensor  # [len(rows), max k] int64, host
    values: torch.Tensor  # [len(rows), max k] float32, host


@dataclass
class PromptRows:
    """Scored prompt tokens, span by span (ForwardBatch.prompt_spans): chosen [R] logprobs
    of the prompt tokens and ranks [R] their ranks (1: the most likely), ids/values [R, max k]
    their rows' k most likely tokens (host)."""

    spans: list[tuple[Sequence, int, int]]
    chosen: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor
    ranks: torch.Tensor


@dataclass
class InFlight:
    step: ScheduledStep
    tokens: torch.Tensor | None = None  # [S] int64 on the device, S = len(step.sampled)
    host_tokens: torch.Tensor | None = None  # their copy on the host
    logprobs: torch.Tensor | None = None  # [S] float32, host
    top: TopRows | None = None
    prompt: PromptRows | None = None
    probes: torch.Tensor | None = None  # [C, r] float32: the length heads' probes
    probe_rows: list[int] | None = None  # [C]: their rows in step.sampled
    drafts: torch.Tensor | None = None  # [sum of k] int64: the draft model's tokens, verify
    # by verify (pipellm/services/compute/drafter.py)
    ready: torch.cuda.Event | None = None  # recorded after the host copies were queued

    def seal(self) -> InFlight:
        """Queue the host copies and mark their end (call once every result is launched)."""
        if self.tokens is not None:
            self.host_tokens, self.logprobs = to_host(self.tokens), to_host(self.logprobs)
        if self.probes is not None:
            self.probes = to_host(self.probes)
        if self.drafts is not None:
            self.drafts = to_host(self.drafts)
        if self.tokens is not None and self.tokens.is_cuda:
            self.ready = torch.cuda.Event()
            self.ready.record()
        return self

    def result(self) -> StepSample:
        """The step's results on the host, as records (waits for the device)."""
        if self.ready is not None:
            self.ready.synchronize()
        out = StepSample()
        if self.host_tokens is not None:
            out = StepSample.of(self.step, self.host_tokens.tolist(), self.logprobs.tolist())
            _add_top_rows(out.outputs, self.top)
        if self.prompt is not None:
            out.prompt = _prompt_records(self.prompt)
        if self.probes is not None:
            out.probes, out.probe_rows = self.probes.numpy(), self.probe_rows
        if self.drafts is not None:
            flat, out.drafts = self.drafts.tolist(), []
            for item in self.step.of(Work.VERIFY):
                out.drafts.append(flat[: len(item.drafts)])
                del flat[: len(item.drafts)]
        return out


def _add_top_rows(records: list[Tokens], top: TopRows | None) -> None:
    """Give the records of the rows that asked for top logprobs their k alternatives."""
    if top is None:
        return
    ids, values = top.ids.tolist(), top.values.tolist()
    for j, (row, k) in enumerate(zip(top.rows, top.ks, strict=True)):
        records[row].top_ids, records[row].top_logprobs = int32s(ids[j][:k]), \
            float32s(values[j][:k])


def _prompt_records(p: PromptRows) -> list[Tokens]:
    """One record per span: the scored prompt tokens from its first scored position, their
    logprobs and their rows' top k."""
    chosen, ids, values = p.chosen.tolist(), p.ids.tolist(), p.values.tolist()
    ranks = p.ranks.tolist()
    out, row = [], 0
    for seq, start, n in p.spans:
        k = seq.params.prompt_logprobs
        out.append(Tokens(seq.request_id, start, int32s(seq.token_ids[start : start + n]),
                          float32s(chosen[row : row + n]),
                          int32s(i for r in range(row, row + n) for i in ids[r][:k]),
                          float32s(v for r in range(row, row + n) for v in values[r][:k]),
                          ranks=int32s(ranks[row : row + n])))
        row += n
    return out


class Done:
    """A step whose results are on the host already (the simulator's)."""

    def __init__(self, sample: StepSample):
        self.sample = sample

    def result(self) -> StepSample:
        return self.sample
