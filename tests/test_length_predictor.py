"""The output-length predictor against a real redis-server: learning, cold start, concurrency,
restarts, feature stability, capping."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipellm.shared.length_dist import LengthDist
from pipellm.shared.length_features import MAX_FEATURES
from pipellm.shared.length_predictor import EDGES, NB, LengthPredictor, bucket_of, length_features
from pipellm.shared.redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]
VOCAB = [f"word{i}" for i in range(300)]
MARKER = "briefly"


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    c.flushdb()
    yield c
    c.close()


def prompt(rng: random.Random, marker: bool) -> tuple[str, list[int]]:
    words = [rng.choice(VOCAB) for _ in range(rng.randint(6, 20))]
    if marker:
        words.insert(rng.randrange(len(words) + 1), MARKER)
    text = " ".join(words)
    return text, [1] + [len(w) * 7 + i % 5 for i, w in enumerate(words)]


def feats(text: str, ids: list[int], max_tokens: int = 2048) -> list[int]:
    return length_features(text, ids, max_tokens, "m")


def test_buckets():
    assert EDGES[:5] == (1, 2, 3, 4, 5) and len(EDGES) == NB + 1 and EDGES[-1] >= 65536
    assert all(a < b for a, b in pairwise(EDGES))
    assert [bucket_of(x) for x in (0, 1, 2, 5)] == [0, 0, 1, 4]
    assert bucket_of(10**9) == NB - 1
    assert all(EDGES[bucket_of(x)] <= x < EDGES[bucket_of(x) + 1] for x in range(1, 5000))


def test_cold_start_default_point(client):
    p = LengthPredictor(client, "m", default_len=100)
    f = feats("hello there", [1, 2, 3])
    assert p.predict(f, 2048) == LengthDist.point(100)
    assert p.predict(f, 40) == LengthDist.point(40)
    assert p.predict([], 0) == LengthDist.point(1)


def test_learns_planted_relation(client):
    p = LengthPredictor(client, "m")
    rng = random.Random(0)
    for _ in range(200):  # online: predict, then learn the true length
        marker = rng.random() < 0.5
        text, ids = prompt(rng, marker)
        f = feats(text, ids)
        p.predict(f, 2048)
        p.update(f, rng.randint(5, 10) if marker else rng.randint(200, 400))
    short = [p.predict(feats(*prompt(rng, True)), 2048) for _ in range(20)]
    long = [p.predict(feats(*prompt(rng, False)), 2048) for _ in range(20)]
    assert all(d.median < 30 for d in short), [d.values for d in short]
    assert all(d.median > 100 for d in long), [d.values for d in long]
    # a distribution, not a point: sharp enough to reserve for at p90, wide where lengths vary
    assert sum(d.quantile(0.9) < 30 for d in short) >= 0.8 * len(short)
    assert all(150 <= d.quantile(0.5) <= 450 and d.values[0] < d.values[-1] for d in long)


def test_global_fallback_for_unseen_features(client):
    p = LengthPredictor(client, "m", default_len=128)
    rng = random.Random(1)
    for _ in range(100):
        p.update(feats(*prompt(rng, False)), rng.randint(500, 700))
    unseen = length_features("completely different words", [1, 999, 998], 2048, "other-model")
    d = p.predict(unseen, 2048)
    assert d == p.predict([], 2048)  # nothing known about these features: global statistics
    assert 450 <= d.median <= 750 and d.values[0] < d.values[-1]
    new_words = p.predict(feats("completely different vocabulary zzz", [1, 999, 998]), 2048)
    assert all(abs(a - b) <= 0.1 * b for a, b in zip(new_words.values, d.values, strict=True))
    assert sum(p.counts()) == 100


def _worker(url: str, worker: int, n: int, shared_feature: int, barrier) -> None:
    client = redis.Redis.from_url(url)  # each process its own connection
    p = LengthPredictor(client, "conc")
    client.ping()
    barrier.wait(30)  # all start writing together
    for i in range(n):
        p.update([shared_feature, 1000 + worker, 5000 + i % 7], 1 + (worker * 37 + i) % 3000)


def test_concurrent_updates_lose_nothing(client, redis_url):
    workers, n, shared = 4, 400, 42
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(workers)
    procs = [ctx.Process(target=_worker, args=(redis_url, w, n, shared, barrier))
             for w in range(workers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    p = LengthPredictor(client, "conc")
    assert sum(p.counts()) == workers * n
    assert sum(p.counts(shared)) == workers * n
    assert all(sum(p.counts(1000 + w)) == n for w in range(workers))
    assert sum(sum(p.counts(5000 + k)) for k in range(7)) == workers * n
    expect = [0] * NB
    for w in range(workers):
        for i in range(n):
            expect[bucket_of(1 + (w * 37 + i) % 3000)] += 1
    assert p.counts() == expect


def test_restart_keeps_model(client, redis_url):
    p = LengthPredictor(client, "m")
    rng = random.Random(2)
    for _ in range(150):
        marker = rng.random() < 0.3
        length = rng.randint(3, 12) if marker else rng.randint(80, 900)
        p.update(feats(*prompt(rng, marker)), length)
    queries = [feats(*prompt(rng, rng.random() < 0.5)) for _ in range(10)]
    before = [p.predict(f, mt) for f in queries for mt in (2048, 300)]
    fresh = LengthPredictor(redis.Redis.from_url(redis_url), "m")  # a restarted process
    assert [fresh.predict(f, mt) for f in queries for mt in (2048, 300)] == before
    # another model's namespace is separate
    assert LengthPredictor(client, "other").predict(queries[0], 2048) == LengthDist.point(128)


def test_features_stable_across_processes_and_bounded():
    rng = random.Random(3)
    cases = [("Write a short poem about the sea?", [1, 5, 9, 77], 256),
             ("Übersetze das bitte: 你好，世界\n```python\nx = {1: 2}; y = {}; z;\n```", [1] * 40,
              2048),
             (" ".join(rng.choice(VOCAB) for _ in range(5000)), list(range(3000)), 4096),
             ("", [], 1)]
    local = [length_features(t, ids, mt, "llama") for t, ids, mt in cases]
    code = ("import json, sys; from pipellm.shared.length_features import length_features; "
            "cases = json.load(sys.stdin); "
            "print(json.dumps([length_features(t, ids, mt, 'llama') for t, ids, mt in cases]))")
    env = dict(os.environ, PYTHONHASHSEED="12345")  # ids must not depend on Python's hash()
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == local
    for f in local:
        assert 0 < len(f) <= MAX_FEATURES and len(set(f)) == len(f)
        assert all(isinstance(x, int) and 0 <= x < 2**32 for x in f)
    assert len(local[2]) <= MAX_FEATURES <= 64
    # the model salts the ids; the same prompt with a different max_tokens differs in one id
    other = length_features(*cases[0][:3], "mistral")
    assert not set(other) & set(local[0])
    a, b = (set(length_features(cases[0][0], cases[0][1], mt, "llama")) for mt in (256, 4096))
    assert len(a ^ b) == 2


def test_values_capped_non_decreasing_and_conditional(client):
    p = LengthPredictor(client, "m")
    rng = random.Random(4)
    for _ in range(50):
        p.update(feats(*prompt(rng, False)), rng.randint(1000, 3000))
    f = feats(*prompt(rng, False))
    for mt in (1, 7, 50, 1500, 100_000):
        d = p.predict(f, mt)
        assert all(1 <= v <= mt for v in d.values)
        assert list(d.values) == sorted(d.values)
    d = p.predict(f, 50)
    assert d == LengthDist.point(50)
    d = p.predict(f, 100_000)
    g = d.conditional_quantile(1200, 0.9)
    assert g > 1200 and g >= d.quantile(0.9)
    assert 0.0 < d.cdf(d.median) < 1.0


def test_exact_small_lengths(client):
    p = LengthPredictor(client, "m")
    for _ in range(30):
        p.update([7], 7)
    assert p.predict([7], 2048).median == 7


def test_redis_down_falls_back():
    c = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    p = LengthPredictor(c, "m", default_len=64)
    assert p.predict([1, 2], 2048) == LengthDist.point(64)
    p.update([1, 2], 10)  # dropped, logged
    strict = LengthPredictor(c, "m", strict=True)
    with pytest.raises(redis.ConnectionError):
        strict.predict([1, 2], 2048)


def test_support_ranking_stays_bounded(client, monkeypatch):
    import pipellm.shared.length_predictor as lp

    monkeypatch.setattr(lp, "TOP_CAP", 64)
    monkeypatch.setattr(lp, "TOP_KEEP", 32)
    p = LengthPredictor(client, "m", slots=1 << 12)
    rng = random.Random(5)
    for i in range(60):  # feature 7 on every request, 2 fresh ones each
        p.update([7, rng.getrandbits(32), rng.getrandbits(32)], 10 + i)
        assert client.zcard(p.top_key) <= 64
    assert client.zscore(p.top_key, 7 % (1 << 12)) == 60
    assert sum(p.counts(7)) == 60


def test_update_many_learns_what_single_updates_learn(client, redis_url):
    rng = random.Random(7)
    batch = [(feats(*prompt(rng, rng.random() < 0.5)), rng.randint(1, 500)) for _ in range(40)]
    one = LengthPredictor(client, "one")
    for f, n in batch:
        one.update(f, n)
    many = LengthPredictor(redis.Redis.from_url(redis_url), "many")
    many.update_many(batch)
    many.update_many([])
    assert many.counts() == one.counts() and sum(many.counts()) == 40
    for f, _ in batch[:5]:
        assert many.counts(f[0]) == one.counts(f[0])
        assert many.predict(f, 600) == one.predict(f, 600)


def test_updates_with_ids_are_learned_once(client):
    """Samples with ids that a failed call kept are sent with the next one; an id Redis has
    seen (a retry of a call it applied but whose reply was lost) changes nothing."""
    down = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    p = LengthPredictor(down, "ids")
    p.update_many([([1], 10), ([2], 20)], ["a", "b"])  # Redis down: kept
    assert sum(LengthPredictor(client, "ids").counts()) == 0
    p.client = client  # Redis back
    p.update_many([([3], 30)], ["c"])  # a, b, then c
    p.update_many([([1], 10), ([3], 30), ([4], 40)], ["a", "c", "d"])  # a, c seen before
    assert sum(p.counts()) == 4 and [sum(p.counts(f)) for f in (1, 2, 3, 4)] == [1, 1, 1, 1]
    p.update_many([([1], 10)])  # without ids: learned each time
    assert sum(p.counts(1)) == 2
