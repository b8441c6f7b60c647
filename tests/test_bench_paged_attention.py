"""The paged decode attention baseline (bench/paged_attention.py, which bench/kernels.py
measures): the Triton kernel with a block table (interpreter on CPU) vs its reference, and the
reference vs the contiguous one on the same tokens."""

from __future__ import annotations

import pytest
import torch

from bench.paged_attention import (
    decode_attention_paged,
    decode_attention_paged_reference,
    paged_slots,
)
from pipellm.kernels.decode_attention import decode_attention_reference


def make_paged(lens, page, n_kv_heads=2, n_heads=8, head_dim=32, seed=0):
    """Caches whose pages are handed out in a shuffled order (spare pages hold garbage)."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    total = sum(pages) + 3
    order = torch.randperm(total, generator=g).tolist()
    width = max(pages)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    i = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor(order[i : i + n])
        i += n
    k = torch.randn(total * page, n_kv_heads, head_dim, generator=g)
    v = torch.randn(total * page, n_kv_heads, head_dim, generator=g)
    q = torch.randn(len(lens), n_heads, head_dim, generator=g)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("lens,page", [([1, 17, 40], 16), ([70, 5, 130, 64], 16), ([33], 8)])
def test_paged_kernel_matches_its_reference(lens, page):
    q, k, v, table, seq_lens = make_paged(lens, page)
    scale = q.shape[-1] ** -0.5
    ref = decode_attention_paged_reference(q, k, v, table, seq_lens, scale, page)
    got = decode_attention_paged(q, k, v, table, seq_lens, scale, page, max(lens))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("splits", [2, 4])
def test_paged_kernel_splits_match_its_reference(splits):
    """Forced splits: partials + the production combine kernel (some splits of the short
    sequences are empty)."""
    q, k, v, table, seq_lens = make_paged([200, 5, 70], 16)
    scale = q.shape[-1] ** -0.5
    ref = decode_attention_paged_reference(q, k, v, table, seq_lens, scale, 16)
    got = decode_attention_paged(q, k, v, table, seq_lens, scale, 16, 200, num_splits=splits)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_paged_reference_is_contiguous_attention_over_the_gathered_tokens():
    q, k, v, table, seq_lens = make_paged([20, 9], 4)
    slots = paged_slots(table, seq_lens, 4)
    assert [len(s) for s in slots] == [20, 9] and len(set(torch.cat(slots).tolist())) == 29
    scale = 0.3
    for b, s in enumerate(slots):
        alone = decode_attention_reference(q[b : b + 1], k[s], v[s], torch.tensor([0]),
                                           seq_lens[b : b + 1], scale)
        torch.testing.assert_close(
            decode_attention_paged_reference(q, k, v, table, seq_lens, scale, 4)[b], alone[0])
