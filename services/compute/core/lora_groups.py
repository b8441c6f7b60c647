"""A step's rows grouped by adapter (built with its ForwardBatch by services/compute/batch.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraGroups:
    """The step's adapter rows, gathered adapter by adapter: `rows` [n] int64 on the device
    lists them (base rows are in none), group (name, lo, hi) being rows[lo:hi], increasing.
    `span` (start, end) where rows is exactly start .. end - 1 (the adapter rows are one run
    of the batch, groups in order): then a projection reads and adds to a slice, no gather or
    scatter. `inverse` [T] where every row of the batch is an adapter row: batch row i is
    rows[inverse[i]] (the deltas come back by a gather, not a scatter). Never empty (a step
    without adapter rows has no LoraGroups)."""

    rows: torch.Tensor
    groups: tuple[tuple[str, int, int], ...]
    span: tuple[int, int] | None
    inverse: torch.Tensor | None = None

    @classmethod
    def of(cls, names: list[str], device: torch.device) -> LoraGroups | None:
        """The groups of a step whose row i belongs to adapter names[i] ("" for the base);
        None where every row is a base row."""
        by_name: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            if name:
                by_name.setdefault(name, []).append(i)
        if not by_name:
            return None
        rows, groups = [], []
        for name, group in by_name.items():
            groups.append((name, len(rows), len(rows) + len(group)))
            rows += group
        span = (rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else None
        inverse = None
        if span is None and len(rows) == len(names):
            inverse = [0] * len(rows)
            for k, i in enumerate(rows):
                inverse[i] = k
        index = torch.tensor(rows + (inverse or []), dtype=torch.int64).to(device)
        return cls(index[: len(rows)], tuple(groups), span,
                   None if inverse is None else index[len(rows) :])
