"""A prefill-only forward for pooling: every row's final-normed hidden state, no logits.

It builds the same ForwardBatch the engine's prefill steps use (no decodes; one chunk per
prompt covering the whole prompt at positions 0..n-1, or its tokens after a prefix whose K/V
its slots already hold, its K/V written to the contiguous slots starting at that prompt's
`start`) through LlamaModel.normed_hidden: every row normed, no LM head (over every row of a
mean-pooled batch it would cost a [T, vocab] matrix), its attention at FlashAttention's
precision where a kernel offers it (`coarse_p`: P rounded to bf16; a vector needs no more).
The caller owns the slots: they hold the prompts' K/V afterwards, until it frees them.
"""

from __future__ import annotations

import torch

from pipellm.kernels import to_device
from pipellm.services.compute.core.batch import ForwardBatch


def prefill_batch(prompts: list[list[int]], starts: list[int], device: torch.device,
                  cached: int = 0) -> ForwardBatch:
    """The ForwardBatch of prefill chunks over whole prompts (`starts[i]`: prompt i's first
    slot), each from position `cached` on: every prompt's first `cached` tokens already hold
    their K/V in its slots (0: none; each prompt longer than `cached`)."""
    lens = [len(p) for p in prompts]
    ids = [t for p in prompts for t in p[cached:]]
    pos = [j for n in lens for j in range(cached, n)]
    slots = [s + j for s, n in zip(starts, lens, strict=True) for j in range(cached, n)]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n - cached)
    T, P = len(ids), len(prompts)
    flat = to_device(torch.tensor(ids + pos + slots + [T - 1], dtype=torch.int64), device)
    meta = to_device(torch.tensor(cu + starts + lens, dtype=torch.int32), device)
    empty = meta[:0]
    return ForwardBatch(
        input_ids=flat[:T], positions=flat[T:2 * T], slots=flat[2 * T:3 * T],
        logits_indices=flat[3 * T:], num_decodes=0, decode_starts=empty, decode_lens=empty,
        prefill_cu=meta[:P + 1], prefill_starts=meta[P + 1:2 * P + 1],
        prefill_lens=meta[2 * P + 1:], max_decode_len=0, max_chunk_len=max(lens) - cached,
        prompt_spans=[], coarse_p=True)


@torch.inference_mode()
def hidden_states(model, batch: ForwardBatch, kv, rows: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Final-normed hidden states of `rows` of `batch` ([len(rows), hidden]; None: every row,
    [T, hidden]); model: a LlamaModel, its last MLP run on those rows alone."""
    return model.normed_hidden(batch, kv, rows, trim=True)
