"""Tests for pipellm.kernels.sampling: filters, reproducibility, distribution, and the hash RNG
(CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipellm.kernels.sampling import SamplingBatch, _bits_to_uniform, sample, uniform_noise

F32, I64 = torch.float32, torch.int64
M32 = 0xFFFFFFFF


def params(b, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0):
    """Per-row parameter tensors for a batch of b rows; each arg is a scalar or a length-b list."""

    def col(v, dtype):
        t = torch.as_tensor(v, dtype=dtype)
        return t.expand(b).clone() if t.dim() == 0 else t

    return dict(temperature=col(temperature, F32), top_k=col(top_k, I64), top_p=col(top_p, F32),
                min_p=col(min_p, F32), seeds=col(seed, I64), steps=col(step, I64))


def rand_logits(b, v, seed, scale=2.0, dtype=F32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, v, generator=g) * scale + 0.3).to(dtype)


def ref_allowed(row, t, k, p, mp, slack=0.0) -> set[int]:
    """Straightforward per-row reference (float64) of the tokens top-k, top-p, min-p keep.

    slack > 0 widens the set (p and min_p nudged by a relative slack), slack < 0 narrows it,
    to stay clear of float32-vs-float64 rounding exactly at a cut-off.
    """
    x = [float(val) / t for val in row.double()]
    order = sorted(range(len(x)), key=lambda i: x[i], reverse=True)
    kept = order if k <= 0 else [i for i in order if x[i] >= x[order[min(k, len(x)) - 1]]]
    top = x[order[0]]
    if p < 1:
        z = sum(math.exp(x[i] - top) for i in kept)
        cum, last = 0.0, kept[0]
        for i in kept:
            last = i
            cum += math.exp(x[i] - top) / z
            if cum >= p * (1 + slack):
                break
        kept = [i for i in kept if x[i] >= x[last]]
    return {i for i in kept if math.exp(x[i] - top) >= mp * (1 - slack)}


def ref_probs(row, t, allowed) -> dict[int, float]:
    """softmax(row / t) renormalized over `allowed`."""
    w = {i: math.exp(float(row[i]) / t) for i in allowed}
    z = sum(w.values())
    return {i: wi / z for i, wi in w.items()}


def repeated_steps(logits, n_steps, **kw):
    """Sample every row of logits at steps 0..n_steps-1 in one batch -> ids [B, n_steps]."""
    b = logits.shape[0]
    p = params(b, **kw)
    rep = {name: t.repeat_interleave(n_steps) for name, t in p.items()}
    rep["steps"] = rep["steps"] + torch.arange(n_steps).repeat(b)
    ids, _ = sample(logits.repeat_interleave(n_steps, dim=0), SamplingBatch(**rep))
    return ids.view(b, n_steps)


# ---------------------------------------------------------------- greedy and logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_temperature_zero_is_argmax_and_ignores_filters(dtype):
    logits = rand_logits(16, 500, seed=1, dtype=dtype)
    kw = dict(temperature=0.0, top_k=list(range(1, 17)), top_p=0.3, min_p=0.5,
              seed=list(range(16)), step=7)
    ids, logprobs = sample(logits, SamplingBatch(**params(16, **kw)))
    expect = logits.float().argmax(dim=-1)
    assert ids.dtype == I64 and logprobs.dtype == F32
    assert torch.equal(ids, expect)
    fast_ids, fast_lp = sample(logits, SamplingBatch(**params(16, **kw), all_greedy=True))
    assert torch.equal(fast_ids, expect)
    torch.testing.assert_close(fast_lp, logprobs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax_at_chosen_ids(dtype):
    b = 24
    logits = rand_logits(b, 300, seed=2, dtype=dtype)
    kw = dict(temperature=[0.0, 0.5, 1.0, 2.0] * 6, top_k=[0, 5] * 12, top_p=[1.0, 0.9, 0.7] * 8,
              min_p=[0.0] * 12 + [0.1] * 12, seed=list(range(100, 124)), step=3)
    ids, logprobs = sample(logits, SamplingBatch(**params(b, **kw)))
    expect = torch.log_softmax(logits.float(), dim=-1).gather(1, ids[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expect, rtol=1e-5, atol=1e-5)
    assert (ids != logits.float().argmax(-1)).any()  # some rows really sampled


def test_mixed_greedy_and_sampled_rows():
    b = 32
    logits = rand_logits(b, 400, seed=3, scale=0.5)  # flat-ish: sampled rows rarely hit argmax
    temps = [0.0 if i % 3 == 0 else 1.5 for i in range(b)]
    kw = dict(temperature=temps, top_k=[0, 50] * 16, top_p=[1.0, 0.95] * 16, min_p=0.01,
              seed=list(range(b)), step=11)
    ids, _ = sample(logits, SamplingBatch(**params(b, **kw)))
    greedy = torch.tensor(temps) == 0
    argmax = logits.argmax(-1)
    assert torch.equal(ids[greedy], argmax[greedy])
    assert (ids[~greedy] != argmax[~greedy]).sum() >= 15
    for i in range(b):  # every row as if sampled alone
        alone = {name: t[i : i + 1] for name, t in params(b, **kw).items()}
        assert sample(logits[i : i + 1], SamplingBatch(**alone))[0].item() == ids[i].item()


# ---------------------------------------------------------------- filters


def test_top_k_never_outside_k_largest_and_covers_them():
    b, v, n = 16, 100, 600
    logits = rand_logits(b, v, seed=4, scale=0.3)  # flat: all of the top k are likely
    ks = [1, 2, 3, 5, 8, 10, 4, 6] * 2
    ids = repeated_steps(logits, n, top_k=ks, seed=list(range(b)))
    for i, k in enumerate(ks):
        top = set(logits[i].topk(k).indices.tolist())
        assert set(ids[i].tolist()) == top, (i, k)


def test_top_p_matches_reference_nucleus():
    b, v, n = 16, 64, 1000
    logits = rand_logits(b, v, seed=5, scale=1.5)
    temps = [1.0, 0.7, 1.3, 1.0] * 4
    ps = [0.1, 0.3, 0.5, 0.6, 0.75, 0.8, 0.9, 0.95] * 2
    ids = repeated_steps(logits, n, temperature=temps, top_p=ps, seed=list(range(7, 7 + b)))
    for i in range(b):
        picked = set(ids[i].tolist())
        wide = ref_allowed(logits[i], temps[i], 0, ps[i], 0.0, slack=1e-5)
        assert picked <= wide, (i, picked - wide)
        narrow = ref_allowed(logits[i], temps[i], 0, ps[i], 0.0, slack=-1e-5)
        probs = ref_probs(logits[i], temps[i], narrow)
        assert {t for t, q in probs.items() if q > 0.02} <= picked, i
        assert len(wide) < v  # the nucleus really excludes something


def test_min_p_never_below_threshold():
    b, v, n = 12, 80, 800
    logits = rand_logits(b, v, seed=6, scale=1.5)
    mps = [0.01, 0.05, 0.1, 0.2, 0.3, 0.5] * 2
    temps = [1.0] * 6 + [0.6] * 6
    ids = repeated_steps(logits, n, temperature=temps, min_p=mps, seed=99)
    for i in range(b):
        probs = torch.softmax(logits[i].double() / temps[i], dim=-1)
        chosen = probs[ids[i]]
        assert (chosen >= mps[i] * probs.max() * (1 - 1e-5)).all(), i
        allowed = ref_allowed(logits[i], temps[i], 0, 1.0, mps[i], slack=-1e-5)
        q = ref_probs(logits[i], temps[i], allowed)
        assert {t for t, qi in q.items() if qi > 0.02} <= set(ids[i].tolist()), i


def test_combined_filters_match_reference():
    b, v, n = 24, 64, 800
    logits = rand_logits(b, v, seed=7, scale=1.0)
    ks = [0, 3, 10, 20, 40, 64] * 4
    ps = [1.0, 0.9, 0.8, 0.6] * 6
    mps = [0.0, 0.05, 0.2] * 8
    temps = [0.8, 1.0, 1.7] * 8
    kw = dict(temperature=temps, top_k=ks, top_p=ps, min_p=mps, seed=list(range(b)))
    ids = repeated_steps(logits, n, **kw)
    for i in range(b):
        picked = set(ids[i].tolist())
        wide = ref_allowed(logits[i], temps[i], ks[i], ps[i], mps[i], slack=1e-5)
        assert picked <= wide, (i, picked - wide)
        narrow = ref_allowed(logits[i], temps[i], ks[i], ps[i], mps[i], slack=-1e-5)
        q = ref_probs(logits[i], temps[i], narrow)
        assert {t for t, qi in q.items() if qi > 0.02} <= picked, i


def test_degenerate_filters():
    b = 16
    logits = rand_logits(b, 200, seed=8)
    argmax = logits.argmax(-1)
    base = dict(temperature=1.3, seed=list(range(b)), step=5)
    for kw in [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)]:
        assert torch.equal(sample(logits, SamplingBatch(**params(b, **base, **kw)))[0], argmax), kw
    off = sample(logits, SamplingBatch(**params(b, **base)))[0]
    assert torch.equal(sample(logits, SamplingBatch(**params(b, **base, top_k=200)))[0], off)
    assert torch.equal(sample(logits, SamplingBatch(**params(b, **base, top_k=10**6)))[0], off)
    assert torch.equal(sample(logits, SamplingBatch(**params(b, **base, top_k=-1)))[0], off)
    assert not torch.equal(off, argmax)


def test_need_sort_false_fast_path_gives_same_result():
    b = 32
    logits = rand_logits(b, 300, seed=9)
    kw = dict(temperature=[0.0, 0.5, 1.0, 1.5] * 8, min_p=[0.0, 0.05] * 16,
              seed=list(range(b)), step=list(range(b)))
    full = sample(logits, SamplingBatch(**params(b, **kw)))
    fast = sample(logits, SamplingBatch(**params(b, **kw), need_sort=False))
    assert torch.equal(full[0], fast[0])
    torch.testing.assert_close(full[1], fast[1])


def test_masked_logits_never_sampled():
    b, v = 8, 100
    logits = rand_logits(b, v, seed=10, scale=0.2)
    logits[:, ::2] = float("-inf")
    ids = repeated_steps(logits, 200, temperature=[0.0, 1.0, 3.0, 1.0] * 2, top_k=[0, 0, 0, 80] * 2,
                         top_p=[1.0, 1.0, 1.0, 0.99] * 2, seed=5)
    assert (ids % 2 == 1).all()
    lp = sample(logits, SamplingBatch(**params(b, temperature=2.0, seed=1)))[1]
    assert torch.isfinite(lp).all()


# ---------------------------------------------------------------- reproducibility


def test_same_seed_and_step_reproduce_and_rows_are_independent():
    b, v = 12, 256
    logits = rand_logits(b, v, seed=11, scale=0.5)
    kw = dict(temperature=[0.0, 0.7, 1.0, 1.9] * 3, top_k=[0, 0, 7, 30] * 3,
              top_p=[1.0, 0.9, 1.0, 0.8] * 3, min_p=[0.0, 0.02, 0.1] * 4,
              seed=[3, 2**62 + 5, 17, 2**40] * 3, step=list(range(0, 36, 3)))
    p = params(b, **kw)
    ids, lp = sample(logits, SamplingBatch(**p))
    again = sample(logits.clone(), SamplingBatch(**{k: t.clone() for k, t in p.items()}))
    assert torch.equal(ids, again[0]) and torch.equal(lp, again[1])

    perm = torch.randperm(b, generator=torch.Generator().manual_seed(0))
    shuffled = sample(logits[perm], SamplingBatch(**{k: t[perm] for k, t in p.items()}))
    assert torch.equal(shuffled[0], ids[perm])
    torch.testing.assert_close(shuffled[1], lp[perm], rtol=0, atol=1e-6)
    for i in range(b):
        alone = sample(logits[i : i + 1], SamplingBatch(**{k: t[i : i + 1] for k, t in p.items()}))
        assert alone[0].item() == ids[i].item(), i

    other = rand_logits(b, v, seed=12)  # other rows' logits change: row 0 keeps its token
    mixed = torch.cat([logits[:1], other[1:]])
    assert sample(mixed, SamplingBatch(**p))[0][0] == ids[0]


def test_different_seeds_and_steps_give_different_samples():
    n, v = 300, 1000
    row = rand_logits(1, v, seed=13, scale=0.01)  # nearly uniform
    by_seed, _ = sample(row.expand(n, v), SamplingBatch(**params(n, seed=list(range(n)), step=4)))
    by_step, _ = sample(row.expand(n, v), SamplingBatch(**params(n, seed=42, step=list(range(n)))))
    high = torch.tensor([5 + (j << 32) for j in range(n)])  # only the seed's high bits differ
    by_high, _ = sample(row.expand(n, v), SamplingBatch(**params(n, seed=high, step=4)))
    for ids in (by_seed, by_step, by_high):
        assert len(set(ids.tolist())) > 200  # ~259 expected for 300 draws out of 1000
    assert (by_seed != by_step).float().mean() > 0.9


# ---------------------------------------------------------------- distribution


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p,vary",
    [(1.0, 0, 1.0, 0.0, "step"), (0.6, 0, 1.0, 0.0, "seed"), (1.7, 0, 1.0, 0.0, "step"),
     (1.0, 6, 0.9, 0.03, "step")],
)
def test_empirical_distribution_matches_softmax(temperature, top_k, top_p, min_p, vary):
    v, n = 12, 40_000
    row = rand_logits(1, v, seed=14, scale=1.0)[0]
    allowed = ref_allowed(row, temperature, top_k, top_p, min_p)
    q = ref_probs(row, temperature, allowed)
    probs = torch.tensor([q.get(i, 0.0) for i in range(v)], dtype=torch.float64)
    span = list(range(n))
    kw = dict(seed=span, step=17) if vary == "seed" else dict(seed=1234, step=span)
    batch = SamplingBatch(**params(n, temperature=temperature, top_k=top_k, top_p=top_p,
                                   min_p=min_p, **kw))
    ids, _ = sample(row.expand(n, v), batch)
    counts = torch.bincount(ids, minlength=v).double()
    assert counts[probs == 0].sum() == 0
    kept = probs > 0
    assert chi_square(counts[kept], probs[kept]) < 45  # df <= 11: p-value ~ 1e-5
    assert 0.5 * (counts / n - probs).abs().sum() < 0.015  # total variation


# ---------------------------------------------------------------- the hash RNG


def _py_fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def py_uniform(seed: int, step: int, v: int) -> float:
    """Pure-Python spec of uniform_noise[b, v] (what the Triton kernel must reproduce)."""
    k = _py_fmix32((seed & M32) ^ 0x9E3779B9)
    k = _py_fmix32(k ^ (seed >> 32) ^ 0x7F4A7C15)
    k = _py_fmix32(k ^ (step & M32) ^ 0x85EBCA77)
    k = _py_fmix32(k ^ (step >> 32) ^ 0xC2B2AE3D)
    col = _py_fmix32(((v * 0x9E3779B1) & M32) ^ 0x68E31DA4)
    return ((_py_fmix32(k ^ col) >> 9) + 0.5) * 2.0**-23


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), step=st.integers(0, 2**40), vocab=st.integers(1, 300))
def test_uniform_noise_matches_python_spec(seed, step, vocab):
    u = uniform_noise(torch.tensor([seed, 1]), torch.tensor([step, 2]), vocab)
    assert u.shape == (2, vocab) and u.dtype == F32
    assert u[0].tolist() == [py_uniform(seed, step, v) for v in range(vocab)]


def test_bits_to_uniform_is_exact_and_strictly_inside_unit_interval():
    h = torch.tensor([0, 1, 511, 512, 2**31, M32 - 512, M32 - 511, M32])
    u = _bits_to_uniform(h)
    assert u.dtype == F32
    expect = [((x >> 9) + 0.5) * 2.0**-23 for x in h.tolist()]
    assert u.tolist() == expect  # exact: no float32 rounding anywhere
    assert u.min().item() == 2.0**-24 and u.max().item() == 1 - 2.0**-24
    assert torch.isfinite(-torch.log(u)).all() and (-torch.log(u) > 0).all()


def test_uniform_noise_is_uniform_and_uncorrelated():
    b, v = 16, 65_536
    seeds = torch.tensor([0, 1, 2, 2**32, 2**63 - 1] + list(range(1000, 1011)))
    steps = torch.tensor([0, 0, 0, 0, 9] + [0] * 11)
    u = uniform_noise(seeds, steps, v)
    assert u.shape == (b, v) and u.dtype == F32
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 2e-3
    assert abs(u.var().item() - 1 / 12) < 1e-3
    counts = torch.histc(u, bins=64, min=0.0, max=1.0).double()
    assert chi_square(counts, torch.full((64,), 1 / 64, dtype=torch.float64)) < 120  # df 63
    e = -torch.log(u)
    assert abs(e.mean().item() - 1.0) < 5e-3  # the exponential race needs Exp(1)

    c = torch.corrcoef(u - 0.5)  # rows (seeds) pairwise
    assert (c - torch.eye(b)).abs().max() < 0.02
    seq = uniform_noise(torch.full((64,), 7), torch.arange(64), 4096)  # consecutive steps
    c = torch.corrcoef(seq)
    assert (c - torch.eye(64)).abs().max() < 0.08
    lag = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    assert abs(lag.item()) < 0.01  # neighbouring columns
    assert len({tuple(r[:8].tolist()) for r in u}) == b  # all rows differ


def test_logprobs_can_be_skipped_without_changing_tokens():
    torch.manual_seed(3)
    logits = torch.randn(6, 50) * 3
    for kw in ({"all_greedy": True}, {}):
        p = params(6, temperature=[0.0, 0.7, 1.0, 1.3, 0.0, 0.9], seed=list(range(6)))
        ids, lps = sample(logits, SamplingBatch(**p, **kw))
        ids2, lps2 = sample(logits, SamplingBatch(**p, **kw, need_logprobs=False))
        assert torch.equal(ids, ids2) and torch.all(lps < 0) and torch.all(lps2 == 0)
