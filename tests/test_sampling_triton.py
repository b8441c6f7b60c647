"""Tests for pipellm.kernels.sampling_triton: the Triton sampler against the PyTorch reference.

On CPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
Token-for-token equality is asserted. Greedy ids, top-k sets and the noise are bit-exact; top-p
and min-p cuts compare float32 sums that the kernel adds in another order than torch, so the
tests move top_p (min_p) clear of every cumulative mass (probability ratio) of the row by more
than that rounding (`clear_of_cuts`): at such a boundary the two may legitimately disagree. The
race could also differ if two tokens' scores were within a few ulps (probability ~1e-6 a row;
not guarded).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipellm.kernels import dispatch, sampling_triton
from pipellm.kernels.sampling import SamplingBatch, sample, sample_reference, uniform_noise
from pipellm.kernels.sampling_triton import sample_triton, uniform_noise_triton

F32, I64 = torch.float32, torch.int64
# (temperature, top_k, top_p, min_p) per row: greedy (filters ignored), temperature only, top-k
# (incl. 1, V - 1 and >= V), top-p (incl. 1), min-p and combinations.
ROWS = [(0.0, 5, 0.5, 0.2), (1.0, 0, 1.0, 0.0), (1.3, 7, 1.0, 0.0), (0.8, 0, 0.8, 0.0),
        (0.9, 0, 1.0, 0.1), (1.5, 20, 0.9, 0.05), (2.0, 10**6, 1.0, 0.0), (0.7, 1, 0.95, 0.3)]
ROWS_B = [(1.0, -1, 0.6, 0.0), (0.5, 3, 0.99, 0.01), (1.0, 40, 1.0, 0.5), (0.0, 0, 1.0, 0.0),
          (1.2, 0, 0.3, 0.02), (3.0, 2, 1.0, 1.0), (1.0, -7, 1.0, 0.0), (0.6, 0, 0.9, 0.15)]


def tricky_logits(b: int, v: int, seed: int, style: str = "mixed") -> torch.Tensor:
    """[b, v] f32 random logits; "mixed" cycles rows through: smooth, on a coarse grid (many
    ties, some of them +-0.0), a third of the entries -inf, and a max repeated 5 times."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, v, generator=g) * 2.0 + 0.3  # [b, v]
    grid = (x * 2).round() / 2  # ties, and -0.0 from small negatives
    inf = x.masked_fill(torch.rand(b, v, generator=g) < 0.33, float("-inf"))
    inf[:, 0] = x[:, 0]  # never an all -inf row
    top = x.clone()
    top[:, 1:6] = x.max(dim=1, keepdim=True).values + 0.5
    if style != "mixed":
        return {"smooth": x, "grid": grid, "inf": inf, "top": top}[style]
    pick = torch.arange(b) % 4  # [b]
    return torch.stack([(x, grid, inf, top)[int(pick[i])][i] for i in range(b)])


def _clear(value: float, cuts: torch.Tensor, margin: float) -> float:
    """value, or the middle of the nearest gap of `cuts` (float64) wider than 4 * margin."""
    if cuts.numel() == 0 or (cuts - value).abs().min() > margin:
        return value
    edges = torch.cat([cuts, torch.tensor([0.0, 1.0], dtype=cuts.dtype)]).unique()  # sorted
    mids = (edges[1:] + edges[:-1]) / 2
    mids = mids[edges[1:] - edges[:-1] > 4 * margin]
    return float(mids[(mids - value).abs().argmin()])


def clear_of_cuts(row: torch.Tensor, t: float, k: int, p: float, mp: float) -> tuple[float, float]:
    """(top_p, min_p) for a row (temperature t > 0, top-k k), moved clear of the cut-offs."""
    x = (row.float() / t).double().sort(descending=True).values  # the f32 x both compute
    kk = x.numel() if k <= 0 else min(k, x.numel())
    x = x[x >= x[kk - 1]]  # top-k
    probs = torch.softmax(x, 0)  # [n] float64, descending
    ahead = torch.cat([probs.new_zeros(1), probs.cumsum(0)[:-1]])  # mass before each rank
    if p < 1:
        p = _clear(p, ahead[1:], 2e-5)
        x = x[x >= x[int((ahead < p).sum().clamp(min=1)) - 1]]  # top-p
    ratios = torch.exp(x - x[0])  # probability / max probability
    if mp > 0:
        mp = _clear(mp, ratios[ratios < 1], 1e-5 * mp)
    return p, mp


def make_params(logits: torch.Tensor, rows: list[tuple], seed: int, clear: bool = True
                ) -> dict[str, torch.Tensor]:
    """Per-row params from (temperature, top_k, top_p, min_p) tuples, moved clear of the
    row's cut-offs unless clear=False; random 63-bit seeds and 41-bit steps."""
    g = torch.Generator().manual_seed(seed)
    if clear:
        rows = [(t, k, *clear_of_cuts(row, t, k, p, mp)) if t > 0 else (t, k, p, mp)
                for row, (t, k, p, mp) in zip(logits, rows, strict=True)]
    t, k, p, mp = zip(*rows, strict=True)
    n = len(rows)
    return dict(temperature=torch.tensor(t, dtype=F32), top_k=torch.tensor(k, dtype=I64),
                top_p=torch.tensor(p, dtype=F32), min_p=torch.tensor(mp, dtype=F32),
                seeds=torch.randint(0, 2**63 - 1, (n,), generator=g),
                steps=torch.randint(0, 2**41, (n,), generator=g))


def assert_same(logits: torch.Tensor, p: dict[str, torch.Tensor], raw_logits=None, **flags
                ) -> torch.Tensor:
    """Triton == reference on one SamplingBatch of p's tensors and the given flags."""
    batch = SamplingBatch(**p, **flags)
    ids, lps = sample_triton(logits, batch, raw_logits)
    ref_ids, ref_lps = sample_reference(logits, batch, raw_logits)
    assert ids.dtype == I64 and lps.dtype == F32
    assert ids.tolist() == ref_ids.tolist(), p
    torch.testing.assert_close(lps, ref_lps, rtol=1e-5, atol=1e-5)
    return ids


# ---------------------------------------------------------------- the noise


@pytest.mark.parametrize("vocab", [1, 64, 1000])
def test_noise_is_bit_identical(vocab):
    seeds = torch.tensor([0, 1, 2**32 - 1, 2**32, 2**63 - 1, 5 + (7 << 32), 12345])
    steps = torch.tensor([0, 2**40, 3, 2**32 + 1, 9, 0, 2**41 - 1])
    noise = uniform_noise_triton(seeds, steps, vocab)  # [2, vocab]
    assert torch.equal(noise, uniform_noise(seeds, steps, vocab))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), step=st.integers(0, 2**41), vocab=st.integers(1, 300))
def test_noise_is_bit_identical_hypothesis(seed, step, vocab):
    seeds, steps = torch.tensor([seed, step % 2**31]), torch.tensor([step, seed >> 20])
    noise = uniform_noise_triton(seeds, steps, vocab)  # [2, vocab]
    assert torch.equal(noise, uniform_noise(seeds, steps, vocab))


# ---------------------------------------------------------------- sample_triton == reference


@pytest.mark.parametrize("vocab,table", [(64, ROWS), (257, ROWS_B), (1000, ROWS)])
def test_matches_reference_mixed_rows(vocab, table):
    for rep in range(3):  # new logits, seeds and steps each time
        logits = tricky_logits(len(table), vocab, seed=vocab + rep)
        assert_same(logits, make_params(logits, table, seed=rep))


def test_matches_reference_over_many_blocks(monkeypatch):
    monkeypatch.setattr(sampling_triton, "_MAX_BLOCK", 64)  # 300 = 4 x 64 + a partial block
    logits = tricky_logits(8, 300, seed=1)
    assert_same(logits, make_params(logits, ROWS, seed=1))
    seeds, steps = torch.tensor([3, 2**62]), torch.tensor([1, 2**33])
    assert torch.equal(uniform_noise_triton(seeds, steps, 300), uniform_noise(seeds, steps, 300))


def test_many_steps_of_one_row_with_stride_zero():
    row = tricky_logits(1, 200, seed=2, style="grid")  # [1, 200]
    rows = [(1.1, 12, 0.9, 0.02)] * 8
    p = make_params(row.expand(8, 200), rows, seed=2)
    p["seeds"][:] = 77
    p["steps"] = torch.arange(8) * 1001  # one sequence, 8 steps
    ids = assert_same(row.expand(8, 200), p)  # stride(0) == 0
    assert len(set(ids.tolist())) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_paths_and_raw_logits(dtype):
    raw = tricky_logits(8, 150, seed=3).to(dtype)  # model logits
    chooser = raw.float() - 0.7 * (torch.arange(150) % 5 == 0)  # "penalized": [8, 150] f32
    p = make_params(chooser, ROWS, seed=3)
    assert_same(raw, p)
    assert_same(raw, p, all_greedy=True)
    assert_same(raw, p, need_sort=False)  # top-k / top-p are then ignored, as the reference does
    assert_same(chooser, p, raw_logits=raw)
    assert_same(chooser, p, raw_logits=raw, all_greedy=True)


def test_sample_dispatches_to_triton(monkeypatch):
    calls = []

    def spy(*args):
        calls.append(1)
        return sample_triton(*args)

    monkeypatch.setattr(sampling_triton, "sample_triton", spy)
    logits = tricky_logits(4, 100, seed=4)
    p = make_params(logits, ROWS[:4], seed=4)
    old = dispatch.backend()
    try:
        dispatch.set_backend("triton")
        ids, lps = sample(logits, SamplingBatch(**p))
    finally:
        dispatch.set_backend(old)
    assert calls == [1]
    ref = sample(logits, SamplingBatch(**p))  # CPU tensors, "auto": the reference
    assert calls == [1] and ids.tolist() == ref[0].tolist()
    torch.testing.assert_close(lps, ref[1], rtol=1e-5, atol=1e-5)


@st.composite
def _row_params(draw, vocab: int) -> tuple:
    t = draw(st.sampled_from([0.0, 1.0]) | st.floats(0.0625, 3.0, width=32))
    k = draw(st.sampled_from([0, -1, 1, vocab]) | st.integers(1, vocab + 2))
    p = draw(st.just(1.0) | st.floats(2**-7, 1.0, width=32))
    mp = draw(st.just(0.0) | st.floats(0.0, 1.0, width=32))
    return t, k, p, mp


@settings(max_examples=40, deadline=None)
@given(data=st.data(), vocab=st.integers(2, 300), b=st.integers(1, 4), seed=st.integers(0, 10**6),
       style=st.sampled_from(["smooth", "grid", "inf", "top", "mixed"]))
def test_matches_reference_hypothesis(data, vocab, b, seed, style):
    logits = tricky_logits(b, vocab, seed, style)
    rows = [data.draw(_row_params(vocab)) for _ in range(b)]
    assert_same(logits, make_params(logits, rows, seed))


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("vocab,dtype", [(32_000, torch.float32), (151_936, torch.bfloat16)])
def test_matches_reference_on_cuda(vocab, dtype):
    """Real vocabularies on CUDA (compiled kernel, libdevice exp/log vs torch's CUDA kernels).
    No clearing of cut-offs at this size: a cut may flip a near-zero-probability token, so a
    sampled row may rarely differ; greedy rows and the noise must be exact."""
    b = 64
    logits = tricky_logits(b, vocab, seed=5).to(dtype).cuda()
    rows = [ROWS[i % 8] if i % 16 < 8 else ROWS_B[i % 8] for i in range(b)]
    p = {k: t.cuda() for k, t in make_params(logits, rows, seed=5, clear=False).items()}
    noise = uniform_noise_triton(p["seeds"], p["steps"], vocab)
    assert torch.equal(noise, uniform_noise(p["seeds"], p["steps"], vocab))
    ids, lps = sample_triton(logits, SamplingBatch(**p))
    ref_ids, ref_lps = sample_reference(logits, SamplingBatch(**p))
    same = ids == ref_ids
    greedy = p["temperature"] == 0
    assert same[greedy].all() and same.float().mean() >= 0.95, (ids, ref_ids)
    torch.testing.assert_close(lps[same], ref_lps[same], rtol=1e-4, atol=1e-4)
    many = {k: t.repeat_interleave(16) for k, t in p.items()}
    many["steps"] += torch.arange(16, device="cuda").repeat(b)
    agree = sample_triton(logits.repeat_interleave(16, 0), SamplingBatch(**many))[0]
    agree = agree == sample_reference(logits.repeat_interleave(16, 0), SamplingBatch(**many))[0]
    assert agree.float().mean() >= 0.98 and math.isfinite(float(lps.sum()))
