"""The engine's hook for hidden-state length prediction (`--hidden-length`).

The runner hands out, with every sampled token, the probe-projected hidden state of the row
that sampled it (`StepSample.probes`); the engine hands over a step's checkpoints in one call,
so each head predicts them all in one matrix product. At a checkpoint (generated == 0: the
last prompt token, right after prefill; then every `--length-refine-every` generated tokens)
the refiner
- replaces the request's `predicted_length` by the prediction of the checkpoint's stage's head
  (once that head has learned from `min_requests` finished requests; until then the previous
  prediction stays: the text predictor's prior after prefill), so the scheduler's growth,
  future-peak admission and victim choice use the newest one;
- keeps the checkpoint's features, and when the request finishes ("stop" or "length": an
  aborted request's length is unknown) adds one row per checkpoint, its target the remaining
  length then, to a local delta of the statistics of each head that learns from it
  (`learns_from`).
`tick` (once per engine step) pushes the deltas to their stores every `push_s` seconds and
reloads and re-solves each head every `refresh_s` seconds when its store has news. A store
error costs that update (logged), never a request.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from services.compute.length.head import (
    STAGES,
    HeadStats,
    LengthHead,
    features,
    learns_from,
    stage_of,
    targets,
)
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
    def __init__(self, stores: dict, config: RefinerConfig = RefinerConfig(),
                 clock: Callable[[], float] = time.monotonic):
        """`stores`: stage -> where that head's statistics live (store.py), for every stage."""
        self.stores, self.config, self.clock = stores, config, clock
        self.heads: dict[str, LengthHead] = {}
        self.checkpoints: dict[str, list[tuple[int, np.ndarray]]] = {}
        self.pending: dict[str, HeadStats] = {}
        self.seen_requests = dict.fromkeys(STAGES, -1)  # store's count when the head was solved
        self.pushed = self.refreshed = -math.inf
        self.predictions = self.learned = 0

    def is_checkpoint(self, generated: int) -> bool:
        every = self.config.every
        return generated == 0 or (every > 0 and generated % every == 0)

    def observe(self, checkpoints: list[tuple[Sequence, int, np.ndarray]]) -> None:
        """A step's checkpoints: (seq, output tokens generated before it, probe [r]) each."""
        if not checkpoints:
            return
        seqs, generated, probes = zip(*checkpoints, strict=True)
        x = features(np.stack(probes), [s.num_prompt for s in seqs],
                     [s.params.max_tokens for s in seqs], generated)  # [n, d]
        for seq, g, row in zip(seqs, generated, x, strict=True):
            self.checkpoints.setdefault(seq.request_id, []).append((g, row))
        for stage in STAGES:
            head = self.heads.get(stage)
            rows = [i for i, g in enumerate(generated) if stage_of(g) == stage]
            if head is None or not rows:
                continue
            dists = head.predict_rows(x[rows], [generated[i] for i in rows],
                                      [seqs[i].max_len - seqs[i].num_prompt for i in rows])
            for i, dist in zip(rows, dists, strict=True):
                seqs[i].predicted_length = dist
                seqs[i].peak_total = 0  # admission's cached bound came from the old prediction
            self.predictions += len(rows)

    def finished(self, seq: Sequence) -> None:
        """`seq` is done: learn from its checkpoints if its length is known."""
        points = self.checkpoints.pop(seq.request_id, None)
        if not points or seq.finish_reason not in LEARNED:
            return
        for stage in STAGES:
            rows = [(g, f) for g, f in points if learns_from(stage, g)]
            if rows:
                x = np.stack([f for _, f in rows])
                y = np.stack([targets(seq.num_output - g) for g, _ in rows])
                self.pending.setdefault(stage, HeadStats.zeros(x.shape[1])).add(x, y)
        self.learned += 1

    def forget(self, request_id: str) -> None:
        self.checkpoints.pop(request_id, None)

    def tick(self) -> None:
        """Push what was learned, refresh the head: each at most every push_s / refresh_s."""
        now = self.clock()
        if self.pending and now - self.pushed >= self.config.push_s:
            self.pushed = now
            deltas, self.pending = self.pending, {}
            for stage, delta in deltas.items():
                self._guard("push", self.stores[stage].add, delta)
        if now - self.refreshed >= self.config.refresh_s:
            self.refreshed = now
            for stage in STAGES:
                stats = self._guard("load", self.stores[stage].load)
                if stats is not None and stats.requests != self.seen_requests[stage] and \
                        stats.requests >= self.config.min_requests:
                    self.seen_requests[stage] = stats.requests
                    self.heads[stage] = stats.solve(self.config.l2)

    def _guard(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a store failure never fails a request
            log.warning("hidden-state length head: %s failed (%s)", what, e)
            return None
