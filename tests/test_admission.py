"""Future-peak admission: the sum of per-request quantiles (FuturePeak) against the quantile of
the aggregate demand (AggregatePeak), checked against exact peaks and a Monte Carlo of the
predicted distributions. Pure logic."""

from __future__ import annotations

import random

import pytest

from pipellm.services.compute.core.sequence import Sequence
from pipellm.services.compute.scheduling.admission import AggregatePeak, FuturePeak, peak_check
from pipellm.services.compute.scheduling.kv_policy import make_policy
from pipellm.services.compute.scheduling.kv_space import KVSpace
from pipellm.services.compute.scheduling.scheduler import Scheduler
from pipellm.shared.config import Admission, SchedulerConfig
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.sampling import SamplingParams


def running(rng: random.Random, n: int, dist) -> list[Sequence]:
    """n requests, each with a random prompt, output so far and max_tokens; `dist(rng)` their
    predicted lengths."""
    out = []
    for i in range(n):
        prompt, generated, max_tokens = rng.randint(5, 300), rng.randint(0, 60), \
            rng.choice([200, 1024])
        out.append(Sequence(str(i), list(range(1, prompt + generated + 1)),
                            SamplingParams(max_tokens=max_tokens), 0, prompt + max_tokens,
                            dist(rng), frozenset(), num_prompt=prompt))
    return out


def wide(rng: random.Random, low: int = 20, high: int = 300) -> LengthDist:
    scale = rng.randint(low, high)
    return LengthDist(tuple(sorted(max(int(scale * rng.uniform(0.2, 4)), 1) for _ in range(7))))


def exact_peak(remaining: list[int], tokens: list[int]) -> int:
    """The most slots held at once if request i holds tokens[i] + tau until tau = remaining[i]."""
    items, peak, held = sorted(zip(remaining, tokens, strict=True)), 0, 0
    for k in range(len(items) - 1, -1, -1):
        held += items[k][1]
        peak = max(peak, held + (len(items) - k) * items[k][0])
    return peak


def first_refused(check, seqs: list[Sequence], capacity: int) -> int:
    """How many of `seqs` the check admits, in order, before its first refusal."""
    peak = check(seqs[:1], 0.9, capacity)
    return 1 + next((i for i, s in enumerate(seqs[1:]) if not peak.fits(s)), len(seqs) - 1)


def test_point_predictions_give_the_exact_peak():
    rng = random.Random(0)
    for _ in range(5):
        seqs = running(rng, 150, lambda r: LengthDist.point(r.randint(70, 900)))
        remaining = [min(s.predicted_length.median, s.max_len - s.num_prompt) - s.num_output
                     for s in seqs]
        tokens = [s.num_tokens for s in seqs]
        capacity = int(0.8 * exact_peak(remaining, tokens))
        want = next(k for k in range(1, 151) if exact_peak(remaining[:k], tokens[:k]) > capacity)
        for check in (FuturePeak, AggregatePeak):  # both admit until the exact peak overflows
            assert first_refused(check, seqs, capacity) == want - 1
            assert check(seqs, 0.9, capacity).peak() == pytest.approx(exact_peak(remaining,
                                                                                  tokens))


def test_aggregate_quantile_matches_monte_carlo_and_sits_far_below_the_sum():
    rng = random.Random(1)
    seqs = running(rng, 300, wide)
    peaks = []
    for _ in range(300):  # sample each remaining length from its conditional distribution
        remaining = []
        for s in seqs:
            d, g, cap = s.predicted_length, s.num_output, s.max_len - s.num_prompt
            f = d.cdf(g)
            total = d.quantile(f + rng.random() * (1 - f)) if f < 1 else 2 * g
            remaining.append(max(min(total, cap) - g, 1))
        peaks.append(exact_peak(remaining, [s.num_tokens for s in seqs]))
    peaks.sort()
    for q in (0.5, 0.9):
        simulated = peaks[int(q * len(peaks))]
        got = AggregatePeak(seqs, q, capacity=10**9)
        assert abs(got.peak() / simulated - 1) < 0.03, (q, got.peak(), simulated)
    summed = FuturePeak(seqs, 0.9, capacity=10**9).peak()
    assert summed > 1.2 * peaks[int(0.99 * len(peaks))]  # the sum of p90s: beyond the p99
    one_by_one = AggregatePeak(seqs[:1], 0.9, capacity=10**9)
    assert all(one_by_one.fits(s) for s in seqs[1:])
    assert one_by_one.peak() == pytest.approx(AggregatePeak(seqs, 0.9, 10**9).peak())


def test_scheduler_admits_between_the_summed_peak_and_the_reservations():
    def admitted(admission: str) -> int:
        rng = random.Random(2)
        config = SchedulerConfig(10**6, 1024, "predicted", 16, kv_admission=admission)
        s = Scheduler(config, KVSpace(config, 75_000))
        for x in running(rng, 400, lambda r: wide(r, 200, 600)):
            x.token_ids = x.token_ids[: x.num_prompt]  # waiting: nothing generated yet
            s.add(x)
        return len(s.schedule().admitted)

    peak, aggregate, fit = admitted("peak"), admitted("aggregate"), admitted("fit")
    assert peak < aggregate < fit  # 204 < 231 < 341 (fit: the reservations fill the cache)
    with pytest.raises(ValueError, match="admission"):
        SchedulerConfig(kv_admission="sum")
    # auto: the aggregate under the predicted policy, whatever fits under the others
    for policy, check in (("predicted", AggregatePeak), ("max", None), ("paged", None)):
        config = SchedulerConfig(kv_policy=policy)
        assert peak_check(config.kv_admission, make_policy(config).peak_admission) is check
    assert peak_check(Admission.PEAK, False) is FuturePeak
    assert peak_check(Admission.FIT, True) is None
