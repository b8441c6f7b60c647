"""Which compute process a request goes to (--data-parallel-size N > 1).

A routing policy (shared/routing.py) picks among the live compute processes from their loads:
the engine stats each one publishes to Redis (its predicted KV demand, running and waiting
requests; read at most every REFRESH_S) plus what this tokenizer sent each one since that read,
so a burst between two reads is spread too. A compute whose heartbeat is gone gets nothing
(requests already sent to it wait in its socket's queue for its restart, and the gateway
resumes what it lost). All choices of one request go to the same compute, where they share
their prompt's KV through the prefix cache.
"""

from __future__ import annotations

import time

import redis

from shared import state
from shared.length_dist import LengthDist
from shared.messages import GenerateRequest
from shared.routing import NoHealthyReplica, ReplicaLoad, RouteInfo, RoutingPolicy
from shared.transport import Sender

REFRESH_S = 0.2


class Dispatcher:
    def __init__(self, senders: list[Sender], policy: RoutingPolicy, client: redis.Redis,
                 server: str, default_len: int):
        """`senders[r]`: compute r's inbox; `client`, `server`: where their heartbeats and
        stats are (shared/state.py); `default_len`: the output length of a request without a
        prediction."""
        self.senders, self.policy, self.client = senders, policy, client
        self.server, self.default_len = server, default_len
        self.loads = [ReplicaLoad() for _ in senders]
        self._next_read = 0.0

    def send(self, gens: list[GenerateRequest]) -> int:
        """Send one request's choices to one compute; returns its rank."""
        if not gens:
            return -1
        rank = 0
        if len(self.senders) > 1:
            self._refresh()
            info = route_info(gens[0], self.default_len)
            try:
                rank = self.policy.choose(info, self.loads)
            except NoHealthyReplica:  # none beats now: the first queues it for its restart
                rank = 0
            load = self.loads[rank]
            load.demand += info.predicted_tokens * len(gens)
            load.waiting += len(gens)
        for g in gens:
            self.senders[rank].send(g)
        return rank

    def _refresh(self) -> None:
        """Loads from Redis, at most every REFRESH_S (on a Redis error: the ones we have)."""
        now = time.monotonic()
        if now < self._next_read:
            return
        self._next_read = now + REFRESH_S
        try:
            beats = list(self.client.scan_iter(match=state.service_pattern(self.server)))
            pipe = self.client.pipeline(transaction=False)
            for rank in range(len(self.senders)):
                pipe.hmget(state.stats_key(self.server, rank), "demand", "running", "waiting")
            stats = pipe.execute()
        except redis.RedisError:
            return
        live = {state.rank_of(i) for i in state.live_services(beats).get("compute", ())}
        self.loads = [ReplicaLoad(*(_int(v) for v in values), healthy=rank in live)
                      for rank, values in enumerate(stats)]


def route_info(gen: GenerateRequest, default_len: int) -> RouteInfo:
    """What routing knows of a request: its prompt, and prompt + its median predicted output
    (at most max_tokens)."""
    median = LengthDist(tuple(gen.predicted_length)).median if gen.predicted_length \
        else default_len
    prompt = tuple(gen.prompt_ids)
    return RouteInfo(prompt, len(prompt) + min(median, gen.params.max_tokens))


def _int(value) -> int:
    try:
        return int(float(value or 0))
    except ValueError:
        return 0
