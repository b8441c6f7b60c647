"""Batched token sampling: the Triton kernel, same semantics as `sampling.sample_reference`.

One program per row of logits [B, V]; the row is streamed in BLOCK-wide chunks, never sorted:
  1. pass 1: max and first argmax of the chooser logits (greedy), online logsumexp of the raw
     logits (logprobs);
  2. top-k: binary search, over the order-preserving int32 image of float32 (`_okey`), of the
     largest t with count(x >= t) >= k: the k-th largest value, exactly (<= 32 passes, fewer
     as the bounds snap to data values);
  3. top-p: binary search of the smallest t >= kth whose mass strictly above it, on the
     top-k-renormalized distribution, is < top_p: the reference's `ahead < top_p` test for the
     first rank of t's tie group (<= 32 passes, snapping too; ties at the cut-off are kept,
     as there);
  4. race: p = exp(x - max) / Z over the kept tokens, min-p cut against max p = 1 / Z, u from
     the same counter hash as `uniform_noise` (uint32 arithmetic, bit-identical), token = first
     argmax of p / -log(u); logprob = raw[token] - logsumexp(raw).

Exactness: greedy ids, top-k sets and the noise are bit-exact. Sums (Z, top-p masses) run in
another order than torch's, so top-p / min-p decisions can differ only when top_p (min_p) is
within float32 rounding of a cumulative mass (probability ratio), and the race only when two
scores are within a few ulps. On CUDA, exp/log are libdevice's (what torch's kernels call);
under the interpreter, numpy's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pipellm.kernels.sampling import SamplingBatch

_NEG_INF_KEY = tl.constexpr(-2139095041)  # _okey(-inf): below the key of every other float32
_MAX_BLOCK = 2048


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _fmix32(h):  # uint32 (any shape) -> uint32: murmur3's finalizer, as sampling._fmix32
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _row_key(seed, step):  # int64 scalars -> uint32 scalar, as sampling._row_keys
    k = _fmix32(seed.to(tl.uint32) ^ 0x9E3779B9)
    k = _fmix32(k ^ (seed >> 32).to(tl.uint32) ^ 0x7F4A7C15)
    k = _fmix32(k ^ step.to(tl.uint32) ^ 0x85EBCA77)
    return _fmix32(k ^ (step >> 32).to(tl.uint32) ^ 0xC2B2AE3D)


@triton.jit
def _uniform(key, cols):  # uint32 row key, [BLOCK] int32 columns -> [BLOCK] f32 u in (0, 1)
    c = _fmix32((cols.to(tl.uint32) * 0x9E3779B1) ^ 0x68E31DA4)
    h = _fmix32(key ^ c)
    return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23, all exact


@triton.jit
def _okey(x):  # f32 -> int32, x < y <=> okey(x) < okey(y) for non-NaN x, y (-0.0 == +0.0)
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _load(row, offs, V):  # [BLOCK] offsets -> ([BLOCK] f32 logits, -inf past V; in-range mask)
    mask = offs < V
    return tl.load(row + offs, mask=mask, other=float("-inf")).to(tl.float32), mask


@triton.jit
def _load_x(row, offs, V, temp):  # -> ([BLOCK] f32 x = logits / temp, IEEE-rounded; mask)
    mask = offs < V
    c = tl.load(row + offs, mask=mask, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(c, temp), mask


@triton.jit
def _row_stats(row, raw, V, HAS_RAW: tl.constexpr, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    """-> (max, first argmax of the chooser row, logsumexp of the raw row): f32, i32, f32."""
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int32)
    m = tl.full([], float("-inf"), tl.float32)  # running max and sum of exp(r - m) of raw
    s = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)  # [BLOCK]
        c, _ = _load(row, offs, V)
        b_max = tl.max(c, axis=0)
        b_id = start + tl.argmax(c, axis=0, tie_break_left=True)
        best_id = tl.where(b_max > best, b_id, best_id)  # strict: the earlier block wins ties
        best = tl.maximum(best, b_max)
        if HAS_RAW:
            r, _ = _load(raw, offs, V)
        else:
            r = c
        m_new = tl.maximum(m, tl.max(r, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: s stays 0
        s = s * _exp(m - m_safe, PRECISE) + tl.sum(_exp(r - m_safe, PRECISE), axis=0)
        m = m_new
    return best, best_id, m + _log(s, PRECISE)


@triton.jit
def _probe(row, V, temp, m, z, t, MASS: tl.constexpr, PRECISE: tl.constexpr,
           BLOCK: tl.constexpr):
    """Split the row at okey t -> (f32 count of the x with okey(x) >= t, or with MASS their sum
    of exp(x - m) / z; int32 smallest okey >= t, 2^31 - 1 if none; largest okey < t, -2^31)."""
    stat = tl.full([], 0.0, tl.float32)  # counts are exact in f32 (V < 2^24)
    up = tl.full([], 2147483647, tl.int32)
    down = tl.full([], -2147483648, tl.int32)
    for start in range(0, V, BLOCK):
        x, mask = _load_x(row, start + tl.arange(0, BLOCK), V, temp)  # [BLOCK]
        key = _okey(x)
        above = mask & (key >= t)
        if MASS:
            w = tl.math.div_rn(_exp(x - m, PRECISE), z)
        else:
            w = tl.full([BLOCK], 1.0, tl.float32)
        stat += tl.sum(tl.where(above, w, 0.0), axis=0)
        up = tl.minimum(up, tl.min(tl.where(above, key, 2147483647), axis=0))
        down = tl.maximum(down, tl.max(tl.where(mask & (key < t), key, -2147483648), axis=0))
    return stat, up, down


@triton.jit
def _kth_key(row, V, temp, k, top, BLOCK: tl.constexpr):
    """-> int64 okey of the k-th largest x (1 <= k < V); top = okey(max x).

    Bisection on keys (< 2^32 of them: <= 32 probes), each bound snapped to the nearest data
    key on its side (the count only changes at data keys), which usually ends it far sooner.
    """
    lo = tl.full([], _NEG_INF_KEY, tl.int64)  # count(x >= -inf) = V >= k
    hi = top.to(tl.int64)  # invariant: the answer, a data key, is in [lo, hi]
    while lo < hi:
        mid = lo + ((hi - lo + 1) >> 1)  # lo < mid <= hi
        n, up, down = _probe(row, V, temp, 0.0, 1.0, mid.to(tl.int32), False, False, BLOCK)
        ok = n >= k
        lo = tl.where(ok, tl.minimum(up.to(tl.int64), hi), lo)
        hi = tl.where(ok, hi, tl.maximum(down.to(tl.int64), lo))
    return lo


@triton.jit
def _top_p_key(row, V, temp, m, kth, z, top_p, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    """-> int64 smallest okey t in [kth, okey(m)] with mass above t < top_p (z: top-k mass).

    The mass above t only changes at data keys: the bounds snap as in `_kth_key`.
    """
    lo = kth
    hi = _okey(m).to(tl.int64)  # nothing is above the max: the top-1 always stays
    while lo < hi:
        mid = lo + ((hi - lo) >> 1)  # lo <= mid < hi
        s, up, down = _probe(row, V, temp, m, z, (mid + 1).to(tl.int32), True, PRECISE, BLOCK)
        ok = s < top_p  # mass of the x with okey(x) > mid
        hi = tl.where(ok, tl.maximum(down.to(tl.int64), lo), hi)
        lo = tl.where(ok, lo, tl.minimum(up.to(tl.int64), hi))
    return lo


@triton.jit
def _kept_sum(row, V, temp, m, thr, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    """-> f32 Z = sum of exp(x - m) over the x with okey(x) >= thr."""
    z = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        x, mask = _load_x(row, start + tl.arange(0, BLOCK), V, temp)  # [BLOCK]
        z += tl.sum(tl.where(mask & (_okey(x) >= thr), _exp(x - m, PRECISE), 0.0), axis=0)
    return z


@triton.jit
def _race(row, V, temp, m, thr, z, min_p, key, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    """-> int32 first argmax of p / -log(u) over the kept tokens (score 0 elsewhere)."""
    p_min = min_p * tl.math.div_rn(1.0, z)  # min_p * max prob (the max has exp(0) = 1)
    best = tl.full([], -1.0, tl.float32)
    best_id = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)  # [BLOCK]
        x, mask = _load_x(row, offs, V, temp)
        p = tl.math.div_rn(_exp(x - m, PRECISE), z)
        keep = mask & (_okey(x) >= thr) & (p >= p_min)
        e = -_log(_uniform(key, offs), PRECISE)  # Exp(1) noise, > 0
        score = tl.where(keep, tl.math.div_rn(p, e), tl.where(mask, 0.0, -1.0))
        b_max = tl.max(score, axis=0)
        b_id = start + tl.argmax(score, axis=0, tie_break_left=True)
        best_id = tl.where(b_max > best, b_id, best_id)
        best = tl.maximum(best, b_max)
    return best_id


@triton.jit
def _sample_row(row, V, temp, cmax, k, top_p, min_p, key, NEED_SORT: tl.constexpr,
                PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    """One sampled row (temp > 0) -> int32 token id."""
    m = tl.math.div_rn(cmax, temp)  # max x: rounding is monotone
    thr = tl.full([], _NEG_INF_KEY, tl.int64)  # keep the x with okey(x) >= thr
    if NEED_SORT:
        if (k > 0) & (k < V):
            thr = _kth_key(row, V, temp, k, _okey(m), BLOCK)
    z = _kept_sum(row, V, temp, m, thr, PRECISE, BLOCK)
    if NEED_SORT:
        if top_p < 1.0:
            thr = _top_p_key(row, V, temp, m, thr, z, top_p, PRECISE, BLOCK)
            z = _kept_sum(row, V, temp, m, thr, PRECISE, BLOCK)
    return _race(row, V, temp, m, thr, z, min_p, key, PRECISE, BLOCK)


@triton.jit
def _sample_kernel(logits, raw, temps, top_ks, top_ps, min_ps, seeds, steps, out_ids, out_lps,
                   V, stride, raw_stride, HAS_RAW: tl.constexpr, ALL_GREEDY: tl.constexpr,
                   NEED_SORT: tl.constexpr, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    """Program b: row b of logits [B, V] (raw [B, V]) -> out_ids[b] int64, out_lps[b] f32."""
    b = tl.program_id(0).to(tl.int64)
    row = logits + b * stride
    raw_row = raw + b * raw_stride
    cmax, tok, lse = _row_stats(row, raw_row, V, HAS_RAW, PRECISE, BLOCK)
    if not ALL_GREEDY:
        temp = tl.load(temps + b)
        if temp > 0:
            key = _row_key(tl.load(seeds + b), tl.load(steps + b))
            tok = _sample_row(row, V, temp, cmax, tl.load(top_ks + b), tl.load(top_ps + b),
                              tl.load(min_ps + b), key, NEED_SORT, PRECISE, BLOCK)
    tl.store(out_ids + b, tok.to(tl.int64))
    tl.store(out_lps + b, tl.load(raw_row + tok).to(tl.float32) - lse)


@triton.jit
def _noise_kernel(seeds, steps, out, V, BLOCK: tl.constexpr):  # out [B, V] f32, contiguous
    b = tl.program_id(0).to(tl.int64)
    key = _row_key(tl.load(seeds + b), tl.load(steps + b))
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)  # [BLOCK]
        tl.store(out + b * V + offs, _uniform(key, offs), mask=offs < V)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[B, V] with unit column stride (a row stride of 0, from expand, is fine)."""
    return t if t.stride(1) == 1 else t.contiguous()


def _block(vocab: int) -> int:
    return min(triton.next_power_of_2(vocab), _MAX_BLOCK)


def uniform_noise_triton(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The kernel's noise, for tests: same contract as `sampling.uniform_noise` -> [B, V] f32."""
    out = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    if out.numel():
        _noise_kernel[(seeds.shape[0],)](seeds.long().contiguous(), steps.long().contiguous(),
                                         out, vocab_size, BLOCK=_block(vocab_size))
    return out


def sample_triton(
    logits: torch.Tensor, batch: SamplingBatch, raw_logits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling.sample_reference`'s contract (see there) -> (ids [B] int64, logprobs [B] f32).
    Logprobs are always computed (batch.need_logprobs is not read): they are fused into pass 1."""
    rows, vocab = logits.shape
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    lps = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return ids, lps
    chooser = _rows(logits)  # [B, V]
    block = _block(vocab)
    raw = chooser if raw_logits is None else _rows(raw_logits)  # [B, V]
    params = [t.to(dtype).contiguous() for t, dtype in (
        (batch.temperature, torch.float32), (batch.top_k, torch.int64),
        (batch.top_p, torch.float32), (batch.min_p, torch.float32), (batch.seeds, torch.int64),
        (batch.steps, torch.int64))]  # 6 x [B]
    _sample_kernel[(rows,)](
        chooser, raw, *params, ids, lps, vocab, chooser.stride(0), raw.stride(0),
        HAS_RAW=raw_logits is not None, ALL_GREEDY=batch.all_greedy, NEED_SORT=batch.need_sort,
        PRECISE=logits.is_cuda, BLOCK=block, num_warps=max(1, min(8, block // 256)),
    )
    return ids, lps
