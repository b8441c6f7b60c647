"""The token-bitmask kernel (pipellm/kernels/token_bitmask.py): the C++ CPU kernel against the
PyTorch reference and xgrammar's own CPU implementation, on random logits and masks (whole words of
0 and ~0 among them, a vocabulary that is not a multiple of 32, strided rows, a row subset)."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from pipellm.kernels.cpu import extension
from pipellm.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref


def _case(S: int, V: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(S, V + 5, generator=g)[:, 2 : 2 + V]  # strided rows
    words = (V + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (S, words), generator=g, dtype=torch.int64)
    kind = torch.randint(0, 4, (S, words), generator=g)
    bitmask[kind == 0], bitmask[kind == 1] = 0, -1  # the fast paths: none / all allowed
    return logits, bitmask.to(torch.int32)


@pytest.mark.parametrize("S, V, rows", [(1, 64, [0]), (5, 1000, [0, 2, 4]), (8, 49152, None),
                                        (3, 33, [1])])
def test_kernel_matches_the_references(S, V, rows, seed=0):
    logits, bitmask = _case(S, V, seed)
    rows = list(range(S)) if rows is None else rows
    want = apply_token_bitmask_ref(logits.clone(), bitmask, rows)
    ours = logits.clone()
    extension().apply_token_bitmask(ours, bitmask, torch.tensor(rows))
    assert torch.equal(ours, want)
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask, rows), want)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=V, indices=rows)
    assert torch.equal(theirs, want)
    untouched = [r for r in range(S) if r not in rows]
    assert torch.equal(want[untouched], logits[untouched])
    assert torch.isinf(want[rows]).any() and torch.isfinite(want[rows]).any()


def test_bad_arguments_are_errors_not_crashes():
    logits, bitmask = _case(2, 64, 1)
    with pytest.raises(RuntimeError):
        extension().apply_token_bitmask(logits, bitmask, torch.tensor([2]))
    with pytest.raises(RuntimeError):
        extension().apply_token_bitmask(logits.double(), bitmask, torch.tensor([0]))
    with pytest.raises(RuntimeError):
        extension().apply_token_bitmask(logits, bitmask[:, :1], torch.tensor([0]))
