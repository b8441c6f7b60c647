"""Which compute process a request goes to (--data-parallel-size N > 1).

A routing policy (pipellm/shared/routing.py) picks among the live compute processes from their
loads, read from Redis on every request: the engine stats each one publishes (its predicted KV
demand, prefill backlog, running and waiting requests) plus its `pending` counts, which every
tokenizer adds to as it routes a request and the compute settles as it publishes
(pipellm/shared/state.py). So a burst between two publications is spread, whichever tokenizers route
it. A compute whose heartbeat is gone gets nothing (requests already sent to it wait in its socket's
queue for its restart, and the gateway resumes what it lost). All choices of one request go to the
same compute, where they share their prompt's KV through the prefix cache.
"""

from __future__ import annotations

import time
from dataclasses import replace

import redis

from pipellm.shared import state
from pipellm.shared.choice import api_id
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.messages import EmbedRequest, GenerateRequest
from pipellm.shared.routing import NoHealthyReplica, ReplicaLoad, RouteInfo, RoutingPolicy
from pipellm.shared.transport import Sender

LIVENESS_S = 0.2  # how often heartbeats are scanned
RETRIES = 8  # routing attempts that may conflict with another writer


class Dispatcher:
    def __init__(self, senders: list[Sender], policy: RoutingPolicy, client: redis.Redis,
                 server: str, default_len: int):
        """`senders[r]`: compute r's inbox; `client`, `server`: where their heartbeats and
        stats are (pipellm/shared/state.py); `default_len`: the output length of a request without a
        prediction."""
        self.senders, self.policy, self.client = senders, policy, client
        self.server, self.default_len = server, default_len
        self.loads = [ReplicaLoad() for _ in senders]
        self.live: set[int] = set()  # ranks whose heartbeat is there
        self._next_liveness = 0.0
        self._turn = 0  # embeddings requests: the next live compute's turn

    def send(self, gens: list[GenerateRequest]) -> int:
        """Send one request's choices to one compute; returns its rank."""
        if not gens:
            return -1
        rank, routed = 0, 0
        if len(self.senders) > 1:
            info = route_info(gens[0], self.default_len)
            routed = info.predicted_tokens
            prompt = sum(g.prefill_tokens for g in gens)
            rank = self._route(info, len(gens), prompt, api_id(gens[0].request_id))
        for g in gens:
            self.senders[rank].send(replace(g, routed_tokens=routed) if routed else g)
        return rank

    def send_embed(self, req: EmbedRequest) -> int:
        """Send an embeddings request to a live compute, taking turns (its work is one step's
        prefill, over before the loads are published again); returns its rank."""
        rank = 0
        if len(self.senders) > 1:
            self._read_liveness()
            live = sorted(r for r in self.live if r < len(self.senders)) or [0]
            rank, self._turn = live[self._turn % len(live)], self._turn + 1
        self.senders[rank].send(req)
        return rank

    def _route(self, info: RouteInfo, count: int, prompt: int, api: str) -> int:
        """Choose a compute for `count` choices of request `api` (`prompt` tokens to prefill)
        and add them to its pending counts, atomically against the other tokenizers
        (optimistic: WATCH the stats, read, choose, add in MULTI; again if another tokenizer or
        a compute wrote meanwhile). The request's state records where it went
        (state.set_route: a restarted compute's streams are resumed, no others). Without
        Redis, or after RETRIES conflicts: by the loads last read, plus what was routed
        since."""
        self._read_liveness()
        keys = [state.stats_key(self.server, r) for r in range(len(self.senders))]
        tokens = info.predicted_tokens * count
        for _ in range(RETRIES):
            try:
                with self.client.pipeline() as pipe:
                    pipe.watch(*keys)
                    self.loads = self._read_loads(keys)
                    rank = self._choose(info)
                    pipe.multi()
                    state.add_pending(pipe, self.server, rank, tokens, prompt)
                    state.set_route(pipe, api, rank)
                    pipe.execute()
                    break
            except redis.WatchError:
                continue
            except redis.RedisError:
                rank = self._choose(info)
                break
        else:
            rank = self._choose(info)
        self.loads[rank].demand += tokens
        self.loads[rank].prefill += prompt
        self.loads[rank].waiting += count
        return rank

    def _choose(self, info: RouteInfo) -> int:
        try:
            return self.policy.choose(info, self.loads)
        except NoHealthyReplica:  # none beats now: the first queues it for its restart
            return 0

    def _read_loads(self, keys: list[str]) -> list[ReplicaLoad]:
        """Each compute's published stats plus its pending counts (demand, and prompt tokens
        to prefill), in one round trip (on another connection than the one WATCHing `keys`: a
        write after the WATCH still fails the transaction)."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(key, "demand", "running", "waiting", "prefill", "capacity", "step_tokens",
                       "pending", "pending_prompt")
        return [ReplicaLoad(_int(demand) + _int(pending), _int(running), _int(waiting),
                            healthy=rank in self.live, prefill=_int(prefill) + _int(prompt),
                            capacity=_int(capacity), step_tokens=_int(step))
                for rank, (demand, running, waiting, prefill, capacity, step, pending, prompt)
                in enumerate(pipe.execute())]

    def _read_liveness(self) -> None:
        """Which computes beat, every LIVENESS_S (on a Redis error: the last answer)."""
        now = time.monotonic()
        if now < self._next_liveness:
            return
        self._next_liveness = now + LIVENESS_S
        try:
            beats = state.read_heartbeats(self.client, self.server)
        except redis.RedisError:
            return
        self.live = {state.rank_of(i) for i in state.live_services(beats).get("compute", ())}


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
