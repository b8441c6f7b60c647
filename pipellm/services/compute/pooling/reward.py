"""A reward model's outputs (--convert reward): every token's, nothing pooled away.

As vLLM's reward pooler: each prompt's every final-normed hidden state (pooling "all"), no
normalization and no activation, through the checkpoint's `score.weight` [k, hidden] where it
has one (a sequence classification or reward checkpoint: the per-token logits transformers'
`score` layer computes before it picks the last token), else the hidden states themselves.
Out: [total tokens, k] float32, each prompt's rows in prompt order.
"""

from __future__ import annotations

import torch

from pipellm.services.compute.pooling.embedder import embed
from pipellm.shared.pooling import PoolingConfig

ALL = PoolingConfig(mode="all", normalize=False)


class RewardHead:
    """The model's `score` rows over per-token hidden states ([T, hidden] -> [T, k] float32),
    or the identity (k = hidden) for a checkpoint without one."""

    def __init__(self, model):
        weight = getattr(model, "score", None)
        self.weight = None if weight is None else weight.float()

    @property
    def width(self) -> int | None:
        """k: the head's rows (None: the hidden size)."""
        return None if self.weight is None else self.weight.shape[0]

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.float()
        return rows if self.weight is None else rows @ self.weight.T


def reward(engine, prompts: list[list[int]], head: RewardHead) -> torch.Tensor:
    """[sum of the prompts' lengths, k] float32: `head` over every token of every prompt
    (batched and checked as `embed` does)."""
    return embed(engine, prompts, ALL, head=head)
