"""The layers whose result is whole only across the tensor-parallel group (torch.distributed's
default group, which every rank joins in `group.py`): each one's collective runs on every rank,
in the same order, for every step (the step's shapes are the same everywhere: `step.py`).

- `RowParallel`: o and down, whose input is this rank's slice of the features; the partial
  products are summed (one all-reduce) into the whole output on every rank.
- `VocabEmbedding`: the rank's vocabulary rows; a token outside them looks up zeros, and the
  all-reduce sums each token's one non-zero row (exact: the other terms are zeros).
- `GatheredHead`: the rank's vocabulary rows of the LM head; the logits are gathered on rank 0,
  which samples (the other ranks' results are their own slice, and unused).
- `vocab_rows`: rows of the whole embedding or LM head from the ranks' parts (a yes/no
  reranker's score rows, once at load).
- `ParallelQKNorm`: OLMoE's q/k RMSNorm over the whole projection, on the rank's heads: the
  sums of squares of q's and k's columns all-reduced, so each rank divides by the RMS of all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipellm.services.compute.model.arch import FullQKNorm


class RowParallel:
    """A linear layer over this rank's input features, its output all-reduced: called and
    sized as the layer it wraps (x [T, in / n] -> [T, out], whole on every rank)."""

    def __init__(self, linear):
        self.linear = linear

    def __call__(self, x) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out)
        return out

    def nbytes(self) -> int:
        return self.linear.nbytes()


class VocabEmbedding:
    """ids [T] -> [T, hidden] rows of a vocabulary split across ranks; `weight`: this rank's
    rows [V', hidden] (ids [start, start + V'))."""

    def __init__(self, weight: torch.Tensor, start: int):
        self.weight, self.start = weight, start

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        h = F.embedding(torch.where(mine, local, 0), self.weight)
        h.masked_fill_(~mine.unsqueeze(-1), 0)
        dist.all_reduce(h)
        return h


class GatheredHead:
    """The LM head over this rank's vocabulary rows (`head`: a linear layer [V', hidden]):
    x [S, hidden] -> on rank 0 the whole logits [S, vocab] (the ranks' slices in rank order,
    padding dropped); on the others their own slice [S, V']."""

    def __init__(self, head, vocab: int):
        self.head, self.vocab = head, vocab
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        local = self.head(x)
        if x.shape[0] == 0:  # no row to score: the same on every rank (one broadcast batch)
            return local.new_zeros(0, self.vocab) if self.rank == 0 else local
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1)[:, : self.vocab] if self.rank == 0 else local

    def nbytes(self) -> int:
        return self.head.nbytes()


def vocab_rows(part: torch.Tensor, start: int, vocab: int, ids: list[int]) -> torch.Tensor:
    """Rows `ids` [len(ids), hidden] of a vocabulary matrix of `vocab` rows split across the
    ranks (`part`: this rank's rows from `start`): each rank's own, zeros for the others',
    summed (exact). ValueError, on every rank alike, for an id outside the vocabulary."""
    if max(ids) >= vocab:
        raise ValueError(f"classifier_from_token ids {ids} outside the LM head's {vocab} rows")
    rows = part.new_zeros(len(ids), part.shape[1])
    for i, t in enumerate(ids):
        if start <= t < start + part.shape[0]:
            rows[i] = part[t - start]
    dist.all_reduce(rows)
    return rows


class ParallelQKNorm:
    """`FullQKNorm` (OLMoE) over this rank's q/k/v rows (`norm`: built on the rank's config
    and its slices of the q/k norm weights), the RMS taken over the whole q and k of all
    `size` ranks: x [T, hidden] -> [T, (H + 2 Hkv) D / size], as the wrapped layer's on one
    rank but for float rounding. One [T, 2] all-reduce per layer."""

    def __init__(self, norm: FullQKNorm, size: int):
        self.norm, self.size = norm, size

    def __call__(self, x) -> torch.Tensor:
        n = self.norm
        out = n.qkv(x)  # [T, (H + 2 Hkv) D / size]
        q, k = out[:, :n.q_cols], out[:, n.q_cols:n.q_cols + n.k_cols]
        squares = torch.stack([q.float().square().sum(-1), k.float().square().sum(-1)], dim=-1)
        dist.all_reduce(squares)  # [T, 2] over every rank's columns
        widths = torch.tensor([n.q_cols, n.k_cols], dtype=torch.float32) * self.size
        inv = torch.rsqrt(squares / widths + n.eps)  # [T, 2]
        for part, weight, i in ((q, n.q_norm, 0), (k, n.k_norm, 1)):
            part.copy_(weight * (part.float() * inv[:, i:i + 1]).to(out.dtype))
        return out if n.clip is None else out.clamp_(-n.clip, n.clip)

    def nbytes(self) -> int:
        return self.norm.nbytes()
