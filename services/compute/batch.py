"""Building a step's ForwardBatch on the device: decode tokens first, then prefill chunks.

A speculative verify (pending token + k drafts) is k + 1 decode rows of one sequence, row j
attending to its first c + 1 + j slots (the step writes every row's K/V before any attention
reads them): the decode kernel computes each row exactly as a plain decode step would (a
chunk through the prefill kernel would not be bitwise equal, and under INT8 activations a
last-bit difference can flip a greedy token), and a verify step is decode-only, as CUDA
graphs capture."""

from __future__ import annotations

import torch

from kernels import to_device
from services.compute.core.batch import ForwardBatch
from services.compute.core.sequence import UNSAMPLED
from services.compute.core.step import ScheduledStep
from services.compute.inflight import InFlight


def build_batch(step: ScheduledStep, device: torch.device, prev: InFlight | None = None,
                ) -> ForwardBatch:
    """The step's inputs on `device`. Tokens still UNSAMPLED (sampled by `prev`, the step in
    flight) are read from prev's ids on the device."""
    ids, pos, slots, dec_starts, dec_lens = _decode_rows(step)
    logits_rows = list(range(len(ids)))
    cu, pre_starts, pre_lens = [0], [], []
    prompt_rows, spans = [], []
    for seq, n in step.prefills:
        c = seq.num_cached
        owed = seq.prompt_logprobs_owed  # scored by the rows of positions owed - 1
        lo, hi = max(c, owed.start - 1), min(c + n, owed.stop - 1)
        if hi > lo:
            prompt_rows.extend(range(len(ids) + lo - c, len(ids) + hi - c))
            spans.append((seq, lo + 1, hi - lo))
        ids.extend(seq.token_ids[c : c + n])
        pos.extend(range(c, c + n))
        slots.extend(range(seq.kv_start + c, seq.kv_start + c + n))
        cu.append(cu[-1] + n)
        pre_starts.append(seq.kv_start)
        pre_lens.append(c + n)
        if n == seq.pending:
            logits_rows.append(len(ids) - 1)
    late_at, late_rows = _late_tokens(ids, step, prev)
    # two host->device copies (int64 token data, int32 attention metadata), then views
    T, D, P, L = len(ids), len(dec_starts), len(pre_starts), len(late_at)
    flat = to_device(torch.tensor(ids + pos + slots + late_at + late_rows + logits_rows
                                  + prompt_rows, dtype=torch.int64), device)
    meta = to_device(torch.tensor(dec_starts + dec_lens + cu + pre_starts + pre_lens,
                                  dtype=torch.int32), device)
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
        max_decode_len=max(dec_lens, default=0),
        max_chunk_len=max((n for _, n in step.prefills), default=0),
        prompt_spans=spans,
    )


def _decode_rows(step: ScheduledStep) -> tuple[list[int], ...]:
    """(token ids, positions, slots, KV starts, KV lengths) of the decode rows: each decode's
    pending token, then each verify's pending token and drafts (row j at position c + j),
    then each beam search's running beams' last tokens (at position c, each in its lane)."""
    rows = [(seq.kv_start, seq.token_ids[seq.num_cached], seq.num_cached)
            for seq in step.decodes]
    rows += [(seq.kv_start, t, seq.num_cached + j) for seq, drafts in step.verifies
             for j, t in enumerate([seq.token_ids[seq.num_cached], *drafts])]
    rows += [(seq.kv_start + b.lane * seq.max_len, b.tokens[-1], seq.num_cached)
             for seq in step.beams for b in seq.beams.running]
    ids, pos, slots, starts, lens = [], [], [], [], []
    for start, token, c in rows:
        ids.append(token)
        pos.append(c)
        slots.append(start + c)
        starts.append(start)
        lens.append(c + 1)
    return ids, pos, slots, starts, lens


def _late_tokens(ids: list[int], step: ScheduledStep, prev: InFlight | None):
    """(flat positions of the UNSAMPLED ids, the rows of prev.tokens holding their values)."""
    at = [i for i, t in enumerate(ids) if t == UNSAMPLED]
    if not at:
        return [], []
    if prev is None:
        raise RuntimeError("a step reads a token no step in flight samples")
    row = {seq: i for i, seq in enumerate(prev.step.sampled)}
    owner = (list(step.decodes) + [seq for seq, d in step.verifies for _ in range(1 + len(d))]
             + [seq for seq in step.beams for _ in seq.beams.running]
             + [seq for seq, n in step.prefills for _ in range(n)])
    return at, [row[owner[i]] for i in at]
