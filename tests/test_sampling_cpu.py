"""The C++ CPU sampler (pipellm/kernels/cpu/sampling.cpp) against the PyTorch reference
(`sample_reference`): the same token ids, row for row, for every kind of row (greedy,
temperature only, top-k, top-p, min-p and their mixes, degenerate settings, ties at the
cut-offs, -inf logits), on the default model's vocabulary size (49,152) and a small one, in
float32, bfloat16 and float16; logprobs within float32 rounding; the sampled distribution
against the exact one (chi-square); batch independence and determinism.

The noise is bit-identical; exp/log and float32 sums differ from torch's in the last ulps, so a
token may legitimately differ where two race values, or a cumulative mass and top_p, are within
rounding: `MAX_MISMATCH` of the rows of a comparison (none seen in practice).
"""

from __future__ import annotations

import pytest
import torch

from pipellm.kernels import dispatch
from pipellm.kernels import sampling as sampling_mod
from pipellm.kernels.cpu import extension
from pipellm.kernels.sampling import SamplingBatch, sample, sample_reference
from tests.test_sampling import params, rand_logits, ref_allowed, ref_probs

VOCAB = 49152  # SmolLM2-135M-Instruct's
MAX_MISMATCH = 0.002  # share of the rows compared (see the docstring)
INF = float("inf")
# (temperature, top_k, top_p, min_p): the modes of issue 45 and the edge settings
MODES = {
    "temperature": [(0.2, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0),
                    (1.6, 0, 1.0, 0.0)],
    "top_k": [(1.0, 40, 1.0, 0.0), (0.7, 1, 1.0, 0.0), (1.3, 5, 1.0, 0.0),
              (1.0, 2000, 1.0, 0.0)],
    "top_p": [(0.7, 0, 0.9, 0.0), (0.2, 0, 0.9, 0.0), (1.0, 0, 0.5, 0.0), (1.5, 0, 0.95, 0.0)],
    "top_k_top_p": [(0.7, 40, 0.9, 0.0), (1.0, 100, 0.5, 0.0), (1.2, 3, 0.99, 0.0)],
    "min_p": [(0.7, 0, 1.0, 0.05), (1.0, 0, 1.0, 0.3), (1.5, 0, 1.0, 0.01)],
    "mix": [(0.0, 40, 0.9, 0.1), (0.7, 50, 0.8, 0.05), (1.0, 0, 0.9, 0.02),
            (0.9, 20, 1.0, 0.1), (0.0, 0, 1.0, 0.0)],
    "edges": [(1.0, VOCAB, 1.0, 0.0), (1.0, 10**6, 1.0, 0.0), (1.0, -1, 1.0, 0.0),
              (1.0, VOCAB - 1, 1.0, 0.0), (1.0, 0, 1e-6, 0.0), (0.7, 0, 1.0, 1.0),
              (1.0, 0, 0.999999, 0.0), (-1.0, 5, 0.5, 0.0)],
}


@pytest.fixture(scope="module")
def ext():
    module = extension()
    if module is None:
        pytest.skip("the C++ CPU kernels did not build (no compiler?): only the reference runs")
    return module


def batch_of(rows: list[tuple], seeds: list[int], steps: list[int], **flags) -> SamplingBatch:
    t, k, p, mp = zip(*rows, strict=True)
    return SamplingBatch(**params(len(rows), temperature=list(t), top_k=list(k), top_p=list(p),
                                  min_p=list(mp), seed=seeds, step=steps), **flags)


def cpp(ext, logits, batch: SamplingBatch, raw=None):
    return ext.sample_rows(logits, raw, batch.temperature, batch.top_p, batch.min_p,
                           batch.top_k, batch.seeds, batch.steps, batch.need_logprobs)


def model_like(b: int, v: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Logits shaped like a language model's: a broad bulk and a few rows' worth of likely
    tokens well above it (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, v, generator=g) * 2.5 - 3.0
    top = torch.randint(0, v, (b, 32), generator=g)
    x.scatter_(1, top, torch.rand(b, 32, generator=g) * 12 + 6)
    return x.to(dtype)


def assert_same(ext, logits, batch, raw=None, max_mismatch=MAX_MISMATCH):
    ids, lps = cpp(ext, logits, batch, raw)
    ref_ids, ref_lps = sample_reference(logits, batch, raw)
    assert ids.dtype == torch.int64 and lps.dtype == torch.float32
    bad = (ids != ref_ids).nonzero().flatten().tolist()
    assert len(bad) <= max_mismatch * len(ids), (bad[:10], ids[bad[:10]], ref_ids[bad[:10]])
    ok = ids == ref_ids
    torch.testing.assert_close(lps[ok], ref_lps[ok], rtol=1e-5, atol=2e-5)
    return ids


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [VOCAB, 100])
def test_greedy_ids_and_logprobs_equal_reference(ext, dtype, vocab):
    logits = model_like(16, vocab, seed=1, dtype=dtype)
    logits[3, 10:20] = logits[3].max()  # a tied max: the first index wins
    batch = batch_of([(0.0, 5, 0.5, 0.2)] * 16, list(range(16)), [3] * 16)
    ids = assert_same(ext, logits, batch, max_mismatch=0)
    assert ids[3] == 10
    assert torch.equal(cpp(ext, logits, batch_of([(0.0, 0, 1.0, 0.0)] * 16, [0] * 16, [0] * 16,
                                                 all_greedy=True))[0], ids)


# ---------------------------------------------------------------- sampled rows


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_ids_equal_reference_full_vocab(ext, mode, dtype):
    rows = MODES[mode] * (48 // len(MODES[mode]))
    b = len(rows)
    for rep in range(2):
        logits = model_like(b, VOCAB, seed=10 + rep, dtype=dtype)
        if rep:  # half the rows flat: large nuclei and candidate sets
            logits[::2] = rand_logits((b + 1) // 2, VOCAB, seed=3, scale=0.5, dtype=dtype)
        g = torch.Generator().manual_seed(rep)
        seeds = torch.randint(0, 2**63 - 1, (b,), generator=g).tolist()
        steps = torch.randint(0, 2**40, (b,), generator=g).tolist()
        ids = assert_same(ext, logits, batch_of(rows, seeds, steps))
        if mode != "edges":
            assert (ids != logits.float().argmax(-1)).any()  # really sampled


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sampled_ids_equal_reference_small_vocab(ext, mode, dtype):
    rows = [(t, min(k, 150), p, mp) for t, k, p, mp in MODES[mode]] * (600 // len(MODES[mode]))
    b = len(rows)
    logits = rand_logits(b, 100, seed=20, scale=1.5, dtype=dtype)
    assert_same(ext, logits, batch_of(rows, list(range(b)), [7] * b))


def test_empty_batch(ext):
    empty = SamplingBatch(**params(0, temperature=[], top_k=[], top_p=[], min_p=[], seed=[],
                                   step=[]))
    ids, lps = cpp(ext, torch.zeros(0, VOCAB), empty)
    assert ids.shape == (0,) and lps.shape == (0,) and ids.dtype == torch.int64


@pytest.mark.parametrize("cut", ["top_k", "top_p"])
def test_ties_at_the_cut_off_are_kept(ext, cut):
    """Ten tokens share the largest value: top_k=4 / top_p=0.3 keep all ten (values compared,
    not ranks), so all ten get sampled, as in the reference."""
    n, v = 400, 1000
    row = rand_logits(1, v, seed=30)[0]
    tied = torch.arange(100, 1000, 90)  # 10 ids
    row[tied] = row.max() + 3.0
    rows = [(1.0, 4, 1.0, 0.0) if cut == "top_k" else (1.0, 0, 0.3, 0.0)] * n
    ids = assert_same(ext, row.expand(n, v).contiguous(), batch_of(rows, list(range(n)), [1] * n),
                      max_mismatch=0)
    assert set(ids.tolist()) == set(tied.tolist())


def test_ties_straddling_the_kth_value(ext):
    """The 3rd..7th largest are equal: top_k=4 keeps the top 7."""
    n, v = 600, 500
    row = rand_logits(1, v, seed=31, scale=0.3)[0]
    order = row.argsort(descending=True)
    row[order[:2]] = torch.tensor([2.0, 1.9])
    row[order[2:7]] = 1.8
    ids = assert_same(ext, row.expand(n, v).contiguous(),
                      batch_of([(1.0, 4, 1.0, 0.0)] * n, list(range(n)), [0] * n),
                      max_mismatch=0)
    assert set(ids.tolist()) == set(order[:7].tolist())


# ---------------------------------------------------------------- -inf logits


@pytest.mark.parametrize("vocab", [VOCAB, 100])
def test_inf_logits_are_never_sampled(ext, vocab):
    rows = [r for mode in MODES.values() for r in mode]
    b = len(rows)
    logits = model_like(b, vocab, seed=40)
    g = torch.Generator().manual_seed(1)
    masked = torch.rand(b, vocab, generator=g) < 0.7  # a grammar's mask
    masked[:, :3] = False
    logits[masked] = -INF
    logits[0, 1:] = -INF  # every token but one
    logits[1, :] = -INF
    logits[1, 42] = 5.0
    logits[2, 3:] = -INF  # 3 finite tokens under top_k 40 / top_p 0.9
    ids = assert_same(ext, logits, batch_of(rows, list(range(b)), [2] * b))
    assert torch.isfinite(logits.gather(1, ids[:, None])).all()
    assert ids[0] == 0 and ids[1] == 42
    lps = cpp(ext, logits, batch_of(rows, list(range(b)), [2] * b))[1]
    assert torch.isfinite(lps).all() and lps[0] == 0 and lps[1] == 0


def test_only_token_left_wins_in_every_mode(ext):
    rows = [r for mode in MODES.values() for r in mode]
    b, v = len(rows), 5000
    logits = torch.full((b, v), -INF)
    logits[torch.arange(b), torch.arange(b) * 97] = torch.linspace(-50, 50, b)
    ids, lps = cpp(ext, logits, batch_of(rows, list(range(b)), [0] * b))
    assert torch.equal(ids, torch.arange(b) * 97)
    assert torch.equal(lps, torch.zeros(b))


# ---------------------------------------------------------------- logprobs


def test_raw_logits_give_the_logprobs(ext):
    rows = [r for mode in MODES.values() for r in mode]
    b = len(rows)
    raw = model_like(b, VOCAB, seed=50, dtype=torch.bfloat16)
    logits = raw.float() + rand_logits(b, VOCAB, seed=51, scale=1.0)  # penalties, biases
    logits[:, :50] = -INF
    batch = batch_of(rows, list(range(b)), [9] * b)
    ids, lps = cpp(ext, logits, batch, raw)
    assert_same(ext, logits, batch, raw)
    expect = torch.log_softmax(raw.float(), dim=-1).gather(1, ids[:, None])[:, 0]
    torch.testing.assert_close(lps, expect, rtol=1e-5, atol=2e-5)
    assert (ids != raw.float().argmax(-1)).any()  # the tokens came from `logits`


def test_no_logprobs_gives_zeros_and_the_same_ids(ext):
    rows = [r for mode in MODES.values() for r in mode]
    b = len(rows)
    logits = model_like(b, 1000, seed=52)
    batch = batch_of(rows, list(range(b)), [1] * b)
    ids, lps = cpp(ext, logits, batch)
    ids2, lps2 = cpp(ext, logits, batch_of(rows, list(range(b)), [1] * b, need_logprobs=False))
    assert torch.equal(ids, ids2) and (lps < 0).any() and torch.equal(lps2, torch.zeros(b))


# ---------------------------------------------------------------- distribution


@pytest.mark.parametrize("row", [(0.7, 0, 0.9, 0.0), (1.3, 6, 1.0, 0.05), (1.0, 0, 1.0, 0.0)])
def test_distribution_matches_the_exact_one(ext, row):
    """40,000 draws (seed by seed) of one row of 12 logits: chi-square p-value > 1e-4."""
    v, n = 12, 40_000
    logits = rand_logits(1, v, seed=60, scale=1.0)
    t, k, p, mp = row
    q = ref_probs(logits[0], t, ref_allowed(logits[0], t, k, p, mp))
    probs = torch.tensor([q.get(i, 0.0) for i in range(v)], dtype=torch.float64)
    ids, _ = cpp(ext, logits.expand(n, v).contiguous(),
                 batch_of([row] * n, list(range(n)), [5] * n))
    counts = torch.bincount(ids, minlength=v).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0
    assert kept.sum() < v or row[1:] == (0, 1.0, 0.0)  # the filters really drop tokens
    chi2 = float(((counts[kept] - n * probs[kept]) ** 2 / (n * probs[kept])).sum())
    df = int(kept.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(chi2 / 2)))
    assert p_value > 1e-4, (chi2, df, counts / n, probs)


# ---------------------------------------------------------------- independence, dispatch


def test_rows_are_independent_and_deterministic(ext):
    rows = [r for mode in MODES.values() for r in mode]
    b = len(rows)
    logits = model_like(b, VOCAB, seed=70, dtype=torch.bfloat16)
    batch = batch_of(rows, list(range(100, 100 + b)), list(range(b)))
    ids, lps = cpp(ext, logits, batch)
    again = cpp(ext, logits.clone(), batch)
    assert torch.equal(ids, again[0]) and torch.equal(lps, again[1])
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(0))
    fields = ("temperature", "top_p", "min_p", "top_k", "seeds", "steps")
    shuffled = SamplingBatch(**{f: getattr(batch, f)[perm] for f in fields})
    assert torch.equal(cpp(ext, logits[perm], shuffled)[0], ids[perm])
    for i in range(0, b, 5):
        alone = SamplingBatch(**{f: getattr(batch, f)[i : i + 1] for f in fields})
        assert cpp(ext, logits[i : i + 1], alone)[0].item() == ids[i].item(), i
    other = model_like(b, VOCAB, seed=71, dtype=torch.bfloat16)
    mixed = torch.cat([logits[:1], other[1:]])
    assert cpp(ext, mixed, batch)[0][0] == ids[0]


def test_sample_dispatches_to_the_cpp_sampler_on_cpu(ext, monkeypatch):
    logits = model_like(8, 300, seed=80)
    batch = batch_of(MODES["mix"] + MODES["top_p"][:3], list(range(8)), [0] * 8)
    expect = cpp(ext, logits, batch)

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(sampling_mod, "sample_reference", refuse)
    monkeypatch.setattr(dispatch, "_backend", "auto")
    ids, lps = sample(logits, batch)
    assert torch.equal(ids, expect[0]) and torch.equal(lps, expect[1])
    monkeypatch.setattr(dispatch, "_backend", "reference")
    with pytest.raises(AssertionError, match="the reference ran"):
        sample(logits, batch)
