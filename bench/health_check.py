"""The gateway's health check against the number of requests Redis keeps: reading a server's
heartbeats from its set of heartbeat keys (pipellm/shared/state.py, now) against a baseline measured
in the same run, the SCAN over the keyspace the check did before (every request's state stays in
Redis for --request-ttl-s, an hour by default, so the keyspace grows with the traffic).

A real Redis (embedded), four services' heartbeats and one engine's stats, and --keys request
hashes beside them; each method timed over --reps checks through redis-py's asyncio client, as
the gateway runs it twice a second.

    python -m bench.health_check [--keys 0,1000,10000] [--reps 5]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import redis
import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/health_check.py`
    sys.path.insert(0, str(ROOT))

from bench.common import log  # noqa: E402
from pipellm.services.gateway.health import Health  # noqa: E402
from pipellm.services.gateway.metrics import Metrics  # noqa: E402
from pipellm.shared import state  # noqa: E402
from pipellm.shared.redis_server import EmbeddedRedis  # noqa: E402

SERVER = "bench"


async def scan_baseline(client: aioredis.Redis) -> int:
    """The check as it was: SCAN for the heartbeats and for the stats, then each stats hash."""
    beats = [k async for k in client.scan_iter(match=f"{state.PREFIX}svc:{SERVER}:*")]
    stats = [k async for k in client.scan_iter(match=f"{state.PREFIX}stats:{SERVER}:*")]
    for key in stats:
        await client.hgetall(key)
    return len(beats)


async def timed(check, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        await check()
    return (time.perf_counter() - start) / reps * 1e3


def fill(client: redis.Redis, keys: int) -> None:
    """Request hashes up to `keys` of them."""
    pipe = client.pipeline(transaction=False)
    for i in range(client.dbsize(), keys):
        pipe.hset(state.req_key(f"cmpl-{i:08x}:0"), mapping={"status": "finished"})
    pipe.execute()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", default="0,1000,10000", help="request hashes in Redis")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    rows = []
    with EmbeddedRedis() as r:
        client = redis.Redis.from_url(r.url)
        for service in (*state.SERVICES, "gateway"):
            state.heartbeat(client, SERVER, service, "0.a", 3600)
        state.set_stats(client, SERVER, 0, {"running": 1}, 3600)

        async def measure(keys: int) -> dict:
            aclient = aioredis.Redis.from_url(r.url)
            health = Health(aclient, SERVER, None, None, None, Metrics("m"))
            await health.refresh()  # warm: the pool's connection
            await scan_baseline(aclient)
            now = await timed(health.refresh, args.reps)
            assert health.ok, health.reason
            base = await timed(lambda: scan_baseline(aclient), args.reps)
            await aclient.aclose()
            return {"request_keys": keys, "set_ms": round(now, 2), "scan_ms": round(base, 2),
                    "ratio": round(base / now, 1)}

        for keys in (int(k) for k in args.keys.split(",")):
            fill(client, keys)
            rows.append(asyncio.run(measure(keys)))
            log(f"{keys} request keys: heartbeat set {rows[-1]['set_ms']} ms, SCAN "
                f"{rows[-1]['scan_ms']} ms a check ({rows[-1]['ratio']}x)")
    out = {"reps": args.reps, "rows": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
