"""Sampling: a step's logits [S + R, vocab] -> its sampled tokens, their logprobs and top rows.

Rows i < S are step.sampled[i]'s next-token rows; the R after them score prompt spans. Called in
the order prompt_rows, suppress_stop_tokens (in place), top_rows, sample. Nothing here waits for
the device. Logprobs are the model's own (log_softmax after min_tokens masking only); penalties
and logit_bias are out of place, in float32; a row's token never depends on its batch.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from pipellm.kernels import SamplingBatch, apply_penalties, take_rows, to_device, token_stats
from pipellm.kernels import sample as sample_kernel
from pipellm.services.compute.core.sequence import Sequence
from pipellm.services.compute.inflight import PromptRows, TopRows, to_host
from pipellm.services.compute.structured import mask_logits


def sampling_batch(seqs: list[Sequence], device: torch.device,
                   offsets: list[int] | None = None) -> SamplingBatch:
    """Row i samples for seqs[i]: its params, seed and step (tokens generated so far, plus
    offsets[i] for a speculative verify's row: ScheduledStep.offsets) as [S] tensors on
    `device` (two host->device copies, whatever S), and the host flags."""
    ps = [s.params for s in seqs]
    offsets = offsets or [0] * len(seqs)
    floats = torch.tensor([[p.temperature for p in ps], [p.top_p for p in ps],
                           [p.min_p for p in ps]], dtype=torch.float32)
    ints = torch.tensor([[p.top_k for p in ps], [s.seed for s in seqs],
                         [s.num_output + j for s, j in zip(seqs, offsets, strict=True)]],
                        dtype=torch.int64)
    floats, ints = to_device(floats, device), to_device(ints, device)
    return SamplingBatch(
        temperature=floats[0], top_p=floats[1], min_p=floats[2],
        top_k=ints[0], seeds=ints[1], steps=ints[2],
        all_greedy=all(p.temperature == 0 for p in ps),
        need_sort=any(p.top_k > 0 or p.top_p < 1 for p in ps if p.temperature > 0),
        need_logprobs=any(p.logprobs or p.top_logprobs for p in ps),
    )


def sample(logits: torch.Tensor, seqs: list[Sequence], device: torch.device,
           mask: Future | None = None, offsets: list[int] | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [S, vocab] for `seqs` -> (ids [S] int64, logprobs [S]
    float32) on the device; penalties, logit_bias and the grammars' bitmask (`mask`:
    structured.start_mask's, if started) first where a row asks (`offsets`: see
    sampling_batch). No host sync."""
    raw = None
    grammar = any(s.grammar is not None for s in seqs)
    if grammar or any(s.params.shapes_logits for s in seqs):  # else no such work at all
        raw = logits  # logprobs stay those of the model's own distribution
        logits = logits.float()
        if any(s.params.has_penalties for s in seqs):
            logits = _penalize(logits, seqs, device)
        logits = _ban_tokens(_add_logit_bias(logits, seqs), seqs)
        if grammar:
            logits = mask_logits(logits if logits is not raw else logits.clone(), seqs, mask)
    return sample_kernel(logits, sampling_batch(seqs, device, offsets), raw)


def _penalize(logits: torch.Tensor, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    """Presence/frequency/repetition penalties on the rows whose params ask for them; the
    other rows get neutral values and no token statistics, so they are left bit-identical."""
    on = [s.params.has_penalties for s in seqs]
    prompts = [s.token_ids[: s.num_prompt] if o else [] for s, o in zip(seqs, on, strict=True)]
    outputs = [s.output_ids if o else [] for s, o in zip(seqs, on, strict=True)]
    prompt_mask, output_counts = token_stats(prompts, outputs, logits.shape[-1], device)
    ps = [s.params for s in seqs]
    pen = torch.tensor([[p.presence_penalty for p in ps], [p.frequency_penalty for p in ps],
                        [p.repetition_penalty for p in ps]], dtype=torch.float32)
    pen = to_device(pen, device)
    return apply_penalties(logits, prompt_mask, output_counts, pen[0], pen[1], pen[2])


def _add_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [S, vocab] float, plus each row's logit_bias (one scatter for the whole step)."""
    cells = [(row, t, b) for row, s in enumerate(seqs) for t, b in s.params.logit_bias]
    if not cells:
        return logits
    rows, ids, biases = zip(*cells, strict=True)
    index = to_device(torch.tensor([rows, ids], dtype=torch.int64), logits.device)
    values = to_device(torch.tensor(biases, dtype=logits.dtype), logits.device)
    return logits.index_put((index[0], index[1]), values, accumulate=True)


def _ban_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [S, vocab] float with the tokens a row may not sample at -inf (out of place):
    all but its allowed_token_ids, if any, and each bad word's last token where its output
    ends with the rest of that word (vLLM's bad_words)."""
    allowed = [(row, s.params.allowed_token_ids) for row, s in enumerate(seqs)
               if s.params.allowed_token_ids]
    allowed += [(row, (token,)) for row, s in enumerate(seqs)
                if (token := thinking_end_token(s.params, s.output_ids)) is not None]
    banned = [(row, word[-1]) for row, s in enumerate(seqs) for word in s.params.bad_words_ids
              if len(word) == 1 or s.output_ids[-(len(word) - 1):] == list(word[:-1])]
    if not allowed and not banned:
        return logits
    add = torch.zeros(logits.shape, dtype=logits.dtype)
    for row, ids in allowed:
        add[row] = float("-inf")
        add[row, list(ids)] = 0.0
    for row, token in banned:
        add[row, token] = float("-inf")
    return logits + to_device(add, logits.device)


def thinking_end_token(params, output: list[int]) -> int | None:
    """The token a thinking budget forces next, or None: once the reasoning (the output from
    its start, or after thinking_start_ids where set) holds thinking_budget tokens without its
    end marker, the marker's next token (the longest tail of the output that begins it is
    already there)."""
    budget, end, start = params.thinking_budget, params.thinking_end_ids, params.thinking_start_ids
    if budget <= 0 or not end or len(output) < budget:
        return None
    if start and list(output[: len(start)]) != list(start):
        return None  # the output did not open a reasoning: nothing to end
    tail = list(output[len(start):])
    n = len(end)
    if any(tail[i : i + n] == list(end) for i in range(len(tail) - n + 1)):
        return None  # ended
    if len(tail) < budget:
        return None
    done = next((k for k in range(min(n - 1, len(tail)), 0, -1) if tail[-k:] == list(end[:k])),
                0)
    return end[done]


def suppress_stop_tokens(logits: torch.Tensor, seqs: list[Sequence],
                         offsets: list[int] | None = None) -> None:
    """min_tokens: a request may not stop before it has generated that many tokens (unless
    its grammar ends it: a grammar's end wins); `offsets`: see sampling_batch."""
    for row, (s, j) in enumerate(zip(seqs, offsets or [0] * len(seqs), strict=True)):
        if s.num_output + j < s.params.min_tokens and s.stop_ids and s.grammar is None:
            logits[row, list(s.stop_ids)] = float("-inf")


def _top_k(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, values) [R, k] of the k most likely tokens of each row of `logprobs` [R, vocab],
    best first, copied to the host without waiting."""
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    return to_host(ids), to_host(values)


def top_rows(logits: torch.Tensor, ks: list[int]) -> TopRows | None:
    """The ks[i] most likely tokens of the rows i of `logits` [S, vocab] where ks[i] > 0."""
    rows = [i for i, k in enumerate(ks) if k]
    if not rows:
        return None
    ids, values = _top_k(take_rows(logits, rows).float().log_softmax(-1), max(ks))
    return TopRows(rows, [ks[i] for i in rows], ids, values)


def prompt_rows(logits: torch.Tensor, spans: list[tuple[Sequence, int, int]]) -> PromptRows:
    """logits [R, vocab]: the rows before the prompt tokens of `spans` (see ForwardBatch)."""
    targets = [t for seq, start, n in spans for t in seq.token_ids[start : start + n]]
    logprobs = logits.float().log_softmax(-1)  # [R, vocab]
    index = to_device(torch.tensor(targets, dtype=torch.int64)[:, None], logits.device)
    ids, values = _top_k(logprobs, max(seq.params.prompt_logprobs for seq, _, _ in spans))
    chosen = logprobs.gather(1, index)  # [R, 1]
    ranks = (logprobs > chosen).sum(-1, dtype=torch.int32) + 1
    return PromptRows(spans, to_host(chosen[:, 0]), ids, values, to_host(ranks))
