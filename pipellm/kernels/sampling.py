"""Batched token sampling: the PyTorch reference, and which implementation `sample` runs.

One call, `sample(logits, batch, raw_logits=None)`, samples one token for every row of a batch
of logits, each row with its own temperature, top-k, top-p, min-p, seed and step (a
`SamplingBatch`, vLLM semantics):

    1. temperature == 0: greedy, argmax of the raw logits; every other parameter is ignored.
    2. x = logits / temperature.
    3. top-k (k <= 0 disabled): keep the tokens whose value is >= the k-th largest.
    4. top-p (p == 1 disabled): on the top-k-renormalized distribution keep the smallest
       prefix of highest-probability tokens whose cumulative probability is >= p (the top-1
       always stays).
    5. min-p (0 disabled): drop tokens whose probability is < min_p * max probability.
    6. sample from what is left: token = argmax(probs / E), E ~ Exp(1) i.i.d. per token (the
       exponential race, equivalent to sampling from the renormalized probs; dropped tokens
       have probability 0 and never win).

Ties at the top-k and top-p cut-offs are kept (thresholds compare values, not ranks), so the
result does not depend on the order a sort puts equal values in.

The noise comes from a counter-based hash, not from torch.Generator: u[b, v] is a pure
function of (seeds[b], steps[b], v), computed with int64 tensor ops whose values always stay
below 2^49, so a row's token depends only on its own (seed, step, logits, params): not on the
batch, its position in it, or the device. Nothing here syncs with the host, so the same code
runs on CUDA tensors; the caller, who knows the parameters on the host, opts into the fast
paths (the batch's flags `all_greedy`, `need_sort=False`).

`sample_reference` is the specification; `sample` runs, per `pipellm.kernels.dispatch`:
  - on CUDA (or `--kernels triton`): the Triton kernel (`pipellm.kernels.sampling_triton`, uint32
    arithmetic for the same noise);
  - on CPU with `--kernels auto`: the C++ sampler (pipellm/kernels/cpu/sampling.cpp: no vocabulary
    sort, the noise only where a token can still win) where the extension is built;
  - else this reference.
Both kernels pick the reference's tokens but where float rounding decides (two race values,
or a cumulative mass and top_p, within an ulp or so).

Penalties (`apply_penalties`, vLLM / OpenAI semantics) run before `sample`, on the logits the
caller then passes to it; `token_stats` builds their per-row token statistics on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipellm.kernels.dispatch import cpu_extension, use_triton

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingBatch:
    """One step's sampling arguments, row b for row b of the logits. Tensors are [B] on the
    logits' device; the flags are host-side knowledge that lets an implementation skip work
    (they must not change the result)."""

    temperature: torch.Tensor  # float32, 0: greedy (every other parameter ignored)
    top_p: torch.Tensor  # float32 in (0, 1], 1: off
    min_p: torch.Tensor  # float32 in [0, 1], 0: off
    top_k: torch.Tensor  # int64, <= 0: off
    seeds: torch.Tensor  # int64 in [0, 2^63)
    steps: torch.Tensor  # int64, tokens generated so far: where in its noise stream a row is
    all_greedy: bool = False  # every temperature is 0: pure argmax
    need_sort: bool = True  # some sampled row uses top-k or top-p (False skips the filters)
    need_logprobs: bool = True  # False: logprobs may come back as zeros


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) and a 32-bit constant c, without overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    # x * lo < 2^48 and ((x * hi) mod 2^16) << 16 < 2^32: every intermediate fits in int64.
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer (a bijection on [0, 2^32)), elementwise on int64 tensors."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] int64 seeds, [B] int64 steps -> [B] int64 32-bit keys, one per (seed, step)."""
    k = _fmix32((seeds & _M32) ^ 0x9E3779B9)
    k = _fmix32(k ^ ((seeds >> 32) & _M32) ^ 0x7F4A7C15)
    k = _fmix32(k ^ (steps & _M32) ^ 0x85EBCA77)
    return _fmix32(k ^ ((steps >> 32) & _M32) ^ 0xC2B2AE3D)


def _bits_to_uniform(h: torch.Tensor) -> torch.Tensor:
    """int64 h in [0, 2^32) -> float32 ((h >> 9) + 0.5) * 2^-23, in [2^-24, 1 - 2^-24].

    The top 23 bits, not 24: m + 0.5 is exact in float32 only for m < 2^23 (24-bit significand);
    with 24 bits the largest value would round up to exactly 1.0, and -log(1) = 0 breaks the race.
    """
    return ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B] int64 seeds, [B] int64 steps -> u [B, V] float32 in (0, 1), V = vocab_size.

    u[b, v] = _bits_to_uniform(h), h = fmix32(row_key(seed, step) ^ col_key(v)) and
    col_key(v) = fmix32((v * 0x9E3779B1 mod 2^32) ^ 0x68E31DA4).
    """
    keys = _row_keys(seeds.long(), steps.long())  # [B]
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)  # [V]
    cols = _fmix32(_mul32(cols, 0x9E3779B1) ^ 0x68E31DA4)  # [V]
    h = _fmix32(keys[:, None] ^ cols[None, :])  # [B, V]
    return _bits_to_uniform(h)


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x [B, V] float32 scaled logits -> [B, V] with the tokens top-k/top-p drop set to -inf."""
    vocab = x.shape[-1]
    sorted_x = x.sort(dim=-1, descending=True).values  # [B, V]
    k = torch.where(top_k > 0, top_k, vocab).clamp(1, vocab)  # [B]
    kth = sorted_x.gather(1, (k - 1)[:, None])  # [B, 1] value of the k-th largest
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))  # [B, V]
    probs = sorted_x.softmax(dim=-1)  # [B, V] top-k-renormalized, descending
    ahead = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # [B, V] mass strictly before each rank
    n_keep = (ahead < top_p[:, None]).sum(dim=-1).clamp(min=1)  # [B] nucleus size (a prefix)
    pth = sorted_x.gather(1, (n_keep - 1)[:, None])  # [B, 1] value of the last kept rank
    pth = torch.where(top_p[:, None] >= 1, float("-inf"), pth)  # exactly disabled at p == 1
    return x.masked_fill(x < torch.maximum(kth, pth), float("-inf"))


def sample_reference(
    logits: torch.Tensor, batch: SamplingBatch, raw_logits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (token_ids [B] int64, logprobs [B] float32).

    logits [B, V] any float dtype (computed in float32); `batch` holds the per-row parameters,
    on logits.device. logprobs is log_softmax(logits) at the chosen token (the raw
    distribution, before temperature and filters), as vLLM returns.

    Fast paths, for the caller to choose from host-side knowledge (they must not change the
    result): batch.all_greedy when every temperature is 0 (pure argmax); batch.need_sort=False
    when no row uses top-k or top-p (skips the sort).

    raw_logits [B, V] (optional): when `logits` were modified before sampling (penalties), the
    unmodified model logits; tokens are chosen from `logits`, logprobs come from `raw_logits`.

    batch.need_logprobs=False: nobody asked for logprobs; they may come back as zeros (this
    reference then skips the log-sum-exp over the vocabulary; the Triton kernel fuses it into
    its pass).
    """
    chooser = logits.float()  # [B, V]
    raw = chooser if raw_logits is None else raw_logits.float()  # [B, V]

    def logprobs(ids: torch.Tensor) -> torch.Tensor:  # [B]
        if not batch.need_logprobs:
            return torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        return raw.gather(1, ids[:, None])[:, 0] - raw.logsumexp(dim=-1)

    greedy_ids = chooser.argmax(dim=-1)  # [B]
    if batch.all_greedy:
        return greedy_ids, logprobs(greedy_ids)

    temperature = batch.temperature
    greedy = temperature <= 0  # [B]
    x = chooser / torch.where(greedy, 1.0, temperature)[:, None]  # [B, V]
    if batch.need_sort:
        x = _top_k_top_p(x, batch.top_k, batch.top_p)  # [B, V]
    probs = x.softmax(dim=-1)  # [B, V]
    pmax = probs.max(dim=-1, keepdim=True).values  # [B, 1]
    probs = probs.masked_fill(probs < batch.min_p[:, None] * pmax, 0.0)  # [B, V]
    noise = -torch.log(uniform_noise(batch.seeds, batch.steps, x.shape[-1]))  # [B, V] Exp(1)
    sampled_ids = (probs / noise).argmax(dim=-1)  # [B]

    ids = torch.where(greedy, greedy_ids, sampled_ids)  # [B]
    return ids, logprobs(ids)


_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sample(
    logits: torch.Tensor, batch: SamplingBatch, raw_logits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_reference`'s contract; runs the Triton kernel when `use_triton(logits)` (which
    always computes logprobs: they cost nothing extra there), the C++ sampler when
    `cpu_extension(logits)` is available (and the dtypes are ones it reads), else the
    reference."""
    if use_triton(logits):
        from pipellm.kernels.sampling_triton import sample_triton  # triton: imported on demand

        return sample_triton(logits, batch, raw_logits)
    ext = cpu_extension(logits)
    if ext is not None and logits.dim() == 2 and logits.dtype in _CPU_DTYPES and (
            raw_logits is None or raw_logits.dtype in _CPU_DTYPES):
        return ext.sample_rows(logits, raw_logits, batch.temperature, batch.top_p, batch.min_p,
                               batch.top_k, batch.seeds, batch.steps, batch.need_logprobs)
    return sample_reference(logits, batch, raw_logits)


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalized copy of `logits` (vLLM semantics); the input is not modified.

    logits [S, V] float32; prompt_mask [S, V] bool (token occurs in the row's prompt);
    output_counts [S, V] integer (occurrences in the row's generated tokens); presence,
    frequency, repetition [S] float32. In order:
      1. repetition, on tokens in the prompt or the output: x > 0 -> x / r, else x * r;
      2. frequency: x -= frequency * count;
      3. presence: x -= presence * (count > 0).
    Neutral values (presence 0, frequency 0, repetition 1) leave a row bit-identical. Pure
    tensor ops, no host sync.
    """
    output_mask = output_counts > 0  # [S, V]
    rep = repetition[:, None]  # [S, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)  # [S, V]
    x = torch.where(prompt_mask | output_mask, penalized, logits)  # [S, V]
    x = x - frequency[:, None] * output_counts.to(x.dtype)
    return x - presence[:, None] * output_mask.to(x.dtype)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor -> `device`; to CUDA via pinned memory and an async copy (no host sync)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] for a host list `rows`, its index uploaded by `to_device`: a list index would
    upload from pageable memory and wait for the device."""
    return t.index_select(0, to_device(torch.tensor(rows, dtype=torch.int64), t.device))


def token_stats(
    prompts: list[list[int]], outputs: list[list[int]], vocab: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row token statistics on `device`: (prompt_mask [S, V] bool, output_counts [S, V] int32).

    prompts[i] / outputs[i] are row i's prompt / generated token ids (ids in [0, vocab)). The
    2S lists go to the device as one tensor padded with the id `vocab` (a spill column dropped
    afterwards), then a single scatter_add counts every row at once.
    """
    rows = len(prompts)
    if len(outputs) != rows:
        raise ValueError(f"{rows} prompts but {len(outputs)} outputs")
    lists = prompts + outputs
    width = max(1, max((len(t) for t in lists), default=0))
    padded = [list(t) + [vocab] * (width - len(t)) for t in lists]
    ids = to_device(torch.tensor(padded, dtype=torch.int64), device)  # [2S, L]
    counts = torch.zeros(2 * rows, vocab + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:rows, :vocab] > 0, counts[rows:, :vocab]
