"""/v1/embeddings in the gateway, in process, with a real Redis and real zmq sockets and a fake
tokenizer behind it: the request's way out and its answer's way back, the APIs each runner
refuses, the resend after a service restarts and the failure after a long outage."""

from __future__ import annotations

import asyncio
from array import array

import redis
import zmq
import zmq.asyncio

from pipellm.services.gateway import embeddings_api, health
from pipellm.shared import codec, state
from pipellm.shared.config import EngineConfig
from pipellm.shared.messages import EmbedRequest, EmbedResult
from tests import gateway_harness


def run_gateway(model_dir, url: str, body, runner: str = "pooling"):
    """body(gw, client, fake tokenizer's PULL socket) against a gateway whose services all
    beat, on a fresh Redis."""
    client_redis = redis.Redis.from_url(url)
    client_redis.flushall()
    for s in state.SERVICES:
        state.heartbeat(client_redis, "default", s, "a", 30)

    async def with_tokenizer(gw, client):
        tokenizer = zmq.asyncio.Context.instance().socket(zmq.PULL)
        tokenizer.connect(gw.svc.addr("tokenizer"))
        try:
            return await body(gw, client, tokenizer)
        finally:
            tokenizer.close(0)

    return gateway_harness.run_gateway(EngineConfig(model=str(model_dir), runner=runner), url,
                                       with_tokenizer, refresh=True, deltas=True)


def reply(to: str, result: EmbedResult) -> None:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(to)
    sock.send(codec.encode(result))
    sock.close(linger=1000)


def test_a_request_and_its_answer(demo_model_dir, redis_url):
    async def body(gw, client, tokenizer):
        post = asyncio.create_task(client.post("/v1/embeddings", json={
            "input": ["a b", "c"], "dimensions": 2}))
        msg = codec.decode(await tokenizer.recv())
        reply(msg.reply_to, EmbedResult(msg.request_id, array("f", [1, 2, 3, 4]), 2,
                                        array("i", [3, 2])))
        r = await post
        ok = (r.status, await r.json(), msg)
        post = asyncio.create_task(client.post("/v1/embeddings", json={"input": [1, 2]}))
        msg = codec.decode(await tokenizer.recv())
        reply(msg.reply_to, EmbedResult(msg.request_id, error="input 0 is bad",
                                        error_status=400, error_param="input"))
        r = await post
        return ok, (r.status, await r.json(), msg), len(gw.registry)

    (status, answer, sent), (bad_status, bad, sent_ids), left = run_gateway(
        demo_model_dir, redis_url, body)
    assert isinstance(sent, EmbedRequest) and sent.texts == ["a b", "c"] and sent.dimensions == 2
    assert status == 200 and [d["embedding"] for d in answer["data"]] == [[1, 2], [3, 4]]
    assert answer["usage"] == {"prompt_tokens": 5, "total_tokens": 5, "completion_tokens": 0}
    assert sent_ids.texts is None and [list(i) for i in sent_ids.inputs] == [[1, 2]]
    assert bad_status == 400 and bad["error"]["param"] == "input"
    assert left == 0


def test_each_runner_refuses_the_others_apis(demo_model_dir, redis_url):
    async def generation(gw, client, tokenizer):
        r = await client.post("/v1/embeddings", json={"input": "x"})
        return r.status, await r.json()

    status, answer = run_gateway(demo_model_dir, redis_url, generation, runner="generate")
    assert status == 400 and "does not support Embeddings API" in answer["error"]["message"]

    async def pooling(gw, client, tokenizer):
        out = {}
        for path, payload in (("/v1/chat/completions", {"messages": []}),
                              ("/v1/completions", {"prompt": "x"}),
                              ("/v1/messages", {"messages": [], "max_tokens": 4}),
                              ("/v1/responses", {"input": "x"})):
            r = await client.post(path, json=payload)
            out[path] = (r.status, await r.json())
        r = await client.get("/v1/models")
        out["models"] = (r.status, await r.json())
        out["health"] = (await client.get("/health")).status
        return out

    out = run_gateway(demo_model_dir, redis_url, pooling)
    assert out["/v1/chat/completions"][0] == 400
    assert "does not support Chat Completions API" in \
        out["/v1/chat/completions"][1]["error"]["message"]
    assert "does not support Completions API" in out["/v1/completions"][1]["error"]["message"]
    assert out["/v1/messages"][0] == 400 and out["/v1/messages"][1]["type"] == "error"
    assert out["/v1/responses"][0] == 400
    assert out["models"][0] == 200 and len(out["models"][1]["data"]) == 1
    assert out["health"] == 200


def test_resent_after_a_restart_failed_after_an_outage(demo_model_dir, redis_url, monkeypatch):
    monkeypatch.setattr(health, "RESUME_TIMEOUT_S", 0.05)

    async def body(gw, client, tokenizer):
        post = asyncio.create_task(client.post("/v1/embeddings", json={"input": "x"}))
        first = codec.decode(await tokenizer.recv())  # taken, never answered: lost
        state.heartbeat(redis.Redis.from_url(redis_url), "default", "compute", "b", 30)
        await gw.health.refresh()  # a new compute instance: what the old one held is lost
        again = codec.decode(await tokenizer.recv())
        reply(again.reply_to, EmbedResult(again.request_id, array("f", [0.5]), 1,
                                          array("i", [1])))
        reply(again.reply_to, EmbedResult(again.request_id, array("f", [9.0]), 1,
                                          array("i", [1])))  # a late duplicate: dropped
        r = await post
        resent = (first, again, r.status, await r.json())
        post = asyncio.create_task(client.post("/v1/embeddings", json={"input": "y"}))
        await tokenizer.recv()
        client_redis = redis.Redis.from_url(redis_url)
        client_redis.delete(*client_redis.keys(state.PREFIX + "svc:default:compute:*"))
        await gw.health.refresh()
        await asyncio.sleep(0.1)
        await gw.health.refresh()
        r = await post
        return resent, (r.status, await r.json())

    (first, again, status, answer), (failed, error) = run_gateway(demo_model_dir, redis_url, body)
    assert first == again and status == 200
    assert answer["data"][0]["embedding"] == [0.5]
    assert failed == 503 and "compute" in error["error"]["message"]


def test_a_request_lost_too_often_fails(demo_model_dir, redis_url, monkeypatch):
    monkeypatch.setattr(embeddings_api, "MAX_RESUMES", 1)

    async def body(gw, client, tokenizer):
        post = asyncio.create_task(client.post("/v1/embeddings", json={"input": "x"}))
        sent = [codec.decode(await tokenizer.recv())]
        for instance in ("b", "c"):  # two restarts: resent once, then failed
            state.heartbeat(redis.Redis.from_url(redis_url), "default", "compute", instance, 30)
            await gw.health.refresh()
        sent.append(codec.decode(await tokenizer.recv()))
        r = await post
        return len(sent), r.status, await r.json()

    count, status, answer = run_gateway(demo_model_dir, redis_url, body)
    assert count == 2 and status == 503 and "lost 2 times" in answer["error"]["message"]
