"""The hidden-state length head: remaining output length from the model's own hidden state.

A request's features at a checkpoint (after prefill: the last prompt token's hidden state; then
every k generated tokens: the newest token's) are `probe`-projected hidden state (r values: a
fixed random Gaussian projection, the same seed on every replica) plus log prompt length, log
max_tokens and log tokens generated so far. The targets are survival indicators of the
*remaining* length: y_j = 1[remaining > EDGES[j]] for the length predictor's log-spaced bucket
edges. A linear map fitted by ridge regression gives survival estimates S_j, made monotone,
whose quantiles are the prediction (linear probability model: one solve, no iterations).

There are two heads, one per stage (`STAGES`): "prefill" predicts right after prefill and
learns from that checkpoint only (one row per request); "refine" predicts at every later
checkpoint and learns from all of them, the one after prefill included. Pooled in one head, a
long request's many refining rows would outweigh the one prefill row of every request. MAE
against the global median's on SmolLM2's 256 lengths (bench/length_predictor.py --lengths
smollm2, 4 orders), one head -> split: at t=0.7, after prefill +1..+7% -> -2..-9%, refined
-18..-25% -> -28..-34% (-20..-27% if the refining head skipped the prefill rows); greedy,
after prefill +4..+5% -> +12..+22% (worse), refined -1..+1% -> -10..-16%.

Fitting needs only additive sufficient statistics of the rows seen, `HeadStats` (Xa^T Xa and
Xa^T Y with Xa = [X, 1], and the number of requests), so any number of writers add their
finished requests in any order and the result is the same; the stats live in Redis
(`store.py`), each replica solves them itself. Ridge acts on standardized features, with the
intercept unpenalized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shared.length_dist import LEVELS, LengthDist
from shared.length_predictor import EDGES

THRESHOLDS = np.array(EDGES[:-1], dtype=np.float64)  # y_j = 1[remaining > THRESHOLDS[j]]
J = len(THRESHOLDS)
N_SCALARS = 3  # log prompt length, log max_tokens, log generated
STAGES = ("prefill", "refine")


def stage_of(generated: int) -> str:
    """The head that predicts at a checkpoint `generated` tokens in."""
    return STAGES[generated > 0]


def learns_from(stage: str, generated: int) -> bool:
    """Whether `stage`'s head learns from a checkpoint `generated` tokens in."""
    return stage == "refine" or generated == 0


def probe_matrix(hidden: int, dim: int, seed: int = 0) -> np.ndarray:
    """[hidden, dim] float32: the fixed random projection of the hidden state (scaled so that
    a unit-RMS hidden state projects to unit-RMS features)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((hidden, dim)) / math.sqrt(hidden)).astype(np.float32)


def features(projected: np.ndarray, prompt_len: int, max_tokens: int,
             generated: int) -> np.ndarray:
    """[r + N_SCALARS] float64 features of one checkpoint; `projected` [r]."""
    scalars = np.log1p([prompt_len, max_tokens, generated])
    return np.concatenate([np.asarray(projected, dtype=np.float64), scalars])


def targets(remaining: int) -> np.ndarray:
    """[J] survival indicators of a remaining length (>= 1)."""
    return (remaining > THRESHOLDS).astype(np.float64)


@dataclass
class HeadStats:
    """Sufficient statistics of the rows seen. gram: [d+1, d+1] = Xa^T Xa, cross: [d+1, J] =
    Xa^T Y, Xa = [X, 1] (so gram[-1, -1] is the row count); requests: finished requests."""

    gram: np.ndarray
    cross: np.ndarray
    requests: int = 0

    @classmethod
    def zeros(cls, d: int) -> HeadStats:
        return cls(np.zeros((d + 1, d + 1)), np.zeros((d + 1, J)))

    @property
    def dim(self) -> int:
        return self.gram.shape[0] - 1

    @property
    def rows(self) -> int:
        return int(round(self.gram[-1, -1]))

    def add(self, x: np.ndarray, y: np.ndarray, requests: int = 1) -> None:
        """Add rows x [n, d] with targets y [n, J] (from `requests` finished requests)."""
        xa = np.hstack([x, np.ones((x.shape[0], 1))])
        self.gram += xa.T @ xa
        self.cross += xa.T @ y
        self.requests += requests

    def __iadd__(self, other: HeadStats) -> HeadStats:
        self.gram += other.gram
        self.cross += other.cross
        self.requests += other.requests
        return self

    def to_bytes(self) -> bytes:
        head = np.array([self.dim, J, self.requests], dtype="<i8").tobytes()
        return head + np.concatenate([self.gram.ravel(), self.cross.ravel()]).astype(
            "<f8").tobytes()

    @classmethod
    def from_bytes(cls, blob: bytes) -> HeadStats:
        d, j, requests = np.frombuffer(blob[:24], dtype="<i8").tolist()
        if j != J:
            raise ValueError(f"length head stats with {j} targets; this build has {J}")
        body = np.frombuffer(blob[24:], dtype="<f8")
        n = (d + 1) * (d + 1)
        return cls(body[:n].reshape(d + 1, d + 1).copy(), body[n:].reshape(d + 1, J).copy(),
                   requests)

    def solve(self, l2: float) -> LengthHead:
        """The ridge fit: standardized features, penalty l2 x rows, intercept free."""
        n = max(self.gram[-1, -1], 1.0)
        mean = self.gram[-1, :-1] / n
        ymean = self.cross[-1] / n
        cov = self.gram[:-1, :-1] / n - np.outer(mean, mean)
        xy = self.cross[:-1] / n - np.outer(mean, ymean)
        std = np.sqrt(np.maximum(np.diag(cov), 1e-12))
        corr = cov / np.outer(std, std)
        w = np.linalg.solve(corr + l2 * np.eye(self.dim), xy / std[:, None]) / std[:, None]
        return LengthHead(w, ymean - mean @ w)


@dataclass(frozen=True)
class LengthHead:
    """A solved head: S(x) = clip(x @ weight + bias) [J], survival of the remaining length."""

    weight: np.ndarray  # [d, J]
    bias: np.ndarray  # [J]

    def survival(self, x: np.ndarray) -> np.ndarray:
        """[J] non-increasing survival estimates in [0, 1] of the remaining length."""
        s = np.clip(x @ self.weight + self.bias, 0.0, 1.0)
        return np.minimum.accumulate(s)

    def predict(self, x: np.ndarray, generated: int, max_tokens: int) -> LengthDist:
        """The total output-length distribution: generated + the remaining length's
        quantiles, each in (generated, max_tokens]."""
        rem = remaining_quantiles(self.survival(x))
        cap = max(int(max_tokens), generated + 1)
        return LengthDist(tuple(min(generated + r, cap) for r in rem))


def remaining_quantiles(s: np.ndarray) -> list[int]:
    """Quantiles at LEVELS of a remaining length (>= 1) whose survival P(remaining > t) is s [J]
    at t = THRESHOLDS: the smallest length whose survival is <= 1 - level, log-linear between
    thresholds; past the last threshold, EDGES[-1]."""
    surv = np.concatenate([[1.0], s])  # at lengths grid: P(remaining > 0) = 1
    grid = np.concatenate([[1.0], THRESHOLDS])
    out, last = [], 1
    for q in LEVELS:
        below = np.flatnonzero(surv <= 1.0 - q)
        if not below.size:
            value = EDGES[-1]
        else:  # surv[j - 1] > 1 - q >= surv[j]: between grid[j - 1] and grid[j]
            j = int(below[0])
            lo, hi, s0, s1 = grid[j - 1], grid[j], surv[j - 1], surv[j]
            frac = (s0 - (1.0 - q)) / (s0 - s1)
            value = math.ceil(lo * (hi / lo) ** frac - 1e-9)
        last = max(last, int(value))
        out.append(last)
    return out
