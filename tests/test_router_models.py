"""A generation server and a pooling server behind one vllm-router URL, routed by model name.

Real processes on the demo model (CPU): one redis-server; a generation server and a pooling
server (`--convert embed`) on it, each with its own --server-id and served name; `vllm-router`
with `--enable-igw` (its multi-model mode: a request goes to the servers of its `model`), and
pipellm/services/router_workers.py registering both with it (started before the servers are up: it
waits for them). The official client, unchanged, calls `chat.completions.create` and
`embeddings.create` on the router's one URL. Shown:

* each request reaches the server of its model and no other (the servers' own counts); the
  embeddings are the pooling server's own vectors;
* routing is by the `model` field, not by the path: the chat API under the embedder's name
  reaches the pooling server, whose 400 names the Chat Completions API;
* both servers keep their heartbeats in the one Redis under their own server ids;
* a worker the router drops (as a restarted router would have none) is registered again.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import redis

from pipellm.services.router_workers import registered
from pipellm.shared.redis_server import EmbeddedRedis
from tests.stack import Stack
from tests.test_router import FINISHED, ROUTER, ROUTER_FLAGS, Router, _get

CHAT, EMBED = "demo-chat", "demo-embed"  # the two servers' served model names
TEXTS = ["The river runs north.", "Seven blue mountains.", "A quiet harbour at dawn."]


def vectors(response) -> np.ndarray:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4")
                     if isinstance(d.embedding, str) else d.embedding
                     for d in response.data], dtype=np.float32)


def counts(gen: Stack, emb: Stack) -> tuple[float, float]:
    """Requests each server finished (a pooling server counts its embedding requests too)."""
    return gen.engine_stats().get(FINISHED, 0.0), emb.engine_stats().get(FINISHED, 0.0)


def wait_registered(router: Router, want: dict[str, str], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while registered(router.url) != want:
        assert time.monotonic() < deadline, f"router lists {registered(router.url)}, not {want}"
        time.sleep(0.1)


def test_chat_and_embeddings_through_one_router(demo_model_dir, tmp_path):
    if ROUTER is None:
        pytest.fail("no vllm-router: `bash scripts/setup.sh test` installs it")
    store = EmbeddedRedis(data_dir=str(tmp_path)).start()
    gen = Stack(demo_model_dir, "--served-model-name", CHAT, "--server-id", "generate",
                redis_url=store.url)
    emb = Stack(demo_model_dir, "--runner", "pooling", "--convert", "embed",
                "--served-model-name", EMBED, "--server-id", "embed", redis_url=store.url)
    router = registrar = None
    t0 = time.monotonic()
    try:
        router = Router([], tmp_path / "router.log", ("--enable-igw", *ROUTER_FLAGS))
        assert registered(router.url) == {}  # --worker-urls means nothing in this mode
        registrar = subprocess.Popen(
            [sys.executable, "-m", "pipellm.services.router_workers", "--router", router.url,
             "--worker", f"{gen.url}={CHAT}", "--worker", f"{emb.url}={EMBED}",
             "--interval-s", "0.2"],
            stdout=open(tmp_path / "registrar.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(Stack.start, [gen, emb]))
        want = {gen.url: CHAT, emb.url: EMBED}
        wait_registered(router, want)
        print(f"both servers up and registered in {time.monotonic() - t0:.1f} s")
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)

        # -- each model's requests reach its server and no other -----------------------------
        before = counts(gen, emb)
        for _ in range(2):
            reply = client.chat.completions.create(
                model=CHAT, messages=[{"role": "user", "content": "Name a river."}],
                max_tokens=8, temperature=0)
            assert reply.model == CHAT and reply.choices[0].message.content
        after = counts(gen, emb)
        assert (after[0] - before[0], after[1] - before[1]) == (2, 0), (before, after)

        for fmt in ("float", "base64"):
            routed = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format=fmt)
            assert routed.model == EMBED and routed.usage.prompt_tokens > 0
            ours = vectors(routed)
            assert ours.shape[0] == len(TEXTS) and ours.shape[1] > 0
            assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-4)  # normalized
            direct = openai.OpenAI(base_url=emb.url + "/v1", api_key="unused", max_retries=0)
            mine = vectors(direct.embeddings.create(model=EMBED, input=TEXTS,
                                                    encoding_format=fmt))
            assert np.allclose(ours, mine, atol=1e-5), fmt
        final = counts(gen, emb)
        assert final[0] == after[0] and final[1] - after[1] >= 2, (after, final)

        # -- by the model field, not the path -------------------------------------------------
        with pytest.raises(openai.BadRequestError, match="Chat Completions API"):
            client.chat.completions.create(
                model=EMBED, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert counts(gen, emb)[0] == final[0]  # the generation server never saw it

        # -- the router's own /v1/models in this mode (docs/scale-out.md) -------------------
        listed = json.loads(_get(router.url + "/v1/models")[1])
        assert list(listed) == ["models"] and sorted(listed["models"]) == sorted([CHAT, EMBED])
        assert not client.models.list().data  # not OpenAI's shape: the SDK finds no model

        # -- one Redis, two server ids ---------------------------------------------------------
        keys = {k.decode() for k in redis.Redis.from_url(store.url).keys("pipellm:svc:*")}
        servers = {k.split(":")[2] for k in keys}
        assert servers == {"generate", "embed"}, keys
        for server in servers:  # each its own services' beats
            assert {k.split(":")[3] for k in keys if k.split(":")[2] == server} >= \
                {"tokenizer", "compute"}, (server, keys)

        # -- a dropped worker comes back -------------------------------------------------------
        quoted = urllib.parse.quote(gen.url, safe="")
        req = urllib.request.Request(f"{router.url}/workers/{quoted}", method="DELETE")
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200
        wait_registered(router, want, timeout_s=10)
        assert client.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": "Again?"}],
            max_tokens=4, temperature=0).choices[0].message.content
        # -- a name the server does not serve is refused, not registered ----------------------
        wrong = subprocess.run(
            [sys.executable, "-m", "pipellm.services.router_workers", "--router", router.url,
             "--worker", f"{emb.url}=no-such-model", "--once", "--interval-s", "0.2",
             "--timeout-s", "1"], capture_output=True, text=True, timeout=30)
        assert wrong.returncode == 1, wrong.stderr
        assert f"serves ['{EMBED}'], not 'no-such-model'" in wrong.stderr, wrong.stderr
        assert registered(router.url) == want
        print(f"done in {time.monotonic() - t0:.1f} s")
    finally:
        if registrar is not None:
            registrar.terminate()
            registrar.wait(10)
            print((tmp_path / "registrar.log").read_text()[-1500:])
        if router is not None:
            router.stop()
            print(router.logs()[-1500:])
        for s in (gen, emb):
            s.stop()
        store.stop()
