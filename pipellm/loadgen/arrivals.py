"""Arrival schedules: when each request is sent, as seconds after the run starts (pure).

* `poisson`: `vllm bench serve`'s process: gaps drawn from a gamma distribution with shape
  `burstiness` and mean 1 / rate (burstiness 1 = exponential gaps = Poisson arrivals; < 1 =
  burstier, > 1 = more regular, inf = evenly spaced), then scaled, as vLLM does, so that the
  last arrival falls exactly at n / rate (the offered rate is exact whatever the seed).
  A rate of inf sends everything at once.
* `trace`: replay recorded arrival times, the time axis multiplied by `time_scale`.
* `burst`: everything at once.

Every schedule is a non-decreasing list of offsets; the same arguments give the same list.
"""

from __future__ import annotations

import math

import numpy as np


def poisson(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """`n` arrival offsets at `rate` requests/s with gamma(`burstiness`) gaps; see the module."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    if n <= 0:
        return []
    if math.isinf(rate):
        return burst(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / rate) / times[-1]
    return [float(t) for t in times]


def trace(arrivals: list[float], time_scale: float = 1.0) -> list[float]:
    """Recorded arrival times, shifted to start at 0 and multiplied by `time_scale`
    (0.1 replays ten times faster). Raises ValueError if they are not in order."""
    if time_scale < 0:
        raise ValueError("time_scale must be >= 0")
    if any(b < a for a, b in zip(arrivals, arrivals[1:], strict=False)):
        raise ValueError("trace arrival times must be non-decreasing")
    if not arrivals:
        return []
    t0 = arrivals[0]
    return [(t - t0) * time_scale for t in arrivals]


def burst(n: int) -> list[float]:
    """Every request at time 0."""
    return [0.0] * max(n, 0)
