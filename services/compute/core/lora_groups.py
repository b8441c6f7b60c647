"""A step's rows grouped by LoRA adapter (built with its ForwardBatch by
services/compute/batch.py), in the layout kernels/lora.py's lora_delta_ takes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraGroups:
    """Group g is rows[starts[g]:starts[g + 1]] (int64 on the device; base rows are in none),
    its adapter the one at slots[g] of every LoraLinear's stacks (the model's `lora_slots`);
    `max_rows` is the largest group, `active` the slots present. Never empty (a step without
    adapter rows has no LoraGroups)."""

    rows: torch.Tensor
    starts: torch.Tensor
    slots: torch.Tensor
    max_rows: int
    active: frozenset[int]

    @classmethod
    def of(cls, names: list[str], slot_of: Mapping[str, int], device: torch.device,
           ) -> LoraGroups | None:
        """The groups of a step whose row i belongs to adapter names[i] ("" for the base), each
        adapter's slot `slot_of[name]`; None where every row is a base row. One copy to the
        device."""
        by_name: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            if name:
                by_name.setdefault(name, []).append(i)
        if not by_name:
            return None
        rows, starts, slots = [], [0], []
        for name, group in by_name.items():
            rows += group
            starts.append(len(rows))
            slots.append(slot_of[name])
        n, G = len(rows), len(slots)
        data = torch.tensor(rows + starts + slots, dtype=torch.int64).to(device)
        return cls(data[:n], data[n : n + G + 1], data[n + G + 1 :],
                   max(len(g) for g in by_name.values()), frozenset(slots))
