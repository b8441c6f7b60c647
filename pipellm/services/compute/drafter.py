"""The draft model of `--speculative-config '{"model": PATH}'` on the device
(speculative/draft.py is the scheduler's side).

A second model in the compute process, with its own KV cache of the target's capacity, slot
for slot: where the target's cache holds a token's K/V, the draft's cache holds the draft
model's K/V of that token. So the target's KV moves (compaction, prefix-cache copies) apply to
both, and every step's batch runs through the draft model too (`mirror`, after the target's
forward): prefills, decodes and verify rows alike, so any request may get drafts at its next
decode, and a preempted one recomputes both caches. Before the target's forward, `propose`
runs k decode passes of the draft model over the verifying requests: pass i feeds each one's
row i (its pending token, then its drafts) at position c + i and writes the greedy token into
row i + 1, so the DRAFTED placeholders hold the draft's tokens when the target reads them. The
draft's passes run eagerly (no CUDA graphs) and never sync with the host.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pipellm.kernels import take_rows, to_device
from pipellm.services.compute.core.batch import ForwardBatch
from pipellm.services.compute.core.sequence import Sequence
from pipellm.services.compute.core.step import ScheduledStep, Work
from pipellm.services.compute.kv.kv_cache import KVCache


class Drafter:
    def __init__(self, model, kv: KVCache, device: torch.device):
        """`model`: the draft LlamaModel; `kv`: its cache, of the target cache's slots."""
        self.model, self.kv, self.device = model, kv, device

    def propose(self, step: ScheduledStep, batch: ForwardBatch) -> torch.Tensor | None:
        """Fill the draft rows of batch.input_ids (the verifies' placeholders) with the draft
        model's greedy tokens; returns them [sum of k] int64 on the device, verify by verify
        (None: the step verifies nothing)."""
        heads, row = [], 0  # each verify's first flat row (its pending token), its item
        for item in step.items:
            if item.kind is Work.VERIFY:
                heads.append((row, item))
            row += item.tokens
        if not heads:
            return None
        for i in range(max(len(item.drafts) for _, item in heads)):
            active = [(h, item.seq) for h, item in heads if len(item.drafts) > i]
            rows = to_device(torch.tensor([h + i for h, _ in active]), self.device)
            passed = _decode_batch([seq for _, seq in active], i, batch.input_ids[rows])
            batch.input_ids[rows + 1] = self.model.forward(passed, self.kv).argmax(-1)
        drafted = [h + 1 + j for h, item in heads for j in range(len(item.drafts))]
        return take_rows(batch.input_ids, drafted)

    def mirror(self, batch: ForwardBatch) -> None:
        """Write the draft model's K/V of every token of the step (no logits)."""
        self.model.forward(replace(batch, logits_indices=batch.logits_indices[:0]), self.kv)


def _decode_batch(seqs: list[Sequence], i: int, ids: torch.Tensor) -> ForwardBatch:
    """A decode-only batch: seqs' tokens `ids` [A] at their position num_cached + i."""
    pos = [s.num_cached + i for s in seqs]
    starts = [s.kv_start for s in seqs]
    flat = to_device(torch.tensor(pos + [s + p for s, p in zip(starts, pos, strict=True)]),
                     ids.device)
    meta = to_device(torch.tensor(starts + [p + 1 for p in pos] + [0], dtype=torch.int32),
                     ids.device)
    n = len(seqs)
    return ForwardBatch(
        input_ids=ids, positions=flat[:n], slots=flat[n:],
        logits_indices=torch.arange(n, device=ids.device), num_decodes=n,
        decode_starts=meta[:n], decode_lens=meta[n:2 * n], prefill_cu=meta[2 * n:],
        prefill_starts=meta[:0], prefill_lens=meta[:0], max_decode_len=max(pos) + 1,
        max_chunk_len=0, prompt_spans=[])
