"""What rank 0 broadcasts to the other tensor-parallel ranks each step, and how.

One message per step, `StepInputs`, sent with `torch.distributed.broadcast_object_list` (its
pickle of the dataclass: the batch's few int tensors and ints), before rank 0 runs the step's
forward; between steps, `AdapterChange` when a LoRA adapter is loaded or dropped at run time;
`None` tells the other ranks to stop. Invariant: every rank applies the same KV moves
and runs the forward on the same batch, so that the collectives inside it (`layers.py`) match
one to one and each rank's KV cache holds its heads of the same slots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipellm.services.compute.core.batch import ForwardBatch


@dataclass(frozen=True)
class StepInputs:
    """One step's inputs to the forward: the KV moves (src, dst, n) the allocator decided, in
    order, and the ForwardBatch rank 0 built (input ids resolved, LoRA groups by the slots
    every rank gave the same adapters; without the prompt spans, which only rank 0's sampling
    reads).
    `pooled`: a pooling forward (pooling/forward.hidden_states: the final-normed hidden states
    of `rows`, None: every row; no LM head), not a generation step."""

    moves: list[tuple[int, int, int]]
    batch: ForwardBatch
    pooled: bool = False
    rows: torch.Tensor | None = None

    @classmethod
    def of(cls, moves: list[tuple[int, int, int]], batch: ForwardBatch) -> StepInputs:
        return cls(list(moves), dataclasses.replace(batch, prompt_spans=[]))

    @classmethod
    def pooling(cls, moves: list[tuple[int, int, int]], batch: ForwardBatch,
                rows: torch.Tensor | None) -> StepInputs:
        return cls(list(moves), batch, True, rows)


@dataclass(frozen=True)
class AdapterChange:
    """A LoRA adapter every rank attaches (`module`, a pipellm.shared.lora.LoraModule, at most
    `max_rank`) or detaches (`name`), as rank 0 does, so that every rank's slots match."""

    module: object | None = None
    max_rank: int = 0
    name: str | None = None


def broadcast(inputs: StepInputs | None) -> StepInputs | None:
    """Rank 0: send `inputs` (None: stop) to the other ranks; they call it with None and get
    what rank 0 sent. Blocks until every rank has called it."""
    box = [inputs]
    dist.broadcast_object_list(box, src=0)
    return box[0]
