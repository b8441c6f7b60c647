"""A gateway built in this process, no other service running: its aiohttp app under aiohttp's
test client, for the tests that drive the gateway's HTTP side alone."""

from __future__ import annotations

import asyncio
import tempfile

from aiohttp.test_utils import TestClient, TestServer

from pipellm.services.gateway.service import build, read_deltas
from pipellm.shared.config import EngineConfig, ServiceConfig


def run_gateway(engine: EngineConfig, redis_url: str, body, *, refresh: bool = False,
                deltas: bool = False, **svc):
    """What `await body(gw, client)` returns, against a gateway of `engine` on `redis_url` in a
    temporary run dir; `refresh`: its health read from Redis first; `deltas`: it reads its
    inbox (the answers services send it); `svc`: ServiceConfig fields."""
    async def main(run_dir: str):
        gw, inbox = build(engine, ServiceConfig(redis_url=redis_url, run_dir=run_dir, **svc))
        reader = asyncio.create_task(read_deltas(gw, inbox)) if deltas else None
        if refresh:
            await gw.health.refresh()
        try:
            async with TestClient(TestServer(gw.app())) as client:
                return await body(gw, client)
        finally:
            if reader is not None:
                reader.cancel()

    with tempfile.TemporaryDirectory(prefix="pl-") as run_dir:
        return asyncio.run(main(run_dir))
