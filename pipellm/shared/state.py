"""Request state, service heartbeats and engine stats in Redis. The key layout lives here only.

    pipellm:req:<id>             hash: status (queued -> running -> finished | aborted | failed),
                                 timestamps (*_at, unix seconds), token counts, finish reasons;
                                 expires request_ttl_s after the request ends
    pipellm:svc:<server>:<service>:<instance>   heartbeat, expires after a few missed beats
                                 and never under HEARTBEAT_MIN_TTL_S
    pipellm:svcs:<server>        set: the names of that server's heartbeat keys (each beat adds
                                 its own; readers drop those that expired; the set expires a
                                 while after the last beat), so liveness is read without
                                 scanning the keyspace, which holds every request of the last
                                 request_ttl_s
    pipellm:stats:<server>:<rank>   hash: a compute engine's gauges and counters (rank: its
                                 data-parallel rank); expires after a few missed beats
    pipellm:resp:<id>            hash: a stored Responses API response (its object, request,
                                 input items, state); expires --responses-store-ttl after its
                                 last write
    pipellm:resp:<id>:deltas     list: a background response's output, delta by delta
    pipellm:resp-running:<server>   set: the background responses that server runs

Several servers may share one Redis (behind a router): request ids are unique, the length
predictor is shared on purpose, and heartbeats and engine stats are scoped by the server's
id (`--server-id`: by default host-port), so each gateway watches its own services only.

Writers queue commands on a pipeline (sync or asyncio; the same functions serve both) and
execute it once per batch, never a round trip per token.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger("pipellm.state")

PREFIX = "pipellm:"
SERVICES = ("tokenizer", "compute", "detokenizer")  # besides the gateway itself
HEARTBEAT_MIN_TTL_S = 3.0  # a live process on a loaded machine may miss beats that long (an
# AOF fsync stalling Redis, the OS sharing two busy cores): short periods keep stats and
# restarts quick without such a stall reading as a dead service


def fast_client(url: str, timeout_s: float = 0.2) -> redis.Redis:
    """A client for work that must not wait on a dead Redis (length predictions and updates):
    short timeouts, no retries; its callers fall back instead."""
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0))


def req_key(request_id: str) -> str:
    return f"{PREFIX}req:{request_id}"


def set_request(pipe, request_id: str, ttl_s: int | None = None, **fields: Any) -> None:
    """Queue an update of a request's hash; with ttl_s, it expires that long after now."""
    key = req_key(request_id)
    pipe.hset(key, mapping={k: _str(v) for k, v in fields.items()})
    if ttl_s is not None:
        pipe.expire(key, ttl_s)


def incr_request(pipe, request_id: str, name: str, amount: int) -> None:
    pipe.hincrby(req_key(request_id), name, amount)


def set_route(pipe, request_id: str, rank: int) -> None:
    """Queue recording that request `request_id` (an API id) went to compute `rank`: its
    `rank` now, and `routed_<rank>` counts the times it went there."""
    incr_request(pipe, request_id, f"routed_{rank}", 1)
    pipe.hset(req_key(request_id), "rank", rank)


def resp_key(response_id: str) -> str:
    return f"{PREFIX}resp:{response_id}"


def resp_deltas_key(response_id: str) -> str:
    return f"{PREFIX}resp:{response_id}:deltas"


def resp_running_key(server: str) -> str:
    return f"{PREFIX}resp-running:{server}"


def heartbeat(pipe, server: str, service: str, instance: str, ttl_s: float) -> None:
    key = f"{PREFIX}svc:{server}:{service}:{instance}"
    ttl_s = max(ttl_s, HEARTBEAT_MIN_TTL_S)
    pipe.set(key, str(time.time()), px=int(ttl_s * 1000))
    pipe.sadd(heartbeats_key(server), key)
    pipe.expire(heartbeats_key(server), max(int(ttl_s * 10), 60))  # gone with the server


def heartbeats_key(server: str) -> str:
    """Set of a server's heartbeat keys, live or expired (`live_heartbeats` tells which)."""
    return f"{PREFIX}svcs:{server}"


def read_heartbeats(client: redis.Redis, server: str) -> list[str]:
    """A server's live heartbeat keys, read with a sync client (the expired ones dropped from
    its set); pipellm/services/gateway/health.py reads them the same way with an asyncio one."""
    keys = list(client.smembers(heartbeats_key(server)))
    live, expired = live_heartbeats(keys, client.mget(keys) if keys else [])
    if expired:
        client.srem(heartbeats_key(server), *expired)
    return live


def live_heartbeats(keys, values) -> tuple[list[str], list[str]]:
    """(live, expired) of a server's heartbeat keys (SMEMBERS heartbeats_key), given their
    values (MGET of them: None where a key expired). The caller SREMs the expired."""
    live, expired = [], []
    for key, value in zip(keys, values, strict=True):
        (live if value is not None else expired).append(_s(key))
    return live, expired


def lora_key(server: str) -> str:
    """Hash of the LoRA adapters loaded at run time on `server`: name -> path (every service
    start loads them: a restarted compute, a restarted gateway lists them)."""
    return f"{PREFIX}lora:{server}"


def stats_key(server: str, rank: int = 0) -> str:
    return f"{PREFIX}stats:{server}:{rank}"


def set_stats(pipe, server: str, rank: int, stats: dict[str, Any], ttl_s: float) -> None:
    key = stats_key(server, rank)
    pipe.hset(key, mapping={k: _str(v) for k, v in stats.items()})
    pipe.expire(key, max(int(ttl_s), 1))


# Routed demand a compute has not yet published (data parallel): tokenizers add a request's
# predicted KV tokens (`pending`) and its tokens to prefill (`pending_prompt`) to its compute's
# stats hash when they route it (`add_pending`); the compute takes them off in the same
# transaction as it publishes a `demand` and a `prefill` backlog that count them
# (`settle_pending`, never below 0). So `demand + pending` and `prefill + pending_prompt` count
# every request routed there, whichever tokenizer routed it, those still in its socket too.
_PENDING = ("pending", "pending_prompt")
_SETTLE = """
for i = 1, #ARGV, 2 do
  if redis.call('HINCRBY', KEYS[1], ARGV[i], -tonumber(ARGV[i + 1])) < 0 then
    redis.call('HSET', KEYS[1], ARGV[i], 0)
  end
end
"""  # ARGV: field, amount, field, amount...


def add_pending(pipe, server: str, rank: int, tokens: int, prompt: int) -> None:
    """Queue (or run, on a client) adding a routed request: `tokens` of predicted KV demand,
    `prompt` tokens to prefill."""
    for field, n in zip(_PENDING, (tokens, prompt), strict=True):
        pipe.hincrby(stats_key(server, rank), field, n)


def settle_pending(pipe, server: str, rank: int, tokens: int, prompt: int) -> None:
    """Queue taking what the compute received since its last publication off its pending
    counts, clamped at 0 (after reset_pending, a request sent before the restart is taken off
    what was zeroed)."""
    pipe.eval(_SETTLE, 1, stats_key(server, rank),
              *(x for pair in zip(_PENDING, (tokens, prompt), strict=True) for x in pair))


def reset_pending(client, server: str, rank: int) -> None:
    """A (re)started compute: what its predecessor received and never settled is gone."""
    client.hset(stats_key(server, rank), mapping=dict.fromkeys(_PENDING, 0))


def rank_of(instance: str) -> int:
    """The data-parallel rank of a heartbeat's instance (Heartbeat's `rank`)."""
    return int(instance.split(".", 1)[0]) if "." in instance else 0


def live_services(keys: list[str]) -> dict[str, set[str]]:
    """Live heartbeat keys of one server (`live_heartbeats`) -> {service: {instances}}."""
    out: dict[str, set[str]] = {}
    for key in keys:
        service, instance = key.rsplit(":", 2)[1:]
        out.setdefault(service, set()).add(instance)
    return out


def decode_hash(raw: dict) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in raw.items()}


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _str(v: Any) -> str:
    return "" if v is None else str(v)


class Heartbeat:
    """Tells Redis (and so the gateway's /health) that a service instance is alive.

    A daemon thread writes the key every period, so a long engine step does not look like a
    dead process (torch's ops and the C++ kernels release the GIL while they compute). A Redis
    outage is logged, not raised; beats resume when Redis is back.
    """

    def __init__(self, client: redis.Redis, server: str, service: str, period_s: float,
                 rank: int = 0):
        """`rank`: a compute process's data-parallel rank, the instance's first part."""
        self.client, self.server, self.service = client, server, service
        self.period_s = period_s
        self.instance = f"{rank}.{uuid.uuid4().hex[:8]}"
        threading.Thread(target=self._run, name=f"heartbeat-{service}", daemon=True).start()

    def _run(self) -> None:
        healthy = True
        while True:
            try:
                pipe = self.client.pipeline(transaction=False)
                heartbeat(pipe, self.server, self.service, self.instance, 4 * self.period_s)
                pipe.execute()
                healthy = True
            except redis.RedisError as e:
                if healthy:
                    log.warning("%s: redis unavailable: %s", self.service, e)
                healthy = False
            time.sleep(self.period_s)
