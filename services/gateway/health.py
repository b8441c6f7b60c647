"""Service liveness from Redis heartbeats, engine stats for /metrics, and restart handling.

A restarted compute or detokenizer has lost the state of every request in flight, so the
gateway fails them all (503, the client may retry; compute is told to abort them) instead of
letting them hang; a restarted tokenizer may have lost requests it had not yet passed on, so
those without any output yet are failed (and aborted in compute, in case they got there).
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from shared import state

log = logging.getLogger("pipellm.gateway")


class Health:
    def __init__(self, client: aioredis.Redis, registry, abort_ids, metrics):
        self.client, self.registry, self.metrics = client, registry, metrics
        self.abort_ids = abort_ids
        self.ok = False
        self.reason = "starting"
        self.seen: dict[str, set[str]] = {}

    async def run(self, period_s: float) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - the monitor must survive anything
                self.ok, self.reason = False, f"health check failed: {e}"
            await asyncio.sleep(period_s)

    async def refresh(self) -> None:
        try:
            keys = [k async for k in self.client.scan_iter(match=state.SERVICE_PATTERN)]
            self.metrics.engine = state.decode_hash(await self.client.hgetall(state.STATS_KEY))
        except aioredis.RedisError as e:
            self.ok, self.reason = False, f"redis unavailable: {e}"
            return
        live = state.live_services(keys)
        missing = [s for s in state.SERVICES if not live.get(s)]
        self.ok = not missing
        self.reason = "ok" if self.ok else f"waiting for {', '.join(missing)}"
        await self._restarts(live)
        self.seen = {s: self.seen.get(s, set()) | live.get(s, set()) for s in state.SERVICES}

    async def _restarts(self, live: dict[str, set[str]]) -> None:
        for service, only_waiting in (("compute", False), ("detokenizer", False),
                                      ("tokenizer", True)):
            new = live.get(service, set()) - self.seen.get(service, set())
            if new and self.seen.get(service):
                log.warning("%s restarted; failing requests it may have lost", service)
                ids = self.registry.fail(f"the {service} service restarted; please retry",
                                         only_waiting=only_waiting)
                await self.abort_ids(ids, "failed")
