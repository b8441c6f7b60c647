"""The engine's hook for hidden-state length prediction (`--hidden-length`).

The runner hands out, with every sampled token, the probe-projected hidden state of the row
that sampled it (`StepSample.probes`). At a checkpoint (generated == 0: the last prompt token,
right after prefill; then every `--length-refine-every` generated tokens) the refiner
- replaces the request's `predicted_length` by the head's prediction (once the head has learned
  from `min_requests` finished requests; until then the text predictor's prior stays), so the
  scheduler's growth, future-peak admission and victim choice use the newest one;
- keeps the checkpoint's features, and when the request finishes ("stop" or "length": an
  aborted request's length is unknown) adds one row per checkpoint, its target the remaining
  length then, to a local delta of the head's statistics.
`tick` (once per engine step) pushes the delta to the store every `push_s` seconds and reloads
and re-solves the head every `refresh_s` seconds when the store has news. A store error costs
that update (logged), never a request.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from services.compute.length.head import HeadStats, LengthHead, features, targets
from services.compute.scheduling.sequence import Sequence

log = logging.getLogger(__name__)
LEARNED = ("stop", "length")


@dataclass(frozen=True)
class RefinerConfig:
    every: int = 32  # checkpoints at generated = 0, every, 2 x every, ... (0: only at 0)
    min_requests: int = 16  # the head predicts once it has learned this many requests
    l2: float = 0.1  # ridge penalty on standardized features (bench/length_predictor.py)
    push_s: float = 1.0
    refresh_s: float = 2.0


class LengthRefiner:
    def __init__(self, store, config: RefinerConfig = RefinerConfig(),
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.config, self.clock = store, config, clock
        self.head: LengthHead | None = None
        self.checkpoints: dict[str, list[tuple[int, np.ndarray]]] = {}
        self.pending: HeadStats | None = None
        self.seen_requests = -1  # the store's request count when the head was solved
        self.pushed = self.refreshed = -math.inf
        self.predictions = self.learned = 0

    def is_checkpoint(self, generated: int) -> bool:
        every = self.config.every
        return generated == 0 or (every > 0 and generated % every == 0)

    def observe(self, seq: Sequence, generated: int, probe: np.ndarray) -> None:
        """A checkpoint of `seq` with `generated` output tokens before it; probe [r]."""
        x = features(probe, seq.num_prompt, seq.params.max_tokens, generated)
        self.checkpoints.setdefault(seq.request_id, []).append((generated, x))
        if self.head is not None:
            seq.predicted_length = self.head.predict(x, generated, seq.max_len - seq.num_prompt)
            seq.peak_total = 0  # admission's cached bound came from the old prediction
            self.predictions += 1

    def finished(self, seq: Sequence) -> None:
        """`seq` is done: learn from its checkpoints if its length is known."""
        points = self.checkpoints.pop(seq.request_id, None)
        if not points or seq.finish_reason not in LEARNED:
            return
        x = np.stack([p for _, p in points])
        y = np.stack([targets(seq.num_output - g) for g, _ in points])
        if self.pending is None:
            self.pending = HeadStats.zeros(x.shape[1])
        self.pending.add(x, y)
        self.learned += 1

    def forget(self, request_id: str) -> None:
        self.checkpoints.pop(request_id, None)

    def tick(self) -> None:
        """Push what was learned, refresh the head: each at most every push_s / refresh_s."""
        now = self.clock()
        if self.pending is not None and now - self.pushed >= self.config.push_s:
            self.pushed = now
            delta, self.pending = self.pending, None
            self._guard("push", self.store.add, delta)
        if now - self.refreshed >= self.config.refresh_s:
            self.refreshed = now
            stats = self._guard("load", self.store.load)
            if stats is not None and stats.requests != self.seen_requests and \
                    stats.requests >= self.config.min_requests:
                self.seen_requests = stats.requests
                self.head = stats.solve(self.config.l2)

    def _guard(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a store failure never fails a request
            log.warning("hidden-state length head: %s failed (%s)", what, e)
            return None
