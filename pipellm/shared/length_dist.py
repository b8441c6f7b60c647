"""A predicted output-length distribution: quantiles at fixed levels. Pure logic.

The length predictor produces one per request (the tokenizer attaches it to the
GenerateRequest as `predicted_length`); compute reads it to size a KV segment (a quantile), to
regrow a segment that ran out (a quantile of the length *given* what was already generated),
and to estimate the future KV peak at admission.

The CDF F between the quantile points is piecewise linear in the length: F(values[i]) =
LEVELS[i]; F is 0 up to values[0]^2 / values[1] (one geometric step below the first point;
values[0] itself when the two are equal, a jump), and past the last point it rises linearly to
1 at `TAIL_FACTOR` x the last value. A point prediction n is the distribution with every quantile n.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

LEVELS: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
TAIL_FACTOR = 2.0  # F reaches 1 at this multiple of the last quantile


@dataclass(frozen=True)
class LengthDist:
    """Invariant: len(values) == len(LEVELS); values are non-decreasing ints >= 1."""

    values: tuple[int, ...]

    def __post_init__(self):
        v = self.values
        if len(v) != len(LEVELS) or v[0] < 1 or list(v) != sorted(v):  # sorted: in C
            raise ValueError(f"need {len(LEVELS)} non-decreasing lengths >= 1, got {v!r}")

    @classmethod
    def point(cls, n: int) -> LengthDist:
        return cls((max(int(n), 1),) * len(LEVELS))

    @classmethod
    def from_samples(cls, samples: Sequence[float]) -> LengthDist:
        """Empirical quantiles (nearest rank, rounded up) of observed lengths."""
        xs = sorted(samples)
        if not xs:
            raise ValueError("no samples")
        n = len(xs)
        return cls(tuple(max(int(-(-xs[min(int(q * n), n - 1)] // 1)), 1) for q in LEVELS))

    @property
    def median(self) -> int:
        return self.values[LEVELS.index(0.5)]

    def _knots(self) -> tuple[list[float], list[float]]:
        """(lengths, levels) of the piecewise-linear CDF, strictly increasing in length."""
        v = self.values
        xs, ys = [v[0] * v[0] / v[1]], [0.0]
        for x, y in zip(self.values, LEVELS, strict=True):
            if x > xs[-1]:
                xs.append(float(x))
                ys.append(y)
            else:  # a jump: the same length holds a higher level
                ys[-1] = y
        xs.append(self.values[-1] * TAIL_FACTOR)
        ys.append(1.0)
        return xs, ys

    def cdf(self, length: float) -> float:
        xs, ys = self._knots()
        if length >= xs[-1]:
            return 1.0
        if length < xs[0]:
            return 0.0
        i = bisect_right(xs, length) - 1
        return ys[i] + (ys[i + 1] - ys[i]) * (length - xs[i]) / (xs[i + 1] - xs[i])

    def quantile(self, q: float) -> int:
        """Smallest length (>= 1, rounded up) with F(length) >= q, for q in [0, 1]."""
        xs, ys = self._knots()
        if q <= ys[0]:
            return max(int(-(-xs[0] // 1)), 1)
        i = min(bisect_left(ys, q), len(ys) - 1)
        x = xs[i - 1] + (xs[i] - xs[i - 1]) * (q - ys[i - 1]) / (ys[i] - ys[i - 1])
        return max(int(-(-x // 1)), 1)

    def conditional_quantile(self, generated: int, q: float) -> int:
        """The q-quantile of the total length given that it exceeds `generated`; always
        > generated (past the tail: generated x TAIL_FACTOR)."""
        f = self.cdf(generated)
        if f >= 1.0:
            return max(int(generated * TAIL_FACTOR), generated + 1)
        return max(self.quantile(f + q * (1.0 - f)), generated + 1)
