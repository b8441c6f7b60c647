"""The sampling arguments of one step, per row, as the sampling kernel takes them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import sample, to_device
from services.compute.core.sequence import Sequence


@dataclass(frozen=True)
class SamplingBatch:
    """Row i samples for seqs[i]. Tensors are [S] on the device; the flags are host-side
    knowledge that lets the kernel skip work (they never change the result)."""

    temperature: torch.Tensor  # float32, 0: greedy
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, <= 0: off
    seeds: torch.Tensor  # int64
    steps: torch.Tensor  # int64, tokens generated so far: where in its noise stream a row is
    all_greedy: bool
    need_sort: bool  # some sampled row uses top-k or top-p
    need_logprobs: bool

    @classmethod
    def of(cls, seqs: list[Sequence], device: torch.device) -> SamplingBatch:
        """Two host->device copies, whatever the batch size."""
        ps = [s.params for s in seqs]
        floats = torch.tensor([[p.temperature for p in ps], [p.top_p for p in ps],
                               [p.min_p for p in ps]], dtype=torch.float32)
        ints = torch.tensor([[p.top_k for p in ps], [s.seed for s in seqs],
                             [s.num_output for s in seqs]], dtype=torch.int64)
        floats, ints = to_device(floats, device), to_device(ints, device)
        return cls(
            temperature=floats[0], top_p=floats[1], min_p=floats[2],
            top_k=ints[0], seeds=ints[1], steps=ints[2],
            all_greedy=all(p.temperature == 0 for p in ps),
            need_sort=any(p.top_k > 0 or p.top_p < 1 for p in ps if p.temperature > 0),
            need_logprobs=any(p.logprobs or p.top_logprobs for p in ps),
        )

    def sample(self, logits: torch.Tensor, raw_logits: torch.Tensor | None = None):
        """(token ids [S], logprobs [S]) from `logits` [S, vocab]; logprobs from `raw_logits`
        when given (the model's own distribution, before penalties). No host sync."""
        return sample(logits, self.temperature, self.top_k, self.top_p, self.min_p, self.seeds,
                      self.steps, all_greedy=self.all_greedy, need_sort=self.need_sort,
                      raw_logits=raw_logits, need_logprobs=self.need_logprobs)
