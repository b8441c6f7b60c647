"""A step's rows grouped by LoRA adapter (built with its ForwardBatch by
pipellm/services/compute/batch.py): long runs of one adapter's rows (prefill chunks) as slices for
the device's GEMMs, the rest in the layout pipellm/kernels/lora.py's lora_delta_ takes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

DENSE_ROWS = 256  # a run of this many rows of one adapter goes to GEMMs on its slice


@dataclass(frozen=True)
class LoraGroups:
    """`dense`: (slot, lo, hi) where rows lo .. hi - 1 are one run of the adapter in `slot`
    (of every LoraLinear's stacks: the model's `lora_slots`), at least DENSE_ROWS long. The
    other adapter rows, by adapter: group g is rows[starts[g]:starts[g + 1]] (int64 on the
    device) of slots[g]; `max_rows` the largest group; rows, starts and slots None where there
    are none. `active`: the slots present. Base rows are in neither; never empty (a step
    without adapter rows has no LoraGroups)."""

    dense: tuple[tuple[int, int, int], ...]
    rows: torch.Tensor | None
    starts: torch.Tensor | None
    slots: torch.Tensor | None
    max_rows: int
    active: frozenset[int]

    @classmethod
    def of(cls, names: list[str], slot_of: Mapping[str, int],
           upload: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> LoraGroups | None:
        """The groups of a step whose row i belongs to adapter names[i] ("" for the base), each
        adapter's slot `slot_of[name]`; None where every row is a base row. One copy to the
        device: `upload` (host int64 -> device, without waiting for the device; the batch's
        `pipellm.kernels.to_device`)."""
        dense, by_name, i = [], {}, 0
        while i < len(names):  # runs of one name
            j = i
            while j < len(names) and names[j] == names[i]:
                j += 1
            if names[i] and j - i >= DENSE_ROWS:
                dense.append((slot_of[names[i]], i, j))
            elif names[i]:
                by_name.setdefault(names[i], []).extend(range(i, j))
            i = j
        if not dense and not by_name:
            return None
        active = frozenset(s for s, _, _ in dense) | {slot_of[n] for n in by_name}
        if not by_name:
            return cls(tuple(dense), None, None, None, 0, active)
        rows, starts, slots = [], [0], []
        for name, group in by_name.items():
            rows += group
            starts.append(len(rows))
            slots.append(slot_of[name])
        n, G = len(rows), len(slots)
        data = upload(torch.tensor(rows + starts + slots, dtype=torch.int64))
        return cls(tuple(dense), data[:n], data[n : n + G + 1], data[n + G + 1 :],
                   max(len(g) for g in by_name.values()), active)
