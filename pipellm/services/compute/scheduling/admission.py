"""Admission with predicted lengths: will the future KV peak still fit? Pure logic."""

from __future__ import annotations

from statistics import NormalDist

import numpy as np

from pipellm.services.compute.core.sequence import Sequence
from pipellm.shared.config import Admission
from pipellm.shared.length_dist import LEVELS, TAIL_FACTOR

AUTO_PEAK = Admission.AGGREGATE  # what auto means under a policy that plans the future peak


class FuturePeak:
    """The most KV slots the running requests (plus those admitted through `fits`) will hold
    at once, if each generates up to the peak quantile of its length and then frees its slots:
    with remaining lengths r sorted, the demand when the k-th finishes is the sum over those
    still running of (tokens now + r_k). Each request's bound is cached in `peak_total` and
    recomputed (conditioned on its output so far) once it is outgrown."""

    def __init__(self, running: list[Sequence], quantile: float, capacity: int):
        self.q, self.capacity = quantile, capacity
        self.items = sorted(self._item(s) for s in running)  # (remaining, tokens)

    def _item(self, seq: Sequence) -> tuple[int, int]:
        if seq.peak_total <= seq.num_output:
            seq.peak_total = seq.predicted_length.conditional_quantile(seq.num_output, self.q)
        total = min(seq.peak_total, seq.max_len - seq.num_prompt)
        return max(total - seq.num_output, 1), seq.num_tokens

    def fits(self, seq: Sequence) -> bool:
        """Whether the peak still fits with `seq` running too; if so `seq` is counted."""
        items = sorted([*self.items, self._item(seq)])
        if len(items) > 1 and _sum_peak(items) > self.capacity:  # alone, it gets its chance
            return False
        self.items = items
        return True

    def peak(self) -> int:
        return _sum_peak(self.items)


def _sum_peak(items: list[tuple[int, int]]) -> int:
    """The most slots held at once by requests (remaining r, tokens t), sorted by r."""
    peak = tokens = 0
    for k in range(len(items) - 1, -1, -1):  # suffix sums: requests lasting >= r_k
        r, t = items[k]
        tokens += t
        peak = max(peak, tokens + (len(items) - k) * r)
    return peak


class AggregatePeak:
    """The q-quantile of the running requests' (plus those admitted through `fits`) *total*
    future KV demand must fit, rather than the sum of each one's q-quantile: with many requests
    the sum of remaining lengths concentrates near its mean, so a sum of per-request quantiles
    lies far above the quantile of the sum when the predicted distributions are wide.

    Each request's remaining output length R (given what it generated, capped at max_tokens) is
    discretised: every piece of its piecewise-linear CDF puts its mass at the piece's midpoint.
    Requests are independent, and all decode one token per step. Demand at step tau,
    D(tau) = sum_i (t_i + tau) [R_i >= tau] (t_i: tokens now), has mean E and variance V from
    the per-request survival S_i = P(R_i >= tau); the check is max over tau of E + z V^0.5 with
    z the normal q-quantile. Both only rise between mass points, so their maximum is at one:
    suffix sums over the mass points sorted by tau give it in O(m log m) for m points. With
    point predictions (the oracle) it is the exact peak that FuturePeak computes."""

    def __init__(self, running: list[Sequence], quantile: float, capacity: int):
        self.z, self.capacity = NormalDist().inv_cdf(min(quantile, 1 - 1e-9)), capacity
        self.count = len(running)
        points = _mass_points(running)  # (tau, mass, t, d(S^2)) rows, by tau descending
        self.points = points[np.argsort(-points[:, 0], kind="stable")]

    def fits(self, seq: Sequence) -> bool:
        """Whether the peak still fits with `seq` running too; if so `seq` is counted."""
        new = _mass_points([seq])[::-1]  # by tau descending, as self.points
        at = np.searchsorted(-self.points[:, 0], -new[:, 0], side="right")
        points = np.insert(self.points, at, new, axis=0)
        if self.count and _peak(points, self.z) > self.capacity:
            return False  # (alone, a request always gets its chance)
        self.points, self.count = points, self.count + 1
        return True

    def peak(self) -> float:
        return _peak(self.points, self.z)


def peak_check(admission: Admission, peak_admission: bool) -> type[FuturePeak] | \
        type[AggregatePeak] | None:
    """The future-peak estimator --kv-admission consults (None: admit whatever fits now);
    `peak_admission`: whether the KV policy plans the future peak (auto is AUTO_PEAK then,
    else fit)."""
    if admission == Admission.AUTO:
        admission = AUTO_PEAK if peak_admission else Admission.FIT
    return {Admission.PEAK: FuturePeak, Admission.AGGREGATE: AggregatePeak}.get(admission)


_LEVELS = np.array([0.0, *LEVELS, 1.0])  # the CDF's levels at its knots


def _mass_points(seqs: list[Sequence]) -> np.ndarray:
    """[m, 4] rows (tau, mass, tokens now, change of S^2): each request's remaining-length
    distribution as mass points, sorted by tau within each request."""
    if not seqs:
        return np.zeros((0, 4))
    v = np.array([s.predicted_length.values for s in seqs], dtype=np.float64)  # [n, 7]
    g = np.array([s.num_output for s in seqs], dtype=np.float64)[:, None]  # [n, 1]
    cap = np.array([s.max_len - s.num_prompt for s in seqs], dtype=np.float64)[:, None]
    t = np.array([s.num_tokens for s in seqs], dtype=np.float64)
    # knots of the CDF (LengthDist._knots without merging equal lengths), but the 1% beyond
    # the p99 sits at the p99 (so that a point prediction is a point): [n, 9]
    x = np.concatenate([v[:, :1] ** 2 / v[:, 1:2], v, v[:, -1:]], axis=1)
    lo, hi, mass = x[:, :-1], x[:, 1:], np.diff(_LEVELS)[None, :]  # pieces [n, 8]
    width = hi - lo
    safe = np.where(width > 0, width, 1.0)
    above = np.where(width > 0, np.clip((hi - np.maximum(lo, g)) / safe, 0, 1), hi > g) * mass
    inside = np.where(width > 0, np.clip((np.minimum(hi, cap) - np.maximum(lo, g)) / safe, 0, 1),
                      (hi > g) & (hi <= cap)) * mass
    at = (np.maximum(lo, g) + np.minimum(hi, cap)) / 2 - g  # each piece's midpoint, as tau
    total = above.sum(axis=1, keepdims=True)  # P(L > g)
    past = total[:, 0] <= 0  # beyond the tail: as conditional_quantile, the total is g x TAIL
    total[past] = 1.0
    taus = np.concatenate([at, cap - g], axis=1)  # the cap holds the mass beyond it
    masses = np.concatenate([inside, total - inside.sum(axis=1, keepdims=True)], axis=1) / total
    taus[past] = np.minimum(np.maximum(g[past], 1) * (TAIL_FACTOR - 1), cap[past] - g[past])
    masses[past] = np.eye(taus.shape[1])[-1]
    taus = np.maximum(taus, 1.0)  # a running request generates at least one more token
    survival = np.cumsum(masses[:, ::-1], axis=1)[:, ::-1]  # S just below each point: [n, 9]
    after = survival - masses  # S just above it
    rows = np.stack([taus, masses, np.broadcast_to(t[:, None], taus.shape),
                     survival ** 2 - after ** 2], axis=-1)
    rows = rows.reshape(-1, 4)
    return rows[rows[:, 1] > 0]  # (a piece outside (generated, cap] holds no mass)


def _peak(points: np.ndarray, z: float) -> float:
    """max over the mass points' taus (sorted descending) of E[D] + z sd[D] (AggregatePeak)."""
    tau, m, t, dsq = points.T
    s, ts, tts = np.cumsum(m), np.cumsum(m * t), np.cumsum(m * t * t)  # sums of S, tS, t^2 S
    q, tq, ttq = np.cumsum(dsq), np.cumsum(dsq * t), np.cumsum(dsq * t * t)  # the same of S^2
    mean = ts + tau * s
    var = (tts - ttq) + 2 * tau * (ts - tq) + tau * tau * (s - q)
    last = np.append(tau[1:] != tau[:-1], True)  # a tau's sums are complete at its last row
    return float(np.max((mean + z * np.sqrt(np.maximum(var, 0)))[last]))
