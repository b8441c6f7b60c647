"""The gateway process's logic in-process, with a real Redis and real zmq sockets, but no
other services behind it: health from heartbeats, overload, and a compute restart."""

from __future__ import annotations

import asyncio
import tempfile

import pytest
import redis
import zmq
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.service import build
from shared import state
from shared.config import EngineConfig, ServiceConfig
from shared.redis_server import EmbeddedRedis


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as r:
        yield r.url


def beat(url: str, service: str, instance: str) -> None:
    state.heartbeat(redis.Redis.from_url(url), service, instance, 30)


def run_with_gateway(demo_model_dir, url, body, **svc):
    async def main():
        cfg = ServiceConfig(redis_url=url, run_dir=tempfile.mkdtemp(prefix="pl-"), **svc)
        gw, _inbox = build(EngineConfig(model=str(demo_model_dir)), cfg)
        async with TestClient(TestServer(gw.app())) as client:
            return await body(gw, client)

    return asyncio.run(main())


def test_health_is_503_until_every_service_beats(demo_model_dir, redis_url):
    redis.Redis.from_url(redis_url).flushall()

    async def body(gw, client):
        await gw.health.refresh()
        r = await client.get("/health")
        first = (r.status, (await r.json())["reason"])
        r = await client.post("/v1/completions", json={"prompt": "x"})
        refused = (r.status, r.headers.get("Retry-After"), (await r.json())["error"]["type"])
        for s in state.SERVICES:
            beat(redis_url, s, "a")
        await gw.health.refresh()
        return first, refused, (await client.get("/health")).status

    first, refused, after = run_with_gateway(demo_model_dir, redis_url, body)
    assert first[0] == 503 and "compute" in first[1]
    assert refused == (503, "1", "service_unavailable")
    assert after == 200


def test_overload_gets_429_and_compute_restart_fails_inflight(demo_model_dir, redis_url):
    redis.Redis.from_url(redis_url).flushall()
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
        r = await first
        return overload, r.status, (await r.json())["error"]["message"]

    overload, status, message = run_with_gateway(demo_model_dir, redis_url, body, max_pending=1)
    assert overload == (429, "1", "rate_limit_exceeded")
    assert status == 503 and "compute" in message
