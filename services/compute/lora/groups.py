"""A step's rows grouped by adapter (built with its ForwardBatch by services/compute/batch.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraGroup:
    """The rows of one adapter in the step's flat batch: `rows` [n] int64 on the device, in
    increasing order; `span` (lo, hi) where they are exactly rows lo .. hi - 1 (then the
    delta is added to a slice, no gather or scatter)."""

    name: str
    rows: torch.Tensor
    span: tuple[int, int] | None


@dataclass(frozen=True)
class LoraGroups:
    """One group per adapter present in the step; base rows are in none. Never empty (a step
    without adapter rows has no LoraGroups)."""

    groups: tuple[LoraGroup, ...]

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
        groups = []
        for name, rows in by_name.items():
            span = (rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows) else None
            groups.append(LoraGroup(name, torch.tensor(rows, dtype=torch.int64).to(device),
                                    span))
        return cls(tuple(groups))
