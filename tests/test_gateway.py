"""The gateway process's logic in-process, with a real Redis and real zmq sockets, but no
other services behind it: health from heartbeats, overload, a compute restart (the request is
resumed) and a long outage (it fails)."""

from __future__ import annotations

import asyncio
import logging

import redis
import redis.asyncio as aioredis
import zmq
import zmq.asyncio

from pipellm.services.gateway import health
from pipellm.shared import codec, state
from pipellm.shared.config import EngineConfig, ServiceConfig
from pipellm.shared.redis_server import EmbeddedRedis
from tests.gateway_harness import run_gateway


def beat(url: str, service: str, instance: str, server: str = "default") -> None:
    state.heartbeat(redis.Redis.from_url(url), server, service, instance, 30)


def run_with_gateway(demo_model_dir, url, body, **svc):
    return run_gateway(EngineConfig(model=str(demo_model_dir)), url, body, **svc)


def test_health_is_503_until_every_service_beats(demo_model_dir, redis_url):
    redis.Redis.from_url(redis_url).flushall()

    async def body(gw, client):
        await gw.health.refresh()
        r = await client.get("/health")
        first = (r.status, (await r.json())["reason"])
        r = await client.post("/v1/completions", json={"prompt": "x"})
        refused = (r.status, r.headers.get("Retry-After"), (await r.json())["error"]["type"])
        for s in state.SERVICES:  # another server's services, sharing the Redis: not ours
            beat(redis_url, s, "a", server="other-8000")
        await gw.health.refresh()
        assert (await client.get("/health")).status == 503
        for s in state.SERVICES:
            beat(redis_url, s, "a")
        await gw.health.refresh()
        return first, refused, (await client.get("/health")).status

    first, refused, after = run_with_gateway(demo_model_dir, redis_url, body)
    assert first[0] == 503 and "compute" in first[1]
    assert refused == (503, "1", "service_unavailable")
    assert after == 200


def test_overload_429_restart_resumes_and_a_long_outage_fails(demo_model_dir, redis_url,
                                                              monkeypatch):
    monkeypatch.setattr(health, "RESUME_TIMEOUT_S", 0.05)
    client_redis = redis.Redis.from_url(redis_url)
    client_redis.flushall()
    for s in state.SERVICES:
        beat(redis_url, s, "a")

    async def body(gw, client):
        await gw.health.refresh()
        # a tokenizer that takes requests but never answers: the first one stays in flight
        silent = zmq.asyncio.Context.instance().socket(zmq.PULL)
        silent.connect(gw.svc.addr("tokenizer"))
        first = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}))
        while not len(gw.registry):
            await asyncio.sleep(0.01)
        r = await client.post("/v1/completions", json={"prompt": "y"})
        overload = (r.status, r.headers.get("Retry-After"), (await r.json())["error"]["code"])
        beat(redis_url, "compute", "b")  # a new compute instance: the old one's work is lost
        await gw.health.refresh()
        sent = [codec.decode(await silent.recv()) for _ in range(2)]
        # then compute is gone for longer than RESUME_TIMEOUT_S: the request fails
        client_redis.delete(*client_redis.keys(state.PREFIX + "svc:default:compute:*"))
        await gw.health.refresh()
        await asyncio.sleep(0.1)
        await gw.health.refresh()
        r = await first
        return overload, sent, r.status, (await r.json())["error"]["message"]

    overload, sent, status, message = run_with_gateway(demo_model_dir, redis_url, body,
                                                       max_pending=1)
    assert overload == (429, "1", "rate_limit_exceeded")
    original, resumed = sent
    assert original.resume == [] and original.prompt_text == "x"
    (r,) = resumed.resume  # the same request, its one choice resumed from nothing
    assert (resumed.request_id, r.index, r.attempt, list(r.output_ids), r.sent_chars) == (
        original.request_id, 0, 1, [], 0)
    assert resumed.params.seed == original.params.seed is not None  # samples as it would have
    assert status == 503 and "compute" in message and "down" in message


def test_health_reads_heartbeats_and_stats_without_scanning_the_keyspace():
    """Liveness comes from the server's set of heartbeat keys (an expired one is dropped from
    it) and engine stats from each rank's key: no SCAN, whose cost grew with every request
    Redis keeps (0.35 s a check, twice a second, at 10,000 of them)."""
    from pipellm.services.gateway.health import Health
    from pipellm.services.gateway.metrics import Metrics

    with EmbeddedRedis() as r:
        client = redis.Redis.from_url(r.url)
        for service in ("tokenizer", "compute", "detokenizer"):
            beat(r.url, service, "0.a", server="s1")
        beat(r.url, "compute", "1.b", server="s1")
        beat(r.url, "compute", "0.z", server="other")  # another server sharing this Redis
        client.sadd(state.heartbeats_key("s1"), f"{state.PREFIX}svc:s1:compute:0.old")  # expired
        for rank in (0, 1):
            state.set_stats(client, "s1", rank, {"running": rank + 2}, 30)
        client.hset(f"{state.PREFIX}req:x", "status", "finished")

        async def main():
            aclient = aioredis.Redis.from_url(r.url)
            health = Health(aclient, "s1", None, None, None, Metrics("m"), computes=2)

            async def no_scan(*a, **k):
                raise AssertionError("scanned the keyspace")

            aclient.scan = no_scan
            await asyncio.sleep(0.01)
            await health.refresh()
            return health

        health = asyncio.run(main())
        assert health.ok and health.seen["compute"] == {"0.a", "1.b"}
        assert {m.decode() for m in client.smembers(state.heartbeats_key("s1"))} == {
            f"{state.PREFIX}svc:s1:{s}:{i}" for s, i in (
                ("tokenizer", "0.a"), ("compute", "0.a"), ("detokenizer", "0.a"),
                ("compute", "1.b"))}  # the expired one dropped
        assert [e["running"] for e in health.metrics.engines] == ["2", "3"]


def test_a_lapsed_heartbeat_refuses_requests_until_it_beats_again(caplog):
    """A beat lives at least HEARTBEAT_MIN_TTL_S whatever the period (a stalled but live
    process is not a dead one); one that lapses makes the gateway refuse, with a warning that
    names the service, until it beats again."""
    from pipellm.services.gateway.health import Health
    from pipellm.services.gateway.metrics import Metrics

    with EmbeddedRedis() as r:
        client = redis.Redis.from_url(r.url)
        for service in state.SERVICES:
            state.heartbeat(client, "s1", service, "0.a", 0.2)
        compute = f"{state.PREFIX}svc:s1:compute:0.a"
        assert client.pttl(compute) > (state.HEARTBEAT_MIN_TTL_S - 0.5) * 1000

        async def main():
            health = Health(aioredis.Redis.from_url(r.url), "s1", None, None, None,
                            Metrics("m"))
            seen = []
            for step in ("beating", "lapsed", "beating again"):
                if step == "lapsed":
                    client.delete(compute)
                elif step == "beating again":
                    state.heartbeat(client, "s1", "compute", "0.a", 0.2)
                await health.refresh()
                seen.append((health.ok, health.reason))
            return seen

        with caplog.at_level(logging.INFO, logger="pipellm.gateway"):
            seen = asyncio.run(main())
    assert seen == [(True, "ok"), (False, "waiting for compute"), (True, "ok")]
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("no heartbeat from compute" in m for m in messages), messages
    ready = [m for m in messages if m.startswith("ready")]
    assert ready == ["ready: every service beats", "ready again: every service beats"], messages


def test_ready_once_every_compute_rank_beats_and_a_ranks_first_beat_is_no_restart(caplog):
    """With two data-parallel ranks the server is first ready when both beat (a rank that
    comes up later is not taken for a restart, and requests sent before it would all have gone
    to the other); a new instance of a rank seen before is a restart, whose requests are
    resumed; after that, one live rank keeps the server ready while the other restarts."""
    from pipellm.services.gateway.health import Health
    from pipellm.services.gateway.metrics import Metrics

    with EmbeddedRedis() as r:
        client = redis.Redis.from_url(r.url)
        for service in ("tokenizer", "detokenizer"):
            beat(r.url, service, "0.a", server="s1")
        beat(r.url, "compute", "1.b", server="s1")
        resumed = []

        async def resume(only_without_output, ranks):
            resumed.append(ranks)

        async def main():
            health = Health(aioredis.Redis.from_url(r.url), "s1", None, resume, None,
                            Metrics("m"), computes=2)
            seen = []
            for step in ("rank 1 only", "rank 0 too", "rank 0 restarted", "rank 1 gone"):
                if step == "rank 0 too":
                    beat(r.url, "compute", "0.a", server="s1")
                elif step == "rank 0 restarted":
                    client.delete(f"{state.PREFIX}svc:s1:compute:0.a")
                    beat(r.url, "compute", "0.c", server="s1")
                elif step == "rank 1 gone":
                    client.delete(f"{state.PREFIX}svc:s1:compute:1.b")
                await health.refresh()
                seen.append((health.ok, health.reason, list(resumed)))
            return seen

        with caplog.at_level(logging.INFO, logger="pipellm.gateway"):
            seen = asyncio.run(main())
    assert seen == [(False, "waiting for compute", []), (True, "ok", []),
                    (True, "ok", [{0}]), (True, "ok", [{0}])]
    restarts = [rec.getMessage() for rec in caplog.records if "restarted" in rec.getMessage()]
    assert restarts == ["compute 0.c restarted; resuming the requests it may have lost"]


def test_redis_client_survives_a_redis_restart():
    """A pooled connection that died with Redis is retried on a fresh one, so the first request
    after a restart is not a false 503 (it was, now and then, under load)."""
    from pipellm.services.gateway.service import redis_client

    async def roundtrips(client, n=8):  # several at once: several pooled connections
        await asyncio.gather(*(client.set(f"k{i}", i) for i in range(n)))
        return await asyncio.gather(*(client.get(f"k{i}") for i in range(n)))

    with EmbeddedRedis() as r:
        async def main():
            client = redis_client(ServiceConfig(redis_url=r.url))
            await roundtrips(client)
            r.stop()
            r.start()  # same port, fresh process: every pooled connection is dead
            return await roundtrips(client)

        assert asyncio.run(main()) == [str(i).encode() for i in range(8)]
