"""Pooling the hidden states of whole prompts into one vector each (or, "all", every row kept:
a reward model's per-token outputs), then Matryoshka truncation and L2 normalization. Pure
tensor math: rows of prompt i are hidden[cu[i]:cu[i+1]], every prompt has at least one row."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, lens: list[int], mode: str) -> torch.Tensor:
    """[N, H] float32 from `hidden` [sum(lens), H]: each prompt's last row ("last"), the mean of
    its rows ("mean") or its first row ("cls"); "all": every row, [sum(lens), H]."""
    if not lens or min(lens) < 1:
        raise ValueError("every pooled prompt needs at least one token")
    if mode == "all":
        return hidden.float()
    keep = pooled_rows(lens, mode)
    if keep is not None:
        return hidden[keep.to(hidden.device)].float()
    counts = torch.tensor(lens, device=hidden.device)
    if mode == "mean":
        owner = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), counts)
        sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, owner, hidden.float())
        return sums / counts.unsqueeze(1).float()
    raise ValueError(f"unknown pooling mode {mode!r}")


def pooled_rows(lens: list[int], mode: str) -> torch.Tensor | None:
    """The rows `pool` keeps alone, as indices into [sum(lens)] ("last": each prompt's last,
    "cls": its first), or None where it reads every row ("mean", "all")."""
    ends = torch.cumsum(torch.tensor(lens), 0)
    if mode == "last":
        return ends - 1
    if mode == "cls":
        return ends - torch.tensor(lens)
    return None


def finish(vectors: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """`vectors` [N, H] truncated to their first `dimensions` columns (None: all), then
    L2-normalized when `normalize` (Matryoshka: truncate first, so each row stays unit)."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    return F.normalize(vectors, p=2, dim=1) if normalize else vectors
