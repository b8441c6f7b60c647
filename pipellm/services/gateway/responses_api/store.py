"""Stored responses in Redis (pipellm/shared/state.py's keys): what `store: true` keeps for
previous_response_id, GET, cancel and delete, and what a background response writes as it
runs, so that a poller, a reattached stream or a restarted gateway can read it.

A record: the Response object, the request that made it (body, history, seed: enough to make it
again), its conversation's input items, its state, and the server running it (background).
A background response's output is a list of delta records ({"r": reasoning, "t": text, "ids":
token ids, "lp": logprobs}, then one {"end": status, ...}), from which its events are derived
again at will (output.ResponseOutput is deterministic). Every write renews the TTL.
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis

from pipellm.services.gateway.errors import unavailable
from pipellm.shared import state

TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})


def _dump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class ResponseStore:
    def __init__(self, client: aioredis.Redis, ttl_s: int, max_bytes: int, server: str):
        self.redis, self.ttl_s, self.max_bytes, self.server = client, ttl_s, max_bytes, server

    async def _run(self, pipe) -> list:
        try:
            return await pipe.execute()
        except aioredis.RedisError:
            raise unavailable("The response store (Redis) is unavailable.") from None

    async def save(self, response: dict, request: dict | None = None,
                   input_items: list[dict] | None = None) -> bool:
        """Write (or update) a record; False when it is over the size cap (not stored)."""
        fields = {"response": _dump(response), "state": response["status"]}
        if request is not None:
            fields["request"] = _dump(request)
        if input_items is not None:
            fields["input"] = _dump(input_items)
        if sum(len(v) for v in fields.values()) > self.max_bytes:
            return False
        key = state.resp_key(response["id"])
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping=fields)
        pipe.expire(key, self.ttl_s)
        await self._run(pipe)
        return True

    async def load(self, response_id: str) -> dict | None:
        """{"response", "request", "input", "state"} decoded, or None."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(state.resp_key(response_id))
        raw = (await self._run(pipe))[0]
        if not raw:
            return None
        out = {k.decode(): v.decode() for k, v in raw.items()}
        for key in ("response", "request", "input"):
            out[key] = json.loads(out[key]) if key in out else None
        return out

    async def delete(self, response_id: str) -> bool:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(state.resp_key(response_id), state.resp_deltas_key(response_id))
        pipe.srem(state.resp_running_key(self.server), response_id)
        return bool((await self._run(pipe))[0])

    async def push(self, response_id: str, *records: dict) -> None:
        """Append a background response's delta (or end) records."""
        key = state.resp_deltas_key(response_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.rpush(key, *(_dump(r) for r in records))
        pipe.expire(key, self.ttl_s)
        pipe.expire(state.resp_key(response_id), self.ttl_s)
        await self._run(pipe)

    async def records(self, response_id: str, start: int = 0) -> list[dict]:
        """Its delta records from `start` on."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.lrange(state.resp_deltas_key(response_id), start, -1)
        return [json.loads(r) for r in (await self._run(pipe))[0]]

    async def running(self, response_id: str, on: bool) -> None:
        """Mark a background response as run by this server (or no longer)."""
        pipe = self.redis.pipeline(transaction=False)
        key = state.resp_running_key(self.server)
        (pipe.sadd if on else pipe.srem)(key, response_id)
        await self._run(pipe)

    async def running_ids(self) -> list[str]:
        pipe = self.redis.pipeline(transaction=False)
        pipe.smembers(state.resp_running_key(self.server))
        return sorted(r.decode() for r in (await self._run(pipe))[0])
