"""The flat token batch one merged step feeds the model (built by
pipellm/services/compute/batch.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipellm.services.compute.core.lora_groups import LoraGroups
from pipellm.services.compute.core.sequence import Sequence


@dataclass
class ForwardBatch:
    """Model inputs for one step. T = num_decodes + sum of prefill chunk lengths.

    Tokens [0, num_decodes) are decodes (one per sequence); the rest are P prefill chunks, chunk
    p covering flat rows num_decodes + prefill_cu[p] .. num_decodes + prefill_cu[p+1]. KV lengths
    count a sequence's tokens in cache after this step's K/V are written.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position within its sequence
    slots: torch.Tensor  # [T] int64, KV cache slot the token's K/V go to
    logits_indices: torch.Tensor  # [S + R] flat rows whose logits are computed: the S sampled
    # (step.sampled order), then R rows whose logits score the prompt token after them
    num_decodes: int
    decode_starts: torch.Tensor  # [num_decodes] int32, first KV slot of each decode's sequence
    decode_lens: torch.Tensor  # [num_decodes] int32, its KV length
    prefill_cu: torch.Tensor  # [P+1] int32, cumulative chunk lengths from 0
    prefill_starts: torch.Tensor  # [P] int32
    prefill_lens: torch.Tensor  # [P] int32, KV length including the chunk
    max_decode_len: int  # host-side maxima: kernel grids are sized without a device sync
    max_chunk_len: int
    prompt_spans: list[tuple[Sequence, int, int]]  # (seq, first prompt position scored, count):
    # the R prompt rows in order; row j of a span scores token_ids[position + j]
    lora: LoraGroups | None = None  # the rows of each LoRA adapter; None: all base rows
    coarse_p: bool = False  # the prefill attention may run bf16 at FlashAttention's precision
    # (P rounded to bf16 alone): a pooling forward's (pipellm/kernels/prefill_attention.py), never a
    # generation step's
