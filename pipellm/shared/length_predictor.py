"""The output-length predictor: per-feature length histograms in Redis, learned online.

Every finished request adds its output length to the global histogram and to the histogram of
each of its features (`pipellm.shared.length_features`); a prediction pools histograms into one
distribution over lengths and returns its quantiles as a `LengthDist`.

Storage. All state is in Redis, so every process and replica reads the same model and a restart
of any process loses nothing. One Redis string per histogram: `NB` bucket counters and a total,
unsigned 32-bit, written with `BITFIELD ... INCRBY` (saturating). Feature ids fold into `slots`
keys (default 2**18, <= 168 bytes each), and a sorted set ranks the slots by support (trimmed to
`TOP_KEEP` when it passes `TOP_CAP`), so the key count is bounded whatever the traffic. Keys:
`<prefix>:v1:<model>:g` (global), `...:f:<slot>` (features), `...:top` (support ranking).
`update` is one Lua script (one round trip; atomic on the server, so concurrent writers lose no
count and a reader never sees half an update); `predict` is one read-only Lua script (one round
trip) plus ~100 us of numpy, and a pure function of the Redis state.

Buckets: lengths 1..5 exactly, then log-spaced (x1.3 per bucket) up to 76,099 (`EDGES`); longer
lengths count in the last bucket.

The model is log-linear pooling of histogram "experts" (a Naive-Bayes-like model over length
buckets, tempered): the global histogram, smoothed toward a lognormal prior around
`default_len` (`prior_weight` pseudo-counts), with weight `global_weight`; each present feature's
histogram, smoothed toward the global one (`alpha` pseudo-counts); and for each of the `top_k`
most frequent features that the request does *not* have, the complement histogram (global minus
that feature's): the absence of a frequent marker ("in one word", a template) is evidence too.
Each expert weighs m / (m + `support_k`) (m: its support) times its informativeness
KL(expert || global) ** `kl_power`, less `kl_bias` x the Miller-Madow bias (nonzero buckets - 1)
/ 2m that a few samples show by chance, floored at 0: uninformative features drop out and
well-supported features whose lengths differ from the rest dominate. The result is the
weighted geometric mean, normalized (never sharper than its sharpest expert). On the ShareGPT
samples (bench/length_predictor.py) this matched or beat arithmetic mixtures of the same
histograms, an untempered product of experts (over-confident) and online linear regression on
log length (whose residual width is global, so it cannot narrow the distribution for a sharp
template); prompt words predict little there. Without the complements, "no marker" could not
be learned; without the bias term, dozens of rarely seen words outvote one strong marker.

Cold start: no finished request yet gives `LengthDist.point(min(default_len, max_tokens))`;
then global statistics (with the prior); features join as they gain support.
"""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_right
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import redis

from pipellm.shared.length_dist import LEVELS, LengthDist
from pipellm.shared.length_features import length_features

__all__ = ["EDGES", "NB", "LengthPredictor", "bucket_of", "length_features"]

log = logging.getLogger(__name__)


def _edges(growth: float = 1.3, top: int = 65536) -> tuple[int, ...]:
    e = [1]
    while e[-1] < top:
        e.append(max(e[-1] + 1, round(e[-1] * growth)))
    return tuple(e)


EDGES = _edges()  # bucket b holds lengths in [EDGES[b], EDGES[b + 1])
NB = len(EDGES) - 1
_HIST_BYTES = 4 * (NB + 1)  # NB bucket counters, then the total
_HI = np.array(EDGES[1:], dtype=np.float64)
_LO = np.array(EDGES[:-1], dtype=np.float64)
_LEVELS = np.array(LEVELS)
TOP_CAP, TOP_KEEP = 2048, 1024
MARK_TTL_S = 600  # how long Redis remembers a sample's id: its retry comes with the next update
MAX_UNSENT = 4096  # samples with ids kept for a retry while Redis fails; beyond, the oldest go
_ERROR_LOG_INTERVAL_S = 30.0

# KEYS: global, top, the sample's mark, feature keys; ARGV: bucket offset, total offset, cap,
# keep, the mark's ttl (0: no mark), feature slots. A marked sample already seen changes nothing.
_UPDATE_LUA = """
if tonumber(ARGV[5]) > 0 and not redis.call('SET', KEYS[3], '1', 'NX', 'EX', ARGV[5]) then
  return 0
end
local b, t = ARGV[1], ARGV[2]
redis.call('BITFIELD', KEYS[1], 'OVERFLOW', 'SAT', 'INCRBY', 'u32', b, 1, 'INCRBY', 'u32', t, 1)
for i = 4, #KEYS do
  local r = redis.call('BITFIELD', KEYS[i], 'OVERFLOW', 'SAT', 'INCRBY', 'u32', b, 1,
                       'INCRBY', 'u32', t, 1)
  redis.call('ZADD', KEYS[2], r[2], ARGV[i + 2])
end
if redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[3]) then
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -tonumber(ARGV[4]) - 1)
end
return 1
"""
# KEYS: global, top, feature keys; ARGV: top_k, feature key prefix, bytes per histogram.
# Returns three strings of concatenated histograms, each padded to full length: the global one
# ("" if none yet), the present features' (missing ones left out), and those of the top_k most
# frequent features that are not present.
_PREDICT_LUA = """
local size = tonumber(ARGV[3])
local function pad(s)
  if not s then return nil end
  if #s < size then return s .. string.rep('\\0', size - #s) end
  return string.sub(s, 1, size)
end
local raws = redis.call('MGET', KEYS[1], unpack(KEYS, 3))
local present, seen = {}, {}
for i = 2, #raws do
  local s = pad(raws[i])
  if s then present[#present + 1] = s end
end
for i = 3, #KEYS do seen[KEYS[i]] = true end
local absent = {}
if tonumber(ARGV[1]) > 0 then
  local keys = {}
  for _, slot in ipairs(redis.call('ZREVRANGE', KEYS[2], 0, tonumber(ARGV[1]) - 1)) do
    local key = ARGV[2] .. slot
    if not seen[key] then keys[#keys + 1] = key end
  end
  if #keys > 0 then
    for _, r in ipairs(redis.call('MGET', unpack(keys))) do
      local s = pad(r)
      if s then absent[#absent + 1] = s end
    end
  end
end
return {pad(raws[1]) or '', table.concat(present), table.concat(absent)}
"""


def bucket_of(length: int) -> int:
    """The histogram bucket of an output length (>= 1)."""
    return min(bisect_right(EDGES, max(int(length), 1)) - 1, NB - 1)


def _hist(blob: bytes) -> np.ndarray:
    """[n, NB] bucket counts of n concatenated full-length histogram strings."""
    return np.frombuffer(blob, dtype=">u4").reshape(-1, NB + 1)[:, :NB].astype(np.float64)


class LengthPredictor:
    """Predicts a request's output-length distribution from its features; learns from finishes.

    `client`: a redis-py client with bytes replies (not `decode_responses`). With `strict=False`
    (the default) a Redis error makes `predict` return the cold-start default and an update drop
    its samples, or keep them for the next call when they have ids (logged at most every 30 s):
    a length prediction never fails a request. How long a call waits for a dead Redis is the
    client's timeout and retry policy. Thread-safe as far as the client is, except updates with
    ids (one thread makes those).
    """

    def __init__(self, client: redis.Redis, model: str = "", *, prefix: str = "pipellm:lenpred",
                 default_len: int = 128, slots: int = 1 << 18, top_k: int = 32,
                 alpha: float = 2.0, support_k: float = 5.0, kl_power: float = 1.0,
                 global_weight: float = 0.1, prior_weight: float = 1.0, prior_sigma: float = 1.0,
                 kl_bias: float = 2.0, strict: bool = False):
        if slots < 1 or default_len < 1 or top_k < 0:
            raise ValueError("need slots >= 1, default_len >= 1, top_k >= 0")
        self.client = client
        self.model = model
        self.default_len = int(default_len)
        self.slots, self.top_k = int(slots), int(top_k)
        self.alpha, self.support_k, self.kl_power = alpha, support_k, kl_power
        self.global_weight, self.kl_bias = global_weight, kl_bias
        self.strict = strict
        base = f"{prefix}:v1:{model or '-'}"
        self._base = base
        self.global_key, self.top_key = f"{base}:g", f"{base}:top"
        self._feature_prefix = f"{base}:f:"
        # the global histogram's prior: a discretized lognormal around default_len, plus a
        # floor that keeps every log finite
        mid = np.log(np.sqrt(_LO * _HI))
        prior = np.exp(-0.5 * ((mid - math.log(self.default_len)) / prior_sigma) ** 2)
        self._prior = prior_weight * (prior / prior.sum()) + 1e-6
        self._last_error_log = -math.inf
        self._unsent: list[tuple[str, tuple[Sequence[int], int]]] = []  # (id, sample) to resend
        self._update_script = client.register_script(_UPDATE_LUA)
        self._predict_script = client.register_script(_PREDICT_LUA)

    def _slots(self, features: Sequence[int]) -> list[int]:
        return list(dict.fromkeys(int(f) % self.slots for f in features))

    def feature_key(self, feature: int) -> str:
        return f"{self._feature_prefix}{int(feature) % self.slots}"

    # -- predict -------------------------------------------------------------------------------

    def predict(self, features: Sequence[int], max_tokens: int) -> LengthDist:
        """The predicted output-length distribution; every value in [1, max_tokens]."""
        slots = self._slots(features)
        keys = [self.global_key, self.top_key, *(f"{self._feature_prefix}{s}" for s in slots)]
        try:
            blobs = self._predict_script(
                keys=keys, args=[self.top_k, self._feature_prefix, _HIST_BYTES])
        except redis.RedisError as e:
            if self.strict:
                raise
            self._log_error("predict", e)
            blobs = [b"", b"", b""]
        return self._pool(*blobs, max_tokens)

    def _pool(self, global_blob: bytes, present_blob: bytes, absent_blob: bytes,
              max_tokens: int) -> LengthDist:
        cap = max(int(max_tokens), 1)
        if not global_blob or (g := _hist(global_blob)[0]).sum() == 0:
            return LengthDist.point(min(self.default_len, cap))
        pg = g + self._prior
        pg /= pg.sum()
        lpg = np.log(pg)
        acc, total_w = self.global_weight * lpg, self.global_weight
        rows = []
        if present_blob:
            rows.append(_hist(present_blob))
        if absent_blob:
            rows.append(np.maximum(g - _hist(absent_blob), 0.0))  # complements
        if rows:
            c = np.concatenate(rows) if len(rows) > 1 else rows[0]
            m = c.sum(axis=1)
            ph = (c + self.alpha * pg) / (m + self.alpha)[:, None]
            lph = np.log(ph)
            kl = (ph * (lph - lpg)).sum(axis=1)
            if self.kl_bias:  # Miller-Madow: a few samples look informative by chance
                kl -= self.kl_bias * ((c > 0).sum(axis=1) - 1) / (2 * (m + self.alpha))
            kl = np.maximum(kl, 0.0)
            w = m / (m + self.support_k) * kl**self.kl_power
            acc = acc + w @ lph
            total_w += float(w.sum())
        return _quantiles(np.exp((acc - acc.max()) / total_w), cap)

    # -- update --------------------------------------------------------------------------------

    def update(self, features: Sequence[int], output_len: int) -> None:
        """Learn one finished request: its true output length (tokens generated, >= 1)."""
        self.update_many([(features, output_len)])

    def update_many(self, finished: Sequence[tuple[Sequence[int], int]],
                    ids: Sequence[str] | None = None) -> None:
        """Learn several finished requests `(features, output length)` in one round trip (one
        atomic script call each, pipelined). With `ids` (one per request, unique), each is
        learned once: samples a failed call may or may not have applied are sent again with
        the next call that has ids, and Redis skips the ids it has seen."""
        marked = ids is not None
        batch = [*self._unsent, *zip(ids, finished, strict=True)] if marked else \
            [("", f) for f in finished]
        if not batch:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for sample_id, (features, output_len) in batch:
                slots = self._slots(features)
                keys = [self.global_key, self.top_key, f"{self._base}:seen:{sample_id}",
                        *(f"{self._feature_prefix}{s}" for s in slots)]
                args = [f"#{bucket_of(output_len)}", f"#{NB}", TOP_CAP, TOP_KEEP,
                        MARK_TTL_S if marked else 0, *slots]
                self._update_script(keys=keys, args=args, client=pipe)
            pipe.execute()
            self._unsent = []
        except redis.RedisError as e:
            if marked:
                self._unsent = batch[-MAX_UNSENT:]
            if self.strict:
                raise
            self._log_error("update", e)

    # -- inspection ----------------------------------------------------------------------------

    def counts(self, feature: int | None = None) -> list[int]:
        """Bucket counts of the global histogram (feature None) or of one feature's slot."""
        key = self.global_key if feature is None else self.feature_key(feature)
        raw = (self.client.get(key) or b"").ljust(_HIST_BYTES, b"\0")
        return [int(x) for x in _hist(raw)[0]]

    def clear(self) -> int:
        """Delete this model's state; returns how many keys went."""
        n, batch = 0, []
        for key in self.client.scan_iter(match=f"{self._base}:*", count=1000):
            batch.append(key)
            if len(batch) == 1000:
                n, batch = n + self.client.unlink(*batch), []
        return n + (self.client.unlink(*batch) if batch else 0)

    def _log_error(self, what: str, e: Exception) -> None:
        now = time.monotonic()
        if now - self._last_error_log >= _ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.warning("length predictor %s failed (%s); using the default", what, e)


def _quantiles(p: np.ndarray, cap: int) -> LengthDist:
    """Quantiles at LEVELS of a bucket distribution (log-linear inside a bucket), capped."""
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    b = np.minimum(np.searchsorted(cdf, _LEVELS * (1 - 1e-12)), NB - 1)
    prev = np.where(b > 0, cdf[b - 1], 0.0)
    frac = np.clip((_LEVELS - prev) / np.maximum(cdf[b] - prev, 1e-300), 0.0, 1.0)
    lo, hi = _LO[b], _HI[b]
    x = np.minimum(np.ceil(lo * (hi / lo) ** frac - 1e-9), hi - 1)
    out, last = [], 1
    for v in x.tolist():
        last = max(last, min(int(v), cap))
        out.append(last)
    return LengthDist(tuple(out))


def model_key(model_dir: str) -> str:
    """The model as the predictor knows it: its directory's name, the same on every replica
    (the built-in demo model when empty)."""
    return Path(model_dir).name if model_dir else "demo"
