"""`docker compose -f compose.scale.yaml up` for real, where a Docker daemon is available
(marked `docker`; skipped without one): two replicas, vllm-router and Redis up; a streamed
chat through the router with the official client; requests spread over both replicas; one
replica killed and the service still answering; `down` leaves nothing. Timings go to stdout.

Building needs the base images (tests/test_docker.py says how) and a CPU torch wheel in
./wheels (copied here as there).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.test_docker import built_and_up, composer, wait_until

PROJECT = "pipellm-scale-test"
PORT = 8000

pytestmark = pytest.mark.docker


compose = composer(PROJECT, "compose.scale.yaml")


def answers() -> bool:
    """Whether a completion through the router succeeds."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status == 200
    except OSError:
        return False


def finished(service: str) -> float:
    """The replica's finished requests (its /metrics, read inside its container)."""
    cid = compose("ps", "-q", service).stdout.strip()
    out = subprocess.run(["docker", "exec", cid, "python", "-c",
                          "import urllib.request; print(urllib.request.urlopen("
                          "'http://127.0.0.1:8000/metrics').read().decode())"],
                         capture_output=True, text=True, check=True).stdout
    lines = [x for x in out.splitlines()
             if x.startswith('pipellm_requests_total{outcome="finished"}')]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0  # none finished: no sample


@pytest.fixture(scope="module")
def stack():
    yield from built_and_up(compose, lambda: wait_until(answers, 900, compose, 1.0))


def test_a_streamed_chat_through_the_router_and_both_replicas_serve(stack):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and text.strip()
    def ask(i: int):  # unrelated prompts at once: cache-aware routing spreads them by load
        return client.completions.create(model=model, prompt=f"Topic {i}: {'why ' * i}the sky",
                                         max_tokens=32)

    with ThreadPoolExecutor(8) as pool:
        assert all(r.choices[0].text is not None for r in pool.map(ask, range(16)))
    served = {s: finished(s) for s in ("replica-1", "replica-2")}
    assert min(served.values()) > 0, served
    stack["served"] = served


def test_replicas_load_the_kernels_built_into_the_image(stack):
    """`pipellm serve`'s compute child loads the image's C++ kernels; it does not compile them."""
    for replica in ("replica-1", "replica-2"):
        log = compose("logs", "--no-color", replica).stdout
        assert "C++ CPU kernels loaded (cached)" in log, log[-3000:]


def test_one_replica_killed_and_the_service_still_answers(stack):
    compose("kill", "replica-1")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="x", max_retries=2)
    model = client.models.list().data[0].id
    t = time.monotonic()
    for i in range(6):
        r = client.completions.create(model=model, prompt=f"After the kill {i}", max_tokens=4)
        assert r.choices[0].text is not None
    stack["answered_6_after_kill_s"] = time.monotonic() - t


def test_down_leaves_nothing(stack):
    compose("down", "-v", "--remove-orphans")
    left = subprocess.run(["docker", "ps", "-aq", "--filter",
                           f"label=com.docker.compose.project={PROJECT}"],
                          capture_output=True, text=True).stdout.split()
    assert left == []
