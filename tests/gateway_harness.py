"""A gateway built in this process, no other service running: its aiohttp app under aiohttp's
test client, for the tests that drive the gateway's HTTP side alone."""

from __future__ import annotations

import asyncio
import tempfile

from aiohttp.test_utils import TestClient, TestServer

from services.gateway.service import build
from shared.config import EngineConfig, ServiceConfig


def run_gateway(engine: EngineConfig, redis_url: str, body, *, refresh: bool = False, **svc):
    """What `await body(gw, client)` returns, against a gateway of `engine` on `redis_url` in a
    temporary run dir; `refresh`: its health read from Redis first; `svc`: ServiceConfig
    fields."""
    async def main(run_dir: str):
        gw, _inbox = build(engine, ServiceConfig(redis_url=redis_url, run_dir=run_dir, **svc))
        if refresh:
            await gw.health.refresh()
        async with TestClient(TestServer(gw.app())) as client:
            return await body(gw, client)

    with tempfile.TemporaryDirectory(prefix="pl-") as run_dir:
        return asyncio.run(main(run_dir))
