"""Scale-out: two `pipellm up` servers sharing one real Redis behind the real vllm-router.

Real processes on the demo model (CPU): a redis-server, two full servers (`--redis-url` to it),
and `vllm-router` (the package scripts/setup.sh installs for the tests) with cache-aware
routing in front; requests go through the router with the official client. Shown, in order:

* a conversation's turns return to the replica that holds its prefix, even while that replica
  is the busier one (load alone would pick the other);
* unrelated requests spread over both replicas;
* a replica whose compute hangs answers 503 on /health while the other stays green (each
  gateway watches its own services in the shared Redis): the router takes it out, requests
  meanwhile go to the other, and it is back once its compute is;
* the length predictor and the hidden-state length head (`--hidden-length`) in the shared Redis
  learned every finished request of both replicas;
* kill -9 of a whole replica (its process group) mid-stream: the stream ends with its finish
  reason or with an error the client raises, never silently; requests sent afterwards, the
  conversation's next turn included, are served by the survivor.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import redis

from pipellm.services.compute.length.store import RedisStore
from pipellm.shared.length_predictor import LengthPredictor, model_key
from pipellm.shared.redis_server import EmbeddedRedis, free_port
from tests.stack import Stack

# the console script of vllm-router==0.1.17, next to this interpreter (the venv's) or on PATH
ROUTER = (shutil.which("vllm-router", path=os.path.dirname(sys.executable))
          or shutil.which("vllm-router"))
# health checked every second, a replica out after one failed check or one failed request (the
# circuit breaker; the request is retried on another replica), back after one good check
ROUTER_FLAGS = ("--policy", "cache_aware", "--health-check-interval-secs", "1",
                "--health-failure-threshold", "1", "--health-success-threshold", "1",
                "--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "2")
FINISHED = 'pipellm_requests_total{outcome="finished"}'
SYSTEM = ("You are the ship's navigator. Answer in short sentences and keep track of the "
          "course, the wind and the crew's questions across the whole conversation.")
FRESH = ["Apples grow on", "Volcanoes erupt when", "Chess openings like", "Jazz began in",
         "Quantum bits can", "Medieval castles had", "Glaciers carve", "Bees dance to"]


class Router:
    """`vllm-router` in its own process group, on free ports, logging to `log`."""

    def __init__(self, workers: list[str], log: Path, flags: tuple[str, ...] = ROUTER_FLAGS):
        port, metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        argv = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                *flags]
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 30
        while _get(self.url + "/health")[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the router did not start:\n" + self.logs())
            time.sleep(0.1)

    def metric(self, name: str, worker: str) -> float:
        """The router's gauge `name` for `worker` (0 while it has none): `running_requests`, its
        count of the worker's requests in flight (what its load balancing weighs);
        `worker_health`, 1 while it routes to the worker."""
        status, text = _get(self.metrics_url)
        assert status == 200
        key = f'vllm_router_{name}{{worker="{worker}"}} '
        return sum(float(line[len(key):]) for line in text.splitlines() if line.startswith(key))

    def wait_for(self, name: str, worker: str, value: float, timeout_s: float = 15) -> None:
        deadline = time.monotonic() + timeout_s
        while self.metric(name, worker) != value:
            assert time.monotonic() < deadline, f"router: {name} of {worker} never {value}"
            time.sleep(0.1)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def finished(servers: list[Stack]) -> list[float]:
    """Each live server's count of requests it finished (0 for a dead one)."""
    return [s.engine_stats().get(FINISHED, 0.0) if s.proc.poll() is None else 0.0
            for s in servers]


def served(servers: list[Stack], before: list[float], at_least: int = 1) -> list[float]:
    """How many requests each server finished since `before`, once they add up to `at_least`
    (a server counts a request as it answers it)."""
    deadline = time.monotonic() + 10
    while True:
        delta = [a - b for a, b in zip(finished(servers), before, strict=True)]
        if sum(delta) >= at_least or time.monotonic() > deadline:
            return delta
        time.sleep(0.05)


def learned(predictor: LengthPredictor) -> int:
    return sum(predictor.counts())


def head_learned(url: str) -> int:
    """Requests the hidden-state length head's prefill stage learned, over every replica (its
    statistics in the shared Redis: store.py's layout)."""
    client = redis.Redis.from_url(url)
    keys = client.keys("pipellm:lenhead:*:prefill:*:version")
    if not keys:
        return 0
    assert len(keys) == 1, keys  # one model, one probe: one shared head
    stats = RedisStore(client, keys[0].decode().removesuffix(":version")).load()
    return stats.requests if stats is not None else 0


def test_two_servers_behind_vllm_router(demo_model_dir, tmp_path):
    if ROUTER is None:
        pytest.fail("no vllm-router: `bash scripts/setup.sh test` installs it")
    store = EmbeddedRedis(data_dir=str(tmp_path)).start()
    servers = [Stack(demo_model_dir, "--hidden-length", redis_url=store.url, new_session=True)
               for _ in range(2)]
    router = None
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(Stack.start, servers))
        router = Router([s.url for s in servers], tmp_path / "router.log")
        print(f"two servers and the router up in {time.monotonic() - t0:.1f} s")
        predictor = LengthPredictor(redis.Redis.from_url(store.url),
                                    model_key(str(demo_model_dir)))
        assert learned(predictor) == 0
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        model = client.models.list().data[0].id
        assert model == demo_model_dir.name

        def chat(messages: list[dict], max_tokens: int = 8, **kw):
            return client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kw)

        # -- a conversation stays with the replica that holds its prefix ---------------------
        conversation = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "We leave port at dawn. Which course?"}]
        before = finished(servers)
        conversation.append({"role": "assistant",
                             "content": chat(conversation).choices[0].message.content})
        delta = served(servers, before)
        assert sorted(delta) == [0, 1], delta
        home = delta.index(1)
        other = 1 - home
        for turn in ("The wind turns north. What now?", "A storm ahead: which heading?"):
            # a long request on the conversation's replica: load alone would pick the other
            # (the router's gauge may count it a moment after its first chunk)
            busy = chat([*conversation, {"role": "user", "content": "Recite the log."}],
                        max_tokens=400, stream=True, extra_body={"min_tokens": 400})
            next(iter(busy))
            router.wait_for("running_requests", servers[home].url, 1, timeout_s=5)
            assert router.metric("running_requests", servers[other].url) == 0
            before = finished(servers)
            conversation.append({"role": "user", "content": turn})
            reply = chat(conversation)
            conversation.append({"role": "assistant", "content": reply.choices[0].message.content})
            delta = served(servers, before)
            assert delta[other] == 0 and delta[home] >= 1, (turn, delta)
            assert sum(1 for c in busy if c.choices and c.choices[0].finish_reason) == 1

        # -- unrelated requests spread over both ---------------------------------------------
        before = finished(servers)
        with ThreadPoolExecutor(len(FRESH)) as pool:
            texts = list(pool.map(lambda p: client.completions.create(
                model=model, prompt=p, max_tokens=16, temperature=0,
                extra_body={"min_tokens": 16}).choices[0].text, FRESH))
        assert all(texts)
        delta = served(servers, before, len(FRESH))
        assert sum(delta) == len(FRESH) and min(delta) >= 1, delta

        # -- /health is red while a replica cannot serve; the router goes around it ----------
        compute = servers[other].pid("compute")
        os.kill(compute, signal.SIGSTOP)  # hung: no heartbeats, nothing served
        try:
            deadline = time.monotonic() + 10
            while servers[other].get("/health")[0] != 503:
                assert time.monotonic() < deadline, "/health stayed green without compute"
                time.sleep(0.05)
            assert servers[home].get("/health")[0] == 200  # each watches its own services
            router.wait_for("worker_health", servers[other].url, 0)
            before = finished(servers)
            for prompt in FRESH[:3]:
                assert client.completions.create(model=model, prompt=prompt + " the",
                                                 max_tokens=4, temperature=0).choices[0].text
            delta = served(servers, before, 3)
            assert delta[home] == 3 and delta[other] == 0, delta
        finally:
            os.kill(compute, signal.SIGCONT)
        servers[other].wait_healthy(10)
        router.wait_for("worker_health", servers[other].url, 1)

        # -- the shared length predictor and length head learned from both -----------------
        totals = finished(servers)
        assert min(totals) >= 1, totals
        deadline = time.monotonic() + 10
        while (learned(predictor), head_learned(store.url)) != (sum(totals),) * 2 and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert learned(predictor) == head_learned(store.url) == sum(totals), \
            (learned(predictor), head_learned(store.url), totals)

        # -- kill -9 a whole replica mid-stream -----------------------------------------------
        stream = chat([*conversation, {"role": "user", "content": "Describe the coast."}],
                      max_tokens=400, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        text = next(chunks).choices[0].delta.content or ""
        assert router.metric("running_requests", servers[home].url) == 1  # the conversation's
        os.killpg(servers[home].proc.pid, signal.SIGKILL)
        servers[home].proc.wait(10)
        finish, error = None, None
        try:
            for c in chunks:
                if c.choices:
                    text += c.choices[0].delta.content or ""
                    finish = c.choices[0].finish_reason or finish
        except Exception as e:  # noqa: BLE001 - whatever the client raises is "not silent"
            error = e
        print(f"stream on the killed replica: finish={finish!r} error={error!r}")
        assert finish is not None or error is not None, "the stream ended silently: " + text
        before = finished(servers)
        conversation.append({"role": "user", "content": "Are we still on course?"})
        assert chat(conversation).choices[0].message.content is not None
        for prompt in FRESH[:3]:
            assert client.completions.create(model=model, prompt=prompt, max_tokens=4,
                                             temperature=0).choices[0].text
        delta = served(servers, before, 4)
        assert delta[other] == 4, delta
        print(f"done in {time.monotonic() - t0:.1f} s")
    finally:
        if router is not None:
            router.stop()
            print(router.logs()[-1500:])
        for s in servers:
            s.stop()
        store.stop()

