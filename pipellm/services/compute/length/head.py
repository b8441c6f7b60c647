"""The hidden-state length head: remaining output length from the model's own hidden state.

A ridge fit maps a checkpoint's features (the hidden-state probe, log prompt length, log
max_tokens, log tokens generated) to survival estimates of the remaining length at the length
predictor's bucket edges; their quantiles are the prediction. One head per stage (`STAGES`).
Invariant: a fit depends only on additive statistics (`HeadStats`), added in any order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipellm.shared.length_dist import LEVELS, LengthDist
from pipellm.shared.length_predictor import EDGES

THRESHOLDS = np.array(EDGES[:-1], dtype=np.float64)  # y_j = 1[remaining > THRESHOLDS[j]]
J = len(THRESHOLDS)
N_SCALARS = 3  # log prompt length, log max_tokens, log generated
STAGES = ("prefill", "refine")
# the probe by default: the hidden state itself up to this width, else a projection to
# WIDE_PROBE_DIM. On SmolLM2 (576 wide) the hidden state itself predicts best, then a 512-d
# projection, then a 64-d one (docs/benchmarks.md): ridge standardizes each raw dimension,
# which a random rotation mixes.
RAW_UP_TO, WIDE_PROBE_DIM = 1024, 512


def stage_of(generated: int) -> str:
    """The head that predicts at a checkpoint `generated` tokens in."""
    return STAGES[generated > 0]


def learns_from(stage: str, generated: int) -> bool:
    """Whether `stage`'s head learns from a checkpoint `generated` tokens in."""
    return stage == "refine" or generated == 0


def is_checkpoint(generated: int, every: int) -> bool:
    """Whether a request predicts (and later learns) at `generated` output tokens: after
    prefill, then every `every` tokens (0: after prefill only)."""
    return generated == 0 or (every > 0 and generated % every == 0)


def probe_dim(hidden: int, setting: int = 0) -> int:
    """The probe's width for a model `hidden` wide (`--length-probe-dim`; 0: the default,
    RAW_UP_TO). A width equal to `hidden` is the hidden state itself."""
    return setting or (hidden if hidden <= RAW_UP_TO else WIDE_PROBE_DIM)


def probe_matrix(hidden: int, dim: int, seed: int = 0) -> np.ndarray:
    """[hidden, dim] float32: the identity if dim == hidden, else a fixed random projection
    (scaled so that a unit-RMS hidden state projects to unit-RMS features)."""
    if dim == hidden:
        return np.eye(hidden, dtype=np.float32)
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((hidden, dim)) / math.sqrt(hidden)).astype(np.float32)


def features(projected: np.ndarray, prompt_len, max_tokens, generated) -> np.ndarray:
    """[..., r + N_SCALARS] float64 features of checkpoints: `projected` [..., r]; the
    others scalars or [...]."""
    x = np.asarray(projected, dtype=np.float64)
    scalars = np.log1p(np.stack(np.broadcast_arrays(prompt_len, max_tokens, generated),
                                axis=-1).astype(np.float64))
    return np.concatenate([x, np.broadcast_to(scalars, x.shape[:-1] + (N_SCALARS,))], axis=-1)


def targets(remaining) -> np.ndarray:
    """[..., J] survival indicators of remaining lengths (>= 1), an int or [...]."""
    return (np.asarray(remaining)[..., None] > THRESHOLDS).astype(np.float64)


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
        """[..., J] non-increasing survival estimates in [0, 1] of the remaining length;
        x [..., d]."""
        s = np.clip(x @ self.weight + self.bias, 0.0, 1.0)
        return np.minimum.accumulate(s, axis=-1)

    def predict_rows(self, x: np.ndarray, generated, max_tokens) -> list[LengthDist]:
        """Per row of x [n, d]: the total output-length distribution, generated [n] + the
        remaining length's quantiles, each in (generated, max_tokens [n]]."""
        g = np.asarray(generated, dtype=np.int64)[:, None]
        cap = np.maximum(np.asarray(max_tokens, dtype=np.int64)[:, None], g + 1)
        total = np.minimum(g + remaining_quantiles(self.survival(x)), cap)
        return [LengthDist(tuple(row)) for row in total.tolist()]

    def predict(self, x: np.ndarray, generated: int, max_tokens: int) -> LengthDist:
        """`predict_rows` of one checkpoint's features x [d]."""
        return self.predict_rows(x[None], [generated], [max_tokens])[0]


GRID = np.concatenate([[1.0], THRESHOLDS])  # [J + 1]: lengths where the survival is known
LEVEL_SURVIVAL = 1.0 - np.array(LEVELS)  # [L]: a level's quantile is where S falls to this


def remaining_quantiles(s: np.ndarray) -> np.ndarray:
    """[..., L] int quantiles at LEVELS of a remaining length (>= 1) whose survival
    P(remaining > t) is s [..., J] (non-increasing) at t = THRESHOLDS: the smallest length
    whose survival is <= 1 - level, log-linear between thresholds; past the last threshold,
    EDGES[-1]; made non-decreasing across levels."""
    surv = np.concatenate([np.ones(s.shape[:-1] + (1,)), s], axis=-1)  # P(remaining > 1) = 1
    # j: the first grid point at or below the level's survival, >= 1 (surv[0] = 1 > it);
    # j == J + 1: the survival never falls that low
    j = (surv[..., None, :] > LEVEL_SURVIVAL[:, None]).sum(axis=-1)  # [..., L]
    beyond, j = j > J, np.minimum(j, J)
    s0, s1 = np.take_along_axis(surv, j - 1, -1), np.take_along_axis(surv, j, -1)
    frac = (s0 - LEVEL_SURVIVAL) / np.where(beyond, 1.0, s0 - s1)  # s0 > level >= s1
    lo, hi = GRID[j - 1], GRID[j]
    value = np.where(beyond, EDGES[-1], np.ceil(lo * (hi / lo) ** frac - 1e-9))
    return np.maximum.accumulate(np.maximum(value, 1), axis=-1).astype(np.int64)
