"""Flat token batch of one merged step: decode tokens first, then prefill chunks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.compute.scheduler import ScheduledStep


@dataclass
class ForwardBatch:
    """Model inputs for one step. T = num_decodes + sum of prefill chunk lengths.

    Tokens [0, num_decodes) are decodes (one per sequence); the rest are prefill chunks, chunk b
    covering flat rows num_decodes + prefill_cu_q_lens[b] .. num_decodes + prefill_cu_q_lens[b+1].
    kv_lens count the tokens in cache after this step's K/V are written.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position within its sequence
    slots: torch.Tensor  # [T] int64, KV cache slot the token's K/V go to
    num_decodes: int
    decode_kv_starts: list[int]
    decode_kv_lens: list[int]
    prefill_cu_q_lens: list[int]  # [P+1], starting at 0
    prefill_kv_starts: list[int]
    prefill_kv_lens: list[int]
    logits_indices: torch.Tensor  # [S] flat rows whose logits are sampled (order of step.sampled)


def build_batch(step: ScheduledStep, device: torch.device) -> ForwardBatch:
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    dec_starts, dec_lens = [], []
    for seq in step.decodes:
        c = seq.num_cached
        ids.append(seq.token_ids[c])
        pos.append(c)
        slots.append(seq.kv_start + c)
        dec_starts.append(seq.kv_start)
        dec_lens.append(c + 1)
    logits_rows = list(range(len(step.decodes)))
    cu, pre_starts, pre_lens = [0], [], []
    for seq, n in step.prefills:
        c = seq.num_cached
        ids.extend(seq.token_ids[c : c + n])
        pos.extend(range(c, c + n))
        slots.extend(range(seq.kv_start + c, seq.kv_start + c + n))
        cu.append(cu[-1] + n)
        pre_starts.append(seq.kv_start)
        pre_lens.append(c + n)
        if n == seq.pending:
            logits_rows.append(len(ids) - 1)

    # one host->device copy for all index arrays, then views into it
    flat = torch.tensor(ids + pos + slots + logits_rows, dtype=torch.int64).to(device)
    T = len(ids)
    return ForwardBatch(
        input_ids=flat[:T], positions=flat[T : 2 * T], slots=flat[2 * T : 3 * T],
        num_decodes=len(step.decodes), decode_kv_starts=dec_starts, decode_kv_lens=dec_lens,
        prefill_cu_q_lens=cu, prefill_kv_starts=pre_starts, prefill_kv_lens=pre_lens,
        logits_indices=flat[3 * T :],
    )
