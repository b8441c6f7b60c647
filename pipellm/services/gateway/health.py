"""Service liveness from Redis heartbeats, engine stats for /metrics, and restart handling.

A restarted compute or detokenizer has lost every request in flight, so the gateway resumes
them all (each choice continues from what its client already has, inflight.py); with several
compute processes (data parallel), a restarted one lost only the requests routed to it; a restarted
tokenizer may have lost requests it had not yet passed on, so those without any output yet are
resumed. A service that stays down longer than RESUME_TIMEOUT_S fails the requests in flight
(503: an error event on a stream) instead of letting them hang.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from pipellm.shared import state

log = logging.getLogger("pipellm.gateway")
RESUME_TIMEOUT_S = 120.0  # a model's load time and the supervisor's back-off fit well within


class Health:
    def __init__(self, client: aioredis.Redis, server: str, registry, resume, abort_ids,
                 metrics, computes: int = 1):
        """`server`: this server's id in Redis (ServiceConfig.server); `computes`: its compute
        processes (data-parallel ranks), whose engine stats /metrics shows;
        resume(only_without_output, ranks): continue lost requests (ranks: of the computes
        that restarted, None: of any); abort_ids(ids, status)."""
        self.client, self.server, self.registry, self.metrics = client, server, registry, metrics
        self.computes = computes
        self.resume, self.abort_ids = resume, abort_ids
        self.ok = self.was_ok = False  # was_ok: ready at some point (a later lapse is an outage)
        self.reason = "starting"
        self.seen: dict[str, set[str]] = {}
        self.down_since: dict[str, float] = {}  # services seen once, not live now

    async def run(self, period_s: float) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - the monitor must survive anything
                self.ok, self.reason = False, f"health check failed: {e}"
            await asyncio.sleep(period_s)

    async def refresh(self) -> None:
        try:
            keys = await self._heartbeats()
            pipe = self.client.pipeline(transaction=False)
            for rank in range(self.computes):
                pipe.hgetall(state.stats_key(self.server, rank))
            self.metrics.engines = [state.decode_hash(h) for h in await pipe.execute() if h]
        except aioredis.RedisError as e:
            self.ok, self.reason = False, f"redis unavailable: {e}"
            return
        live = state.live_services(keys)
        missing = self._missing(live)
        if self.ok and missing:
            log.warning("not ready: no heartbeat from %s; refusing requests (503) until it "
                        "beats again", ", ".join(missing))
        elif not self.ok and not missing:
            log.info("ready%s: every service beats", " again" if self.was_ok else "")
        self.ok = not missing
        self.was_ok |= self.ok
        self.reason = "ok" if self.ok else f"waiting for {', '.join(missing)}"
        await self._restarts(live)
        await self._outages(missing)
        self.seen = {s: self.seen.get(s, set()) | live.get(s, set()) for s in state.SERVICES}

    def _missing(self, live: dict[str, set[str]]) -> list[str]:
        """The services that keep the server from being ready: those with no live instance,
        and until it is first ready, compute while some rank has not beaten yet (vLLM's API
        server also waits for every data-parallel engine; requests sent earlier would all go
        to the ranks already up). Later, one live rank serves while another restarts."""
        missing = [s for s in state.SERVICES if not live.get(s)]
        ranks = {state.rank_of(i) for i in live.get("compute", ())}
        if not self.was_ok and "compute" not in missing and len(ranks) < self.computes:
            missing.append("compute")
        return missing

    async def _heartbeats(self) -> list[str]:
        """The live heartbeat keys (state.read_heartbeats, on this asyncio client)."""
        keys = list(await self.client.smembers(state.heartbeats_key(self.server)))
        live, expired = state.live_heartbeats(keys, await self.client.mget(keys) if keys else [])
        if expired:
            await self.client.srem(state.heartbeats_key(self.server), *expired)
        return live

    async def _restarts(self, live: dict[str, set[str]]) -> None:
        for service, only_without_output in (("compute", False), ("detokenizer", False),
                                             ("tokenizer", True)):
            seen = {state.rank_of(i) for i in self.seen.get(service, ())}
            # a new instance of a rank seen before (a rank's first beat is its start)
            new = {i for i in live.get(service, set()) - self.seen.get(service, set())
                   if state.rank_of(i) in seen}
            if new:
                log.warning("%s %s restarted; resuming the requests it may have lost",
                            service, ", ".join(sorted(new)))
                ranks = {state.rank_of(i) for i in new} if service == "compute" else None
                await self.resume(only_without_output, ranks)

    async def _outages(self, missing: list[str]) -> None:
        now = time.monotonic()
        self.down_since = {s: self.down_since.get(s, now) for s in missing if self.seen.get(s)}
        down = [s for s, t in self.down_since.items() if now - t > RESUME_TIMEOUT_S]
        if down and len(self.registry):
            log.warning("%s down for over %.0f s; failing the requests in flight",
                        ", ".join(down), RESUME_TIMEOUT_S)
            ids = self.registry.fail(f"the {down[0]} service is down; please retry")
            await self.abort_ids(ids, "failed")
