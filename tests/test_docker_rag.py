"""`docker compose -f compose.rag.yaml up` for real, where a Docker daemon is available (marked
`docker`; skipped without one): a generation server, a pooling server, Redis, vllm-router in
its multi-model mode and the registrar up; the official client on the router's one URL gets a
streamed chat from the generation server and embeddings from the pooling server (the same
vectors as on its own port); both servers beat in the one Redis under their own ids; after the
router restarts (no workers) the registrar puts both back; `down` leaves nothing. Timings go
to stdout.

Building needs the base images (tests/test_docker.py says how) and a CPU torch wheel in
./wheels (copied here as there).
"""

from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import openai
import pytest

from tests.test_docker import built_and_up, composer, wait_until

PROJECT = "pipellm-rag-test"
ROUTER, EMBED_PORT = "http://127.0.0.1:8000/v1", 8002
CHAT, EMBED = "smollm2", "smollm2-embed"

pytestmark = pytest.mark.docker


compose = composer(PROJECT, "compose.rag.yaml")


def client(base: str = ROUTER) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=60)


def both_answer() -> bool:
    """Whether a chat and an embedding request through the router both succeed."""
    try:
        c = client()
        c.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "Hi"}],
                                  max_tokens=2)
        return len(c.embeddings.create(model=EMBED, input="Hi").data) == 1
    except openai.OpenAIError:
        return False


@pytest.fixture(scope="module")
def stack():
    yield from built_and_up(compose, lambda: wait_until(both_answer, 900, compose, 1.0))


def test_chat_and_embeddings_through_one_url(stack):
    chunks = list(client().chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and text.strip()
    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stocks fell today."]
    routed = client().embeddings.create(model=EMBED, input=texts, encoding_format="float")
    direct = client(f"http://127.0.0.1:{EMBED_PORT}/v1").embeddings.create(
        model=EMBED, input=texts, encoding_format="float")
    ours = np.array([d.embedding for d in routed.data])
    assert routed.model == EMBED and ours.shape == (3, 576)
    assert np.allclose(ours, [d.embedding for d in direct.data], atol=1e-5)
    sims = ours @ ours.T
    assert sims[0, 1] > sims[0, 2], sims  # the paraphrase is nearer than the other topic
    print(json.dumps({"answer": text, "cos": sims.round(3).tolist()}))


def test_both_servers_beat_in_one_redis(stack):
    cid = compose("ps", "-q", "redis").stdout.strip()
    keys = subprocess.run(["docker", "exec", cid, "redis-cli", "--raw", "keys", "pipellm:svc:*"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert {k.split(":")[2] for k in keys} == {"generate", "embed"}, keys


def test_a_restarted_router_gets_its_workers_back(stack):
    t = time.monotonic()
    compose("restart", "router")
    stack["both_answer_after_router_restart_s"] = wait_until(both_answer, 120, compose, 0.5)
    assert time.monotonic() - t < 120


def test_down_leaves_nothing(stack):
    compose("down", "-v", "--remove-orphans")
    left = subprocess.run(["docker", "ps", "-aq", "--filter",
                           f"label=com.docker.compose.project={PROJECT}"],
                          capture_output=True, text=True).stdout.split()
    assert left == []
