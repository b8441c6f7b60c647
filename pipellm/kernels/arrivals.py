"""Arrival counters: how a split kernel merges its own splits in one launch. Each program of a
group counts its arrival after storing its partial result; the last to arrive merges the
group's partials and sets the counter back to 0. One zeroed buffer per device, kept between
launches: every launch leaves it zero, and the launches that share it (decode attention's, the
INT4 GEMV's) run one after another on one stream."""

from __future__ import annotations

import torch

SLOTS = 1 << 16  # the groups one launch can count
_buffers: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's zeroed counters for a launch of `needed` groups, or None: too many
    groups, or a first use while a CUDA graph is being captured (the buffer must outlive every
    graph: it is made outside them, by an eager call such as the warm-up)."""
    if needed > SLOTS:
        return None
    buf = _buffers.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _buffers[device] = torch.zeros(SLOTS, dtype=torch.int32, device=device)
    return buf
