"""The engine's hook for hidden-state length prediction (`--hidden-length`).

At every checkpoint a request's `predicted_length` becomes its stage's head's prediction (once
that head has learned from `min_requests` requests), and its probe is kept to be learned when it
finishes by "stop" or "length". `tick` syncs the statistics with the stores (with `background`,
in a worker thread). A push that fails is tried again at the next sync under the same id, so the
store counts it once (store.py); a store error delays an update, never fails a request.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from pipellm.services.compute.core.sequence import Sequence
from pipellm.services.compute.length.head import (
    STAGES,
    HeadStats,
    LengthHead,
    features,
    learns_from,
    stage_of,
    targets,
)

log = logging.getLogger(__name__)
LEARNED = ("stop", "length")
MAX_UNPUSHED = 64  # pushes kept for a retry while the store fails; beyond, the oldest are lost


@dataclass(frozen=True)
class RefinerConfig:
    min_requests: int = 16  # the head predicts once it has learned this many requests
    # ridge penalty on standardized features, per stage (prefill, refine): the head after
    # prefill has one row per request, the refining one many more, so it needs the heavier
    # penalty; on SmolLM2's lengths 1.0 there is the best trade-off (a heavier one helps the
    # head after prefill but costs the refined predictions: bench/length_predictor.py,
    # docs/benchmarks.md)
    l2: tuple[float, float] = (1.0, 0.1)
    push_s: float = 1.0
    refresh_s: float = 2.0
    background: bool = True  # sync in a worker thread, else inside tick (deterministic)


@dataclass(frozen=True)
class Finished:
    """A finished request to learn from: its probes [r] at (generated, probe) checkpoints."""

    prompt: int
    max_tokens: int
    output: int
    points: list[tuple[int, np.ndarray]]


@dataclass(frozen=True)
class Push:
    """One stage's statistics from a batch of finished requests, under the id the store
    dedupes retries by."""

    stage: str
    delta: HeadStats
    id: str


class LengthRefiner:
    def __init__(self, stores: dict, config: RefinerConfig = RefinerConfig(),
                 clock: Callable[[], float] = time.monotonic):
        """`stores`: stage -> where that head's statistics live (store.py), for every stage."""
        self.stores, self.config, self.clock = stores, config, clock
        self.heads: dict[str, LengthHead] = {}  # replaced whole by the worker
        self.checkpoints: dict[str, list[tuple[int, np.ndarray]]] = {}
        self.queue: list[Finished] = []
        self.unpushed: list[Push] = []  # the worker's: failed pushes, oldest first
        self.seen_requests = dict.fromkeys(STAGES, -1)  # store's count when the head was solved
        self.pushed = self.refreshed = -math.inf
        self.predictions = self.learned = 0
        self._worker: ThreadPoolExecutor | None = None
        self._job: Future | None = None
        # numpy's BLAS on one thread, for the whole process: the heads' products are small,
        # and its idle threads spin, taking cores from the model's (bench/length_step_cost.py,
        # docs/benchmarks.md); torch's own threads are not affected
        threadpool_limits(1, user_api="blas")

    def observe(self, checkpoints: list[tuple[Sequence, int, np.ndarray]]) -> None:
        """A step's checkpoints: (seq, output tokens generated before it, probe [r])."""
        if not checkpoints:
            return
        seqs, generated, probes = zip(*checkpoints, strict=True)
        heads, probes = self.heads, np.stack(probes)  # [n, r]: a copy, not the step's buffer
        for seq, g, probe in zip(seqs, generated, probes, strict=True):
            self.checkpoints.setdefault(seq.request_id, []).append((g, probe))
        for stage in STAGES:
            head = heads.get(stage)
            rows = [i for i, g in enumerate(generated) if stage_of(g) == stage]
            if head is None or not rows:
                continue
            x = features(probes[rows], [seqs[i].num_prompt for i in rows],
                         [seqs[i].params.max_tokens for i in rows],
                         [generated[i] for i in rows])  # [n, r + N_SCALARS]
            dists = head.predict_rows(x, [generated[i] for i in rows],
                                      [seqs[i].max_len - seqs[i].num_prompt for i in rows])
            for i, dist in zip(rows, dists, strict=True):
                seqs[i].predicted_length = dist
                seqs[i].peak_total = 0  # admission's cached bound came from the old prediction
            self.predictions += len(rows)

    def finished(self, seq: Sequence) -> None:
        """`seq` is done: queue its checkpoints to be learned if its length is known."""
        points = self.checkpoints.pop(seq.request_id, None)
        if points and seq.finish_reason in LEARNED:
            self.queue.append(Finished(seq.num_prompt, seq.params.max_tokens, seq.num_output,
                                       points))
            self.learned += 1

    def forget(self, request_id: str) -> None:
        self.checkpoints.pop(request_id, None)

    def tick(self) -> None:
        """Push what was learned, refresh the heads: each at most every push_s / refresh_s,
        in the worker unless `background` is off; never while a sync is still running."""
        if self._job is not None:
            if not self._job.done():
                return
            if self._job.exception() is not None:
                log.warning("hidden-state length head: sync failed (%s)", self._job.exception())
            self._job = None
        now, cfg = self.clock(), self.config
        push = bool(self.queue or self.unpushed) and now - self.pushed >= cfg.push_s
        refresh = now - self.refreshed >= cfg.refresh_s
        if not (push or refresh):
            return
        batch, self.queue = (self.queue, []) if push else ([], self.queue)
        self.pushed = now if push else self.pushed
        self.refreshed = now if refresh else self.refreshed
        if not cfg.background:
            self._sync(batch, refresh)
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="length-head")
        self._job = self._worker.submit(self._sync, batch, refresh)

    def flush(self) -> None:
        """Push and refresh now, whatever the intervals, and wait until that is done."""
        self.wait()
        self.pushed = self.refreshed = -math.inf
        self.tick()
        self.wait()

    def wait(self) -> None:
        """Wait for the sync in flight, if any."""
        if self._job is not None:
            self._job.exception()  # returns once the job is done

    def _sync(self, batch: list[Finished], refresh: bool) -> None:
        pushes = [*self.unpushed, *(Push(stage, delta, uuid.uuid4().hex) for stage in STAGES
                                    if (delta := learned_stats(batch, stage)) is not None)]
        failed = [p for p in pushes if self._guard("push", self._push, p) is None]
        if len(failed) > MAX_UNPUSHED:
            log.warning("hidden-state length head: %d pushes failed; the oldest %d are lost",
                        len(failed), len(failed) - MAX_UNPUSHED)
        self.unpushed = failed[-MAX_UNPUSHED:]
        if not refresh:
            return
        heads = dict(self.heads)
        for stage, l2 in zip(STAGES, self.config.l2, strict=True):
            stats = self._guard("load", self.stores[stage].load)
            if stats is not None and stats.requests != self.seen_requests[stage] and \
                    stats.requests >= self.config.min_requests:
                self.seen_requests[stage] = stats.requests
                heads[stage] = stats.solve(l2)
        self.heads = heads

    def _push(self, push: Push) -> bool:
        self.stores[push.stage].add(push.delta, push.id)
        return True

    def _guard(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a store failure never fails a request
            log.warning("hidden-state length head: %s failed (%s)", what, e)
            return None


def learned_stats(batch: list[Finished], stage: str) -> HeadStats | None:
    """The statistics `stage`'s head learns from finished requests (None: no rows), all rows in
    one product."""
    xs, ys = [], []
    for r in batch:
        points = [(g, p) for g, p in r.points if learns_from(stage, g)]
        if points:
            g = np.array([g for g, _ in points])
            xs.append(features(np.stack([p for _, p in points]), r.prompt, r.max_tokens, g))
            ys.append(targets(r.output - g))
    if not xs:
        return None
    stats = HeadStats.zeros(xs[0].shape[1])
    stats.add(np.concatenate(xs), np.concatenate(ys), requests=len(xs))
    return stats
