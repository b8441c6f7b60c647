"""Routing policies: which compute replica serves a request.

Pure logic, no I/O and no clock. A policy sees what is known of a request when it arrives
(`RouteInfo`: its prompt ids and predicted KV tokens) and what the router knows of each replica
(`ReplicaLoad`), and returns the index of a healthy replica. The caller keeps the loads current:
a replica's `demand` and `prefill` must count a request from the moment it is routed there (a
router that polls its replicas adds to them itself until the replica reports), or a burst of
arrivals between two polls all go to the same replica.

- `RoundRobin`: the next healthy replica in turn.
- `CacheAware`: the SGLang router's cache-aware policy (sgl-router `cache_aware`): the replica
  whose prompts share the longest prefix with this one (an approximate record of what was routed
  where, `PrefixIndex`) when that prefix is at least `cache_threshold` of the prompt, else the
  replica holding the fewest recorded tokens; but while the running + waiting counts are
  imbalanced (max - min > `balance_abs_threshold` and max > `balance_rel_threshold` x min), the
  least loaded replica.
- `PredictedLoad`: among the replicas where the request's predicted KV fits beside the demand
  they hold (demand + `predicted_tokens` <= `capacity`: no preemption predicted), the least
  prefill backlog (the prompt tokens its first token waits behind) in whole steps
  (`step_tokens` each: within a step, backlogs make the same wait), ties by the least demand,
  then running + waiting, then index; where it fits nowhere, the least demand / capacity. With
  no capacity or backlog reported (0) this is the least predicted KV demand.
- `PredictedLoadWithAffinity`: `PredictedLoad`, except that the replica with the longest recorded
  prefix wins while the request fits there and its backlog, less the matched tokens it would
  not prefill, is within a margin of the backlog of `PredictedLoad`'s pick (`margin` x that
  one's demand, at least `min_margin` tokens): a prefix-cache hit saves its prefill now and
  keeps the conversation's next turns hitting, a small imbalance costs little. For servers
  with prefix caching on.

`make_policy(name, **kw)` builds one by name (`POLICIES`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

# tokens a PrefixIndex keeps per replica: sgl-router's max_tree_size, 2^24 characters, at about
# 4 characters a token
MAX_TOKENS = 1 << 22


@dataclass(frozen=True)
class RouteInfo:
    """What is known of a request when it is routed."""

    prompt_ids: tuple[int, ...]
    predicted_tokens: int  # prompt + the predicted output length (KV tokens it will need)


@dataclass
class ReplicaLoad:
    """What a router knows of a replica."""

    demand: int = 0  # predicted KV tokens of the requests it holds (prompt + predicted output)
    running: int = 0
    waiting: int = 0
    healthy: bool = True
    prefill: int = 0  # prompt tokens it holds not yet prefilled (a new prompt queues behind them)
    capacity: int = 0  # KV slots (0: unknown, every demand fits)
    step_tokens: int = 0  # tokens one step prefills at most (0: unknown, backlogs compared exactly)

    @property
    def backlog_steps(self) -> int:
        """The steps its prefill backlog takes: backlogs a step apart differ in the wait a new
        prompt has; within one step they do not, and demand decides."""
        return self.prefill // self.step_tokens if self.step_tokens else self.prefill

    @property
    def queued(self) -> int:
        """Requests it holds: running + waiting."""
        return self.running + self.waiting

    def fits(self, tokens: int) -> bool:
        """Whether `tokens` more predicted KV fit beside its demand (always, capacity unknown)."""
        return not self.capacity or self.demand + tokens <= self.capacity


class NoHealthyReplica(RuntimeError):
    """Every replica is unhealthy (or there are none): the request cannot be routed."""


class RoutingPolicy(Protocol):
    name: str

    def choose(self, req: RouteInfo, loads: Sequence[ReplicaLoad]) -> int:
        """The index in `loads` of a healthy replica for `req` (NoHealthyReplica if none)."""
        ...


def healthy(loads: Sequence[ReplicaLoad]) -> list[int]:
    """Indices of the healthy replicas, in order; NoHealthyReplica if there are none."""
    ok = [i for i, load in enumerate(loads) if load.healthy]
    if not ok:
        raise NoHealthyReplica(f"no healthy replica among {len(loads)}")
    return ok


class RoundRobin:
    """The healthy replica after the last one chosen, in index order."""

    name: ClassVar[str] = "round-robin"

    def __init__(self) -> None:
        self._next = 0  # where the next search starts

    def choose(self, req: RouteInfo, loads: Sequence[ReplicaLoad]) -> int:
        healthy(loads)
        n = len(loads)
        i = next(j % n for j in range(self._next, self._next + n) if loads[j % n].healthy)
        self._next = i + 1
        return i


class PrefixIndex:
    """Which prompt prefixes were routed to each replica, approximately. A prompt is cut into
    blocks of `block` tokens (the last one may be shorter), each keyed by a hash chained over the
    blocks before it, so a key stands for the whole prefix up to its block's end. Each replica
    keeps the keys it was sent in LRU order, at most `max_tokens` tokens' worth: the least
    recently routed go first, a prefix's last blocks before its first (an insert touches them
    from the last to the first), as a radix tree evicts leaves. Invariant: `_tokens[r]` is the
    sum of the block lengths `_keys[r]` holds."""

    def __init__(self, block: int = 16, max_tokens: int = MAX_TOKENS):
        if block < 1 or max_tokens < block:
            raise ValueError("need 1 <= block <= max_tokens")
        self.block, self.max_tokens = block, max_tokens
        self._keys: dict[int, OrderedDict[int, int]] = {}  # replica -> key -> block length
        self._tokens: dict[int, int] = {}

    def keys(self, prompt: Sequence[int]) -> list[tuple[int, int]]:
        """(key, block length) of each block of `prompt`, first to last."""
        out, h = [], 0
        for i in range(0, len(prompt), self.block):
            part = tuple(prompt[i : i + self.block])
            h = hash((h, part))
            out.append((h, len(part)))
        return out

    def match(self, keys: Sequence[tuple[int, int]], replica: int) -> int:
        """Tokens of the longest recorded prefix (whole blocks) at `replica`."""
        held, n = self._keys.get(replica, {}), 0
        for key, size in keys:
            if key not in held:
                break
            n += size
        return n

    def insert(self, keys: Sequence[tuple[int, int]], replica: int) -> None:
        held = self._keys.setdefault(replica, OrderedDict())
        tokens = self._tokens.get(replica, 0)
        for key, size in reversed(keys):
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = size
                tokens += size
        while tokens > self.max_tokens:
            tokens -= held.popitem(last=False)[1]
        self._tokens[replica] = tokens

    def size(self, replica: int) -> int:
        """Tokens recorded at `replica`."""
        return self._tokens.get(replica, 0)


def _least_loaded(req: RouteInfo, ok: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
    """`PredictedLoad`'s pick among the healthy `ok` (see the module docstring)."""
    fit = [i for i in ok if loads[i].fits(req.predicted_tokens)]
    if fit:
        return min(fit, key=lambda i: (loads[i].backlog_steps, loads[i].demand, loads[i].queued,
                                       i))
    return min(ok, key=lambda i: (loads[i].demand / loads[i].capacity, loads[i].queued, i))


class CacheAware:
    """SGLang router's cache-aware policy (see the module docstring); defaults are its."""

    name: ClassVar[str] = "cache-aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.0001, block: int = 16,
                 max_tokens: int = MAX_TOKENS):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.index = PrefixIndex(block, max_tokens)

    def choose(self, req: RouteInfo, loads: Sequence[ReplicaLoad]) -> int:
        ok = healthy(loads)
        keys = self.index.keys(req.prompt_ids)
        queued = [loads[i].queued for i in ok]
        lo, hi = min(queued), max(queued)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            pick = min(ok, key=lambda i: (loads[i].queued, i))
        else:
            matched = {i: self.index.match(keys, i) for i in ok}
            best = max(ok, key=lambda i: (matched[i], -i))
            if matched[best] >= self.cache_threshold * max(len(req.prompt_ids), 1):
                pick = best
            else:
                pick = min(ok, key=lambda i: (self.index.size(i), i))
        self.index.insert(keys, pick)  # recorded whichever rule chose it, as SGLang does
        return pick


class PredictedLoad:
    """Where the request fits, the least prefill backlog, then the least predicted KV demand
    (see the module docstring)."""

    name: ClassVar[str] = "predicted-load"

    def choose(self, req: RouteInfo, loads: Sequence[ReplicaLoad]) -> int:
        return _least_loaded(req, healthy(loads), loads)


class PredictedLoadWithAffinity:
    """`PredictedLoad` with prefix affinity (see the module docstring)."""

    name: ClassVar[str] = "predicted-load-affinity"

    def __init__(self, margin: float = 0.1, min_margin: int = 4096, block: int = 16,
                 max_tokens: int = MAX_TOKENS):
        self.margin, self.min_margin = margin, min_margin
        self.index = PrefixIndex(block, max_tokens)

    def choose(self, req: RouteInfo, loads: Sequence[ReplicaLoad]) -> int:
        ok = healthy(loads)
        least = _least_loaded(req, ok, loads)
        keys = self.index.keys(req.prompt_ids)
        matched = {i: self.index.match(keys, i) for i in ok}
        best = max(ok, key=lambda i: (matched[i], -loads[i].prefill, -loads[i].demand, -i))
        b, lo = loads[best], loads[least]
        slack = max(self.min_margin, self.margin * lo.demand)
        near = b.prefill - matched[best] - lo.prefill <= slack
        pick = best if matched[best] and near and b.fits(req.predicted_tokens) else least
        self.index.insert(keys, pick)
        return pick


POLICIES: dict[str, type] = {p.name: p for p in (RoundRobin, CacheAware, PredictedLoad,
                                                  PredictedLoadWithAffinity)}


def make_policy(name: str, **kw) -> RoutingPolicy:
    """A fresh policy of `name` (one of POLICIES), its settings from `kw`; ValueError listing
    the choices for an unknown name."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name](**kw)
