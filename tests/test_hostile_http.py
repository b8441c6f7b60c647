"""Hostile requests against the real gateway app in-process (real Redis and zmq sockets, no
services behind it): every class is a 4xx JSON error, the prompt cap, and --max-pending
counting a request before its body has arrived."""

from __future__ import annotations

import asyncio

import redis

from pipellm.shared import state
from pipellm.shared.config import EngineConfig
from tests import gateway_harness
from tests.hostile_cases import HOSTILE, generate


def run_gateway(model_dir, url, body, healthy=True, **svc):
    """body(gw, client) against a fresh gateway; `healthy`: every service has a heartbeat."""
    redis.Redis.from_url(url).flushall()
    if healthy:
        for s in state.SERVICES:
            state.heartbeat(redis.Redis.from_url(url), "default", s, "a", 30)

    return gateway_harness.run_gateway(EngineConfig(model=str(model_dir)), url, body,
                                       refresh=True, **svc)


async def post(client, path: str, ctype: str | None, raw: bytes) -> tuple[int, dict | None]:
    headers = {} if ctype is None else {"Content-Type": ctype}
    r = await client.post(path, data=raw, headers=headers)
    try:
        return r.status, await r.json(content_type=None)
    except ValueError:
        return r.status, None


def test_each_hostile_class_is_a_4xx_json_error(demo_model_dir, redis_url):
    async def body(gw, client):
        out = [(case, *await post(client, *case[1:])) for case in HOSTILE]
        # the generated corpus too, bar the mutations that stay valid (they would be served)
        for case in generate(900, seed=1):
            status, err = await post(client, *case[1:])
            if status != 503:  # 503: valid, waiting for a tokenizer that is not there
                out.append((case, status, err))
        return out, len(gw.pending), len(gw.registry)

    out, pending, registered = run_gateway(demo_model_dir, redis_url, body, healthy=False)
    for case, status, err in out:
        assert 400 <= status < 500, (case, status, err)
        assert err is not None and set(err["error"]) == {"message", "type", "param", "code"}
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    assert len(out) > len(HOSTILE) + 700 and pending == 0 and registered == 0
    assert {c[0] for c, _, _ in out} >= {"deep_nesting", "surrogate", "huge_int", "nan",
                                          "invalid_utf8", "truncated", "wrong_type"}


def test_prompt_over_the_cap_is_400_naming_the_flag(demo_model_dir, redis_url):
    chat = "/v1/chat/completions"

    async def body(gw, client):
        return [await post(client, "/v1/completions", "application/json",
                           b'{"prompt": "' + "é".encode() * 51 + b'"}'),
                await post(client, chat, None, b'{"messages": [{"role": "system", "content": "'
                           + b"a" * 60 + b'"}, {"role": "user", "content": "' + b"b" * 41
                           + b'"}]}'),
                # at the cap: passes it, then meets the (deliberately) unhealthy gateway
                await post(client, "/v1/completions", None, b'{"prompt": "' + b"a" * 100 + b'"}')]

    (s1, e1), (s2, e2), (s3, _) = run_gateway(demo_model_dir, redis_url, body, healthy=False,
                                              max_prompt_bytes=100)
    assert (s1, e1["error"]["param"], e1["error"]["code"]) == (400, "prompt", "prompt_too_large")
    assert "100 bytes" in e1["error"]["message"] and "--max-prompt-bytes" in e1["error"]["message"]
    assert (s2, e2["error"]["param"]) == (400, "messages")
    assert s3 == 503


def test_max_pending_counts_a_request_before_its_body_arrives(demo_model_dir, redis_url):
    async def body(gw, client):
        release = asyncio.Event()

        async def slow_body():
            yield b'{"prompt": '
            await release.wait()
            yield b"NaN}"

        slow = [asyncio.create_task(client.post("/v1/completions", data=slow_body()))
                for _ in range(2)]
        while len(gw.pending) < 2:
            await asyncio.sleep(0.01)
        r = await client.post("/v1/completions", data=b'{"prompt": NaN}')
        refused = (r.status, r.headers.get("Retry-After"), (await r.json())["error"]["code"])
        release.set()
        slow_status = [(await t).status for t in slow]
        r = await client.post("/v1/completions", data=b'{"prompt": NaN}')
        return refused, slow_status, r.status, len(gw.pending)

    refused, slow_status, after, pending = run_gateway(demo_model_dir, redis_url, body,
                                                       max_pending=2)
    assert refused == (429, "1", "rate_limit_exceeded")
    assert slow_status == [400, 400] and after == 400 and pending == 0


def test_broken_or_oversized_content_encoding_is_4xx(demo_model_dir, redis_url):
    import gzip

    bomb = gzip.compress(b'{"prompt": "' + b"a" * (20 * 2**20) + b'"}')  # 20 KiB -> 20 MiB

    async def body(gw, client):
        out = []
        for raw in (b"not gzip at all", bomb, gzip.compress(b'{"prompt": "x", "n": NaN}')):
            r = await client.post("/v1/completions", data=raw,
                                  headers={"Content-Encoding": "gzip", "Connection": "close"})
            out.append((r.status, (await r.json())["error"]["message"]))
        return out

    (s1, m1), (s2, m2), (s3, m3) = run_gateway(demo_model_dir, redis_url, body)
    assert s1 == 400 and "Content-Encoding" in m1
    assert s2 == 413 and "too large" in m2
    assert s3 == 400 and "NaN" in m3


def test_large_hostile_bodies_parsed_off_the_event_loop_are_4xx(demo_model_dir, redis_url):
    """Bodies over 64 KiB are checked on a worker thread: the same answers come back."""
    bodies = [b"[" * 100_000 + b"]" * 100_000,  # RecursionError on the worker thread
              b'{"prompt": [' + b"[]," * 40_000 + b"[" * 31 + b"1" + b"]" * 32 + b"}",  # 33 deep
              b'{"prompt": "' + b"a" * 100_000 + rb'\ud800"}',
              b'{"prompt": [' + b"1," * 50_000 + str(2**64).encode() + b"]}"]

    async def body(gw, client):
        return [await post(client, "/v1/completions", "application/json", raw)
                for raw in bodies]

    out = run_gateway(demo_model_dir, redis_url, body)
    assert [status for status, _ in out] == [400] * 4, out
    assert "nested deeper" in out[0][1]["error"]["message"]
    assert "nested deeper" in out[1][1]["error"]["message"]
    assert "surrogate" in out[2][1]["error"]["message"]
    assert "out of range" in out[3][1]["error"]["message"]
