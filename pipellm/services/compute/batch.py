"""Building a step's ForwardBatch on the device: decode tokens first, then prefill chunks.

A speculative verify (pending token + k drafts) is k + 1 decode rows of one sequence, row j
attending to its first c + 1 + j slots (the step writes every row's K/V before any attention
reads them): the decode kernel computes each row exactly as a plain decode step would (a
chunk through the prefill kernel would not be bitwise equal, and under INT8 activations a
last-bit difference can flip a greedy token), and a verify step is decode-only, as CUDA
graphs capture."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pipellm.kernels import to_device
from pipellm.services.compute.core.batch import ForwardBatch
from pipellm.services.compute.core.lora_groups import LoraGroups
from pipellm.services.compute.core.sequence import UNSAMPLED, Sequence
from pipellm.services.compute.core.step import ScheduledStep, Work, WorkItem
from pipellm.services.compute.inflight import InFlight


def build_batch(step: ScheduledStep, device: torch.device, prev: InFlight | None = None,
                lora_slots: Mapping[str, int] | None = None) -> ForwardBatch:
    """The step's inputs on `device`. Tokens still UNSAMPLED (sampled by `prev`, the step in
    flight) are read from prev's ids on the device. `lora_slots`: the served LoRA adapters'
    slots (the model's), for a step with adapter rows."""
    rows = _Rows()
    for item in step.items:  # decode-kind items first (ScheduledStep)
        if item.kind is Work.PREFILL:
            rows.prefill(item)
        else:
            rows.decode(item)
    late_rows = _late_rows(rows.late_seqs, prev)
    # two host->device copies (int64 token data, int32 attention metadata), then views
    T, D, P, L = len(rows.ids), len(rows.dec_starts), len(rows.pre_starts), len(late_rows)
    flat = to_device(torch.tensor(rows.ids + rows.pos + rows.slots + rows.late_at + late_rows
                                  + rows.logits + rows.prompt, dtype=torch.int64), device)
    meta = to_device(torch.tensor(rows.dec_starts + rows.dec_lens + rows.cu + rows.pre_starts
                                  + rows.pre_lens, dtype=torch.int32), device)
    if L:  # input_ids[late_at] = prev's sampled ids [late_rows]
        late = flat[3 * T : 3 * T + 2 * L]
        flat[:T].index_copy_(0, late[:L], prev.tokens.index_select(0, late[L:]))
    return ForwardBatch(
        input_ids=flat[:T], positions=flat[T : 2 * T], slots=flat[2 * T : 3 * T],
        logits_indices=flat[3 * T + 2 * L :], num_decodes=D,
        decode_starts=meta[:D], decode_lens=meta[D : 2 * D],
        prefill_cu=meta[2 * D : 2 * D + P + 1],
        prefill_starts=meta[2 * D + P + 1 : 2 * D + 2 * P + 1],
        prefill_lens=meta[2 * D + 2 * P + 1 :],
        max_decode_len=max(rows.dec_lens, default=0),
        max_chunk_len=max(rows.chunks, default=0),
        prompt_spans=rows.spans,
        lora=(LoraGroups.of(rows.adapters, lora_slots, lambda t: to_device(t, device))
              if rows.any_adapter else None),
    )


@dataclass
class _Rows:
    """A step's inputs on the host, row by row, before their two copies to the device."""

    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    logits: list[int] = field(default_factory=list)  # the sampled rows
    prompt: list[int] = field(default_factory=list)  # the rows scoring prompt tokens
    spans: list[tuple[Sequence, int, int]] = field(default_factory=list)
    late_at: list[int] = field(default_factory=list)  # rows whose token is UNSAMPLED
    late_seqs: list[Sequence] = field(default_factory=list)  # and their sequences
    dec_starts: list[int] = field(default_factory=list)
    dec_lens: list[int] = field(default_factory=list)
    cu: list[int] = field(default_factory=lambda: [0])
    pre_starts: list[int] = field(default_factory=list)
    pre_lens: list[int] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)  # each row's LoRA adapter ("": the base)
    any_adapter: bool = False

    def decode(self, item: WorkItem) -> None:
        """Rows attending to their KV through position c (every one sampled)."""
        for start, token, c in item.decode_rows():
            if token == UNSAMPLED:
                self.late_at.append(len(self.ids))
                self.late_seqs.append(item.seq)
            self.logits.append(len(self.ids))
            self.ids.append(token)
            self.pos.append(c)
            self.slots.append(start + c)
            self.dec_starts.append(start)
            self.dec_lens.append(c + 1)
        self._adapter(item.seq, len(self.ids) - len(self.adapters))

    def prefill(self, item: WorkItem) -> None:
        """A chunk of n tokens from position c; its last row sampled if it ends the prompt,
        and the rows whose logits score a prompt token asked for."""
        seq, c, n = item.seq, item.seq.num_cached, item.tokens
        owed = seq.prompt_logprobs_owed  # scored by the rows of positions owed - 1
        lo, hi = max(c, owed.start - 1), min(c + n, owed.stop - 1)
        if hi > lo:
            self.prompt.extend(range(len(self.ids) + lo - c, len(self.ids) + hi - c))
            self.spans.append((seq, lo + 1, hi - lo))
        chunk = seq.token_ids[c : c + n]
        if UNSAMPLED in chunk:  # a preempted request's recompute
            late = [len(self.ids) + i for i, t in enumerate(chunk) if t == UNSAMPLED]
            self.late_at += late
            self.late_seqs += [seq] * len(late)
        self.ids += chunk
        self.pos += range(c, c + n)
        self.slots += range(seq.kv_start + c, seq.kv_start + c + n)
        self.cu.append(self.cu[-1] + n)
        self.pre_starts.append(seq.kv_start)
        self.pre_lens.append(c + n)
        self.chunks.append(n)
        self._adapter(seq, n)
        if item.samples:
            self.logits.append(len(self.ids) - 1)

    def _adapter(self, seq: Sequence, n: int) -> None:
        """seq's n new rows belong to its LoRA adapter."""
        name = seq.params.lora_name
        self.adapters += [name] * n
        self.any_adapter |= bool(name)


def _late_rows(seqs: list[Sequence], prev: InFlight | None) -> list[int]:
    """The rows of prev.tokens holding the values of `seqs`' UNSAMPLED tokens."""
    if not seqs:
        return []
    if prev is None:
        raise RuntimeError("a step reads a token no step in flight samples")
    row = {seq: i for i, seq in enumerate(prev.step.sampled)}
    return [row[seq] for seq in seqs]
