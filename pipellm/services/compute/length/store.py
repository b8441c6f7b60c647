"""Where the length head's statistics live: in Redis (shared by every replica, kept across
restarts) or in memory (an engine run in-process without Redis).

Each head (stage) has its own store. Redis layout, under
`pipellm:lenhead:v3:<model>:<stage>:r<probe width>` (v3: the raw hidden state by default; the
width names the feature layout, so a different configuration never mixes its statistics with
these): `...:base`, the compacted `HeadStats` blob, and `...:deltas`, a list of blobs not yet
folded in. A writer `RPUSH`es its delta (atomic: no count is ever lost, whatever the number of
writers) under an id of its own, which a script marks in `...:push:<id>` first: a push retried
after an error that hid its success lands once. A reader sums base and deltas, and folds them
into base once there are `compact_at` of them, in a WATCH/MULTI transaction over both keys,
retried if any other writer touched them meanwhile.
Every push also increments `...:version`; a reader that finds it unchanged since its last load
reuses what it loaded (the refining head's statistics over the raw hidden state are ~2.7 MB).
"""

from __future__ import annotations

import logging

import redis

from pipellm.services.compute.length.head import STAGES, HeadStats
from pipellm.shared.length_predictor import model_key

log = logging.getLogger(__name__)


def length_head_key(model: str, stage: str, dim: int) -> str:
    """The Redis key prefix of a model's head statistics for one stage: every replica serving
    the same model with the same probe shares it (the probe's seed is fixed, so its width
    names it)."""
    return f"pipellm:lenhead:v3:{model_key(model)}:{stage}:r{dim}"


PUSH_TTL_S = 600  # how long Redis remembers a push's id: its retry comes with the next sync
# KEYS: the push's id mark, deltas, version; ARGV: the delta, PUSH_TTL_S
_PUSH_ONCE = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[2]) then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  redis.call('INCR', KEYS[3])
end
return 1
"""


class MemoryStore:
    """The statistics in this process only."""

    def __init__(self):
        self.stats: HeadStats | None = None

    def add(self, delta: HeadStats, push_id: str = "") -> None:
        """Add `delta` (in memory a push cannot fail, so its id is not needed)."""
        if self.stats is None:
            self.stats = HeadStats(delta.gram.copy(), delta.cross.copy(), delta.requests)
        else:
            self.stats += delta

    def load(self) -> HeadStats | None:
        return self.stats


class RedisStore:
    """The statistics in Redis (a redis-py client with bytes replies). Errors propagate; the
    refiner treats a failed call as no update."""

    def __init__(self, client: redis.Redis, key: str, compact_at: int = 8):
        self.client, self.compact_at = client, compact_at
        self.base_key, self.deltas_key = f"{key}:base", f"{key}:deltas"
        self.version_key = f"{key}:version"
        self.push_key = f"{key}:push:"
        self.loaded: tuple[bytes, HeadStats | None] | None = None  # (version, what it was)
        self._push_once = client.register_script(_PUSH_ONCE)

    def add(self, delta: HeadStats, push_id: str) -> None:
        """Add `delta` once under `push_id`: a second push of the same id changes nothing."""
        self._push_once(keys=[self.push_key + push_id, self.deltas_key, self.version_key],
                        args=[delta.to_bytes(), PUSH_TTL_S])

    def load(self) -> HeadStats | None:
        """The sum of every push so far (None: none); the same object while nobody pushed."""
        version = self.client.get(self.version_key)  # read first: a later push reloads
        if version is not None and self.loaded is not None and self.loaded[0] == version:
            return self.loaded[1]
        total = self._load()
        self.loaded = (version, total) if version is not None else None
        return total

    def _load(self) -> HeadStats | None:
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(self.base_key, self.deltas_key)
                    base, deltas = pipe.get(self.base_key), pipe.lrange(self.deltas_key, 0, -1)
                    total = _sum([base, *deltas] if base else deltas)
                    if total is not None and len(deltas) >= self.compact_at:
                        pipe.multi()
                        pipe.set(self.base_key, total.to_bytes())
                        pipe.ltrim(self.deltas_key, len(deltas), -1)
                        pipe.execute()
                    return total
                except redis.WatchError:
                    continue

    def clear(self) -> None:
        self.client.delete(self.base_key, self.deltas_key, self.version_key)
        self.loaded = None


def redis_stores(client: redis.Redis, model: str, dim: int) -> dict[str, RedisStore]:
    """Stage -> its store in Redis, given the probe's width."""
    return {stage: RedisStore(client, length_head_key(model, stage, dim)) for stage in STAGES}


def memory_stores(dim: int | None = None) -> dict[str, MemoryStore]:
    """Stage -> its store in this process (`dim` as redis_stores', unused)."""
    return {stage: MemoryStore() for stage in STAGES}


def _sum(blobs: list[bytes]) -> HeadStats | None:
    total = None
    for blob in blobs:
        stats = HeadStats.from_bytes(blob)
        if total is None:
            total = stats
        elif stats.dim == total.dim:
            total += stats
        else:
            log.warning("length head stats of dimension %d ignored (expected %d)", stats.dim,
                        total.dim)
    return total
