"""A token bitmask (the tokens a grammar allows next) applied to logits: in the listed rows,
every token whose bit is 0 becomes -inf, in place.

    logits [S, V] float32; bitmask int32 [S, ceil(V / 32)], bit j of word w = token 32w + j
    (xgrammar's layout: its matchers fill it); rows: the rows to mask (the others untouched)

    apply_token_bitmask_ref   PyTorch: the words' bytes through a [256, 8] lookup table
    apply_token_bitmask       the C++ kernel on a CPU (pipellm/kernels/cpu/token_bitmask.cpp: ~10x
                              the reference at 64 rows x 49k tokens), xgrammar's on CUDA, else
                              the reference
"""

from __future__ import annotations

import torch

from pipellm.kernels.dispatch import cpu_extension

_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()  # [256, 8]


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor,
                            rows: list[int]) -> torch.Tensor:
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    words = bitmask.to(logits.device)[index]  # [R, W]
    table = _BITS.to(logits.device)
    allowed = table[words.view(torch.uint8).long()].view(len(rows), -1)[:, : logits.shape[-1]]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: list[int]) -> torch.Tensor:
    """`logits` with the listed rows masked (in place; returned for chaining)."""
    if not rows:
        return logits
    if logits.dtype == torch.float32 and (ext := cpu_extension(logits)) is not None:
        ext.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
        return logits
    if logits.is_cuda:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=logits.shape[-1], indices=rows)
        return logits
    return apply_token_bitmask_ref(logits, bitmask, rows)
