"""Fused MoE kernel (pipellm/kernels/fused_moe.py): the block alignment, and the Triton path against
the PyTorch per-expert reference on random inputs (under TRITON_INTERPRET=1 without a GPU,
tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pipellm.kernels import dispatch
from pipellm.kernels.fused_moe import (
    fused_moe,
    fused_moe_ref,
    fused_moe_triton,
    moe_align_block_size,
)
from pipellm.services.compute.model.moe import route


def _inputs(T: int, E: int, k: int, H: int, inter: int, dtype=torch.float32, seed: int = 0):
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], router weights [T, k] and ids [T, k] from a
    random router (renormalized top k)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter**0.5
    router = torch.randn(E, H, generator=g)
    weights, ids = route(x, router, k, renormalize=True)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


@pytest.mark.parametrize(("T", "E", "k", "block_m"), [(1, 8, 2, 16), (37, 8, 2, 16),
                                                       (5, 4, 3, 4), (0, 3, 1, 16)])
def test_align_groups_pairs_by_expert_in_padded_runs(T, E, k, block_m):
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:k]
                       for t in range(T)]) if T else torch.zeros(0, k, dtype=torch.int64)
    sorted_ids, expert_ids, used = moe_align_block_size(ids, E, block_m)
    n, flat = T * k, ids.reshape(-1)
    assert sorted_ids.numel() % block_m == 0 and expert_ids.numel() * block_m == sorted_ids.numel()
    assert sorted_ids.numel() >= n + E * (block_m - 1)  # the sync-free worst-case bound
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))  # every pair once, padding = n
    used = int(used)
    assert used % block_m == 0 and (sorted_ids[used:] == n).all()
    for b in range(used // block_m):  # each block holds pairs of its expert only
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < n]
        assert (flat[rows] == expert_ids[b]).all()
    assert (torch.diff(flat[real]) >= 0).all()  # ascending experts


SHAPES = [  # (T, E, k, H, I): a decode step, a prefill chunk, ragged sizes, top-1, top-3
    (1, 8, 2, 64, 32),
    (37, 8, 2, 64, 32),
    (70, 4, 2, 48, 40),
    (9, 6, 1, 32, 16),
    (20, 8, 3, 64, 96),
]


@pytest.mark.parametrize(("T", "E", "k", "H", "inter"), SHAPES)
def test_triton_equals_the_per_expert_reference(T, E, k, H, inter):
    x, w13, w2, weights, ids = _inputs(T, E, k, H, inter)
    got = fused_moe_triton(x, w13, w2, weights, ids)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    assert got.shape == (T, H) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_triton_in_half_precision_stays_close():
    x, w13, w2, weights, ids = _inputs(24, 8, 2, 64, 32, dtype=torch.bfloat16, seed=3)
    got = fused_moe_triton(x, w13, w2, weights, ids).float()
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


def test_no_tokens_and_dispatch():
    x, w13, w2, weights, ids = _inputs(0, 4, 2, 32, 16)
    assert fused_moe_triton(x, w13, w2, weights, ids).shape == (0, 32)
    x, w13, w2, weights, ids = _inputs(5, 4, 2, 32, 16, seed=1)
    previous = dispatch.backend()
    try:
        dispatch.set_backend("reference")
        ref = fused_moe(x, w13, w2, weights, ids)
        dispatch.set_backend("triton")
        tri = fused_moe(x, w13, w2, weights, ids)
    finally:
        dispatch.set_backend(previous)
    torch.testing.assert_close(tri, ref, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="does not match"):
        fused_moe_triton(x, w13, w2[:, :, :8], weights, ids)
