"""The hidden-state length head: its fit, its statistics in a real Redis (concurrent writers,
restarts), and the engine learning a planted relation through a model's hidden states and
handing the newest prediction to the scheduler."""

from __future__ import annotations

import math
import multiprocessing
import random
import threading
import time

import numpy as np
import redis

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.length.head import (
    STAGES,
    THRESHOLDS,
    HeadStats,
    features,
    is_checkpoint,
    probe_dim,
    probe_matrix,
    remaining_quantiles,
    targets,
)
from pipellm.services.compute.length.refiner import LengthRefiner, RefinerConfig, learned_stats
from pipellm.services.compute.length.store import (
    MemoryStore,
    RedisStore,
    length_head_key,
    memory_stores,
    redis_stores,
)
from pipellm.services.compute.scheduling.admission import AggregatePeak, FuturePeak
from pipellm.shared import state
from pipellm.shared.config import EngineConfig, SchedulerConfig
from pipellm.shared.length_dist import LEVELS, LengthDist
from pipellm.shared.length_predictor import EDGES
from pipellm.shared.redis_server import EmbeddedRedis
from pipellm.shared.sampling import SamplingParams


def planted_stats(rng: np.random.Generator, n: int, d: int = 8) -> tuple[HeadStats, list]:
    """Requests whose feature 0 is +-1 (noise elsewhere): +1 runs ~10 tokens, -1 ~300."""
    stats, rows = HeadStats.zeros(d + 3), []
    for _ in range(n):
        mark = rng.choice([-1.0, 1.0])
        proj = rng.normal(size=d)
        proj[0] = mark
        total = int(rng.integers(6, 14) if mark > 0 else rng.integers(200, 400))
        x = np.stack([features(proj, 40, 1024, g) for g in (0, 32) if g < total])
        y = np.stack([targets(total - g) for g in (0, 32) if g < total])
        stats.add(x, y)
        rows.append((proj, total))
    return stats, rows


def test_remaining_quantiles_follow_the_survival_curve():
    s = np.exp(-THRESHOLDS / 200.0)  # exponential, mean 200: median 139, p90 461
    q = dict(zip(LEVELS, remaining_quantiles(s), strict=True))
    assert abs(q[0.5] - 139) <= 4 and abs(q[0.9] - 461) <= 12
    assert remaining_quantiles(np.zeros_like(THRESHOLDS))[0] == 1  # all done after one token
    assert remaining_quantiles(np.ones_like(THRESHOLDS))[-1] > THRESHOLDS[-1]  # never ends


def _quantile_reference(s: np.ndarray) -> list[int]:
    """One survival curve's quantiles, a level at a time (what remaining_quantiles vectorizes)."""
    surv, grid = np.concatenate([[1.0], s]), np.concatenate([[1.0], THRESHOLDS])
    out, last = [], 1
    for q in LEVELS:
        below = np.flatnonzero(surv <= 1.0 - q)
        if below.size:
            j = int(below[0])
            frac = (surv[j - 1] - (1.0 - q)) / (surv[j - 1] - surv[j])
            value = math.ceil(grid[j - 1] * (grid[j] / grid[j - 1]) ** frac - 1e-9)
        else:
            value = EDGES[-1]
        last = max(last, value)
        out.append(last)
    return out


def test_batched_quantiles_and_predictions_match_one_at_a_time():
    rng = np.random.default_rng(7)
    s = np.minimum.accumulate(np.clip(rng.random((200, len(THRESHOLDS))) * 1.4 - 0.2, 0, 1),
                              axis=-1)
    s[:20] = np.sort(rng.choice([0.0, 0.5, 1.0], (20, len(THRESHOLDS))))[:, ::-1]  # flat runs
    assert remaining_quantiles(s).tolist() == [_quantile_reference(row) for row in s]
    head = planted_stats(rng, 200)[0].solve(0.1)
    g, cap = rng.integers(0, 300, 50), rng.integers(300, 1024, 50)
    x = features(rng.normal(size=(50, 8)), rng.integers(1, 99, 50), cap, g)
    expected = [LengthDist(tuple(min(gi + r, ci) for r in _quantile_reference(head.survival(xi))))
                for xi, gi, ci in zip(x, g.tolist(), cap.tolist(), strict=True)]
    assert head.predict_rows(x, g, cap) == expected


def test_planted_relation_is_learned_and_stats_are_order_free():
    rng = np.random.default_rng(0)
    stats, rows = planted_stats(rng, 400)
    head = stats.solve(0.1)
    short, long = np.zeros(8), np.zeros(8)
    short[0], long[0] = 1.0, -1.0
    p_short = head.predict(features(short, 40, 1024, 0), 0, 1024)
    p_long = head.predict(features(long, 40, 1024, 0), 0, 1024)
    assert p_short.median <= 16 and 150 <= p_long.median <= 450
    # refined: 32 tokens into a long request, the total stays in range and above 32
    p_later = head.predict(features(long, 40, 1024, 32), 32, 1024)
    assert 150 <= p_later.median <= 450 and p_later.values[0] > 32
    # capped by max_tokens
    assert head.predict(features(long, 40, 100, 0), 0, 100).values[-1] <= 100
    # additive: halves summed in either order == the whole; the blob round-trips
    a, b = HeadStats.zeros(11), HeadStats.zeros(11)
    for i, (proj, total) in enumerate(rows):
        (a if i % 2 else b).add(features(proj, 40, 1024, 0)[None], targets(total)[None])
    ab, ba = HeadStats.from_bytes(a.to_bytes()), HeadStats.from_bytes(b.to_bytes())
    ab += b
    ba += a
    np.testing.assert_allclose(ab.gram, ba.gram)
    assert ab.requests == ba.requests == 400 and ab.rows == 400


def _writer(url: str, key: str, seed: int, n: int) -> None:
    store = RedisStore(redis.Redis.from_url(url), key, compact_at=3)
    for i, delta in enumerate(_deltas(seed, n)):
        store.add(delta, f"{seed}-{i}")
        store.load()  # compacts concurrently with the other writers


def _deltas(seed: int, n: int) -> list[HeadStats]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        s = HeadStats.zeros(4)
        s.add(rng.normal(size=(2, 4)), (rng.random((2, len(THRESHOLDS))) > 0.5) * 1.0)
        out.append(s)
    return out


def test_concurrent_writers_lose_nothing(redis_url):
    key = "test:lenhead:concurrent"
    RedisStore(redis.Redis.from_url(redis_url), key).clear()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(redis_url, key, w, 30)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    reader = RedisStore(redis.Redis.from_url(redis_url), key)
    total = reader.load()
    assert reader.load() is total  # nobody pushed since: not read again
    expect = HeadStats.zeros(4)
    for w in range(4):
        for d in _deltas(w, 30):
            expect += d
    assert total.requests == 120
    np.testing.assert_allclose(total.gram, expect.gram)
    np.testing.assert_allclose(total.cross, expect.cross)


# a script that keeps Redis busy for ARGV[1] microseconds: commands sent meanwhile wait
BUSY = """local t0 = redis.call('TIME')
repeat local t = redis.call('TIME')
until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > tonumber(ARGV[1])"""


def test_a_push_whose_reply_is_lost_is_counted_once(redis_url):
    """Redis is busy past the refiner's client's timeout, then applies the pushes sent
    meanwhile: the refiner saw them fail, keeps them, and their retries under the same ids
    change nothing; a push that never reached Redis lands on its retry."""
    client = redis.Redis.from_url(redis_url)
    stores = redis_stores(state.fast_client(redis_url), "push-once-test", 8)  # 0.2 s timeout
    for s in stores.values():
        s.clear()
    refiner = LengthRefiner(stores, RefinerConfig(push_s=0, refresh_s=0, background=False))
    rng = np.random.default_rng(5)
    _run_to_limit(refiner, _request("first", 2, 70), rng)
    refiner.flush()  # (and Redis now knows the push script)
    for i in range(2):
        _run_to_limit(refiner, _request(f"lost{i}", 2, 70), rng)
    busy = threading.Thread(target=client.eval, args=(BUSY, 0, 800_000))
    busy.start()
    time.sleep(0.1)
    refiner.flush()
    assert [p.stage for p in refiner.unpushed] == list(STAGES)
    busy.join()
    assert stores["prefill"].load().requests == 3  # Redis ran it, unknown to the refiner
    refiner.flush()  # retried under the same ids: counted once
    assert refiner.unpushed == []
    assert all(s.load().requests == 3 for s in stores.values())
    reachable = stores["prefill"]
    stores["prefill"] = RedisStore(state.fast_client("redis://127.0.0.1:1"), "nowhere")
    _run_to_limit(refiner, _request("later", 2, 70), rng)
    refiner.flush()
    assert [p.stage for p in refiner.unpushed] == ["prefill"]
    stores["prefill"] = reachable
    refiner.flush()
    assert refiner.unpushed == [] and all(s.load().requests == 4 for s in stores.values())


def test_restart_keeps_the_head(tmp_path):
    stats, _ = planted_stats(np.random.default_rng(1), 50)
    with EmbeddedRedis(data_dir=str(tmp_path), persist=True) as server:
        store = RedisStore(redis.Redis.from_url(server.url), "test:lenhead:restart", compact_at=1)
        store.add(stats, "first")
        store.load()  # folded into base
        store.add(stats, "second")
        redis.Redis.from_url(server.url).save()
        port = server.port
    with EmbeddedRedis(port=port, data_dir=str(tmp_path), persist=True) as server:
        again = RedisStore(redis.Redis.from_url(server.url), "test:lenhead:restart").load()
    assert again.requests == 100
    np.testing.assert_allclose(again.gram, 2 * stats.gram)


# -- through the engine: a tiny model whose last prompt token is the marker -----------------

MAX_TOKENS, MARK_SHORT, MARK_LONG = 96, 7, 8


def marked(rng: random.Random, short: bool) -> tuple[list[int], SamplingParams]:
    """Short requests stop at any token >= 500 (about 2 tokens); long ones run to max_tokens.
    The same max_tokens and prompt length: only the hidden state tells them apart."""
    prompt = [rng.randrange(10, 500) for _ in range(12)] + [MARK_SHORT if short else MARK_LONG]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=rng.randrange(1 << 30),
                            ignore_eos=True,
                            stop_token_ids=list(range(500, 1000)) if short else [])
    return prompt, params


def engine_with_head(model: str, **kw):
    """The heads' penalty light (the defaults are tuned on 1024 real requests; 96 teach the
    marker here)."""
    engine = build_engine(EngineConfig(model=model, kv_cache_tokens=4096,
                                       scheduler=SchedulerConfig(max_running=16,
                                                                 kv_reserve_horizon=0),
                                       hidden_length=True, default_predicted_len=50, **kw))
    engine.lengths.config = RefinerConfig(min_requests=16, push_s=0, refresh_s=0,
                                          l2=(0.1, 0.1))
    return engine  # syncs in the background: flush() before reading what it learned


def test_engine_learns_a_marker_from_hidden_states(demo_model_dir):
    engine, rng = engine_with_head(str(demo_model_dir)), random.Random(0)
    reqs = [marked(rng, i % 2 == 0) for i in range(96)]
    seqs = engine.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    assert {s.finish_reason for s in seqs[1::2]} == {"length"}
    assert max(s.num_output for s in seqs[0::2]) < 30
    engine.lengths.flush()
    assert set(engine.lengths.heads) == {"prefill", "refine"} and engine.lengths.learned == 96
    # new requests: after their prefill step the scheduler holds the head's prediction
    short_p, long_p = marked(rng, True), marked(rng, False)
    rs, rl = engine.add_request(*short_p), engine.add_request(*long_p)
    s, lo = engine.requests[rs], engine.requests[rl]
    assert s.predicted_length.median == lo.predicted_length.median == 50  # the prior
    while s.num_output == 0 or lo.num_output == 0:
        engine.step()
    assert s.predicted_length.median < 20 < 60 < lo.predicted_length.median
    # both future-peak estimators read the new predictions: the slots each will add
    for check in (FuturePeak, AggregatePeak):
        q = engine.config.scheduler.kv_peak_quantile
        short, long = (check([x], q, 4096).peak() - x.num_tokens for x in (s, lo))
        assert short < 25 and long > 40
    before = lo.predicted_length
    while lo.num_output <= 33 and lo.finish_reason is None:  # refined at 32 generated
        engine.step()
    assert lo.predicted_length != before and lo.predicted_length.values[0] > 32


def _recording(observe, seen: list):
    def wrapper(checkpoints):
        seen.extend((s.request_id, g, p.shape) for s, g, p in checkpoints)
        return observe(checkpoints)
    return wrapper


def test_hidden_length_changes_no_token_and_probes_only_checkpoints(demo_model_dir):
    rng = random.Random(5)
    reqs = [marked(rng, i % 3 == 0) for i in range(24)]
    outs = []
    for on in (True, False):
        engine = build_engine(EngineConfig(model=str(demo_model_dir), kv_cache_tokens=700,
                                           scheduler=SchedulerConfig(max_running=8),
                                           hidden_length=on, length_refine_every=8))
        if on:
            engine.lengths.config = RefinerConfig(min_requests=4, push_s=0,
                                                  refresh_s=0, background=False)
            seen, dim = [], engine.runner.probe_dim
            assert dim == engine.model_config.hidden_size  # narrow: the raw state
            engine.lengths.observe = _recording(engine.lengths.observe, seen)
        seqs = engine.generate([p for p, _ in reqs], [sp for _, sp in reqs])
        outs.append([s.output_ids for s in seqs])
        assert (engine.lengths is not None) == on
    assert outs[0] == outs[1]
    # the runner probed exactly each request's checkpoints before its last token, once each
    expected = sorted((s.request_id, g, (dim,)) for s in seqs
                      for g in range(0, s.num_output, 8))
    assert sorted(seen) == expected


def test_memory_store_accumulates():
    store = MemoryStore()
    stats, _ = planted_stats(np.random.default_rng(2), 10)
    store.add(stats)
    store.add(stats)
    assert store.load().requests == 20 and stats.requests == 10


def _request(rid: str, prompt_len: int, max_tokens: int):
    from pipellm.services.compute.core.sequence import Sequence

    return Sequence(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    seed=0, max_len=prompt_len + max_tokens, predicted_length=None,
                    stop_ids=frozenset())


def _run_to_limit(refiner, seq, rng: np.random.Generator, dim: int = 8,
                  every: int = 32) -> list:
    """Generate seq to max_tokens, a random probe at each checkpoint; then it finishes.
    Returns the (generated, probe) checkpoints."""
    points = []
    for g in range(seq.params.max_tokens):
        if is_checkpoint(g, every):
            points.append((g, rng.normal(size=dim)))
            refiner.observe([(seq, *points[-1])])
        seq.append(5, 0.0)
    assert seq.finish_reason == "length"
    refiner.finished(seq)
    return points


def test_each_stage_learns_from_its_own_checkpoints_and_predicts_at_them():
    """The prefill head learns one row per request; the refining head every checkpoint."""
    refiner = LengthRefiner(memory_stores(), RefinerConfig(
        min_requests=4, push_s=0, refresh_s=0, background=False))
    rng = np.random.default_rng(3)
    for i in range(8):
        _run_to_limit(refiner, _request(f"r{i}", 3, 100), rng)
    refiner.tick()
    prefill, refine = (refiner.stores[k].load() for k in ("prefill", "refine"))
    assert prefill.requests == refine.requests == 8
    assert prefill.rows == 8 and refine.rows == 8 * 4  # generated 0, 32, 64, 96
    assert set(refiner.heads) == {"prefill", "refine"}
    s = _request("new", 3, 100)
    refiner.observe([(s, 0, rng.normal(size=8))])
    assert s.predicted_length.median > 90  # every request so far ran to max_tokens
    for _ in range(64):
        s.append(5, 0.0)
    refiner.observe([(s, 64, rng.normal(size=8))])
    assert 64 < s.predicted_length.values[0] and s.predicted_length.values[-1] <= 100


def test_replicas_share_both_heads_through_redis(redis_url):
    """One replica learns; another, with its own refiner on the same Redis keys, solves the
    same two heads."""
    client = redis.Redis.from_url(redis_url)
    stores = redis_stores(client, "replicas-share-test", 8)
    assert len({s.base_key for s in stores.values()}) == 2
    for s in stores.values():
        s.clear()
    fast = RefinerConfig(min_requests=4, push_s=0, refresh_s=0)
    writer = LengthRefiner(stores, fast)
    reader = LengthRefiner(redis_stores(client, "replicas-share-test", 8), fast)
    rng = np.random.default_rng(4)
    for i in range(6):
        _run_to_limit(writer, _request(f"r{i}", 2, 70), rng)
    writer.flush()
    reader.flush()
    assert set(reader.heads) == {"prefill", "refine"}
    x = rng.normal(size=8 + 3)
    for stage in ("prefill", "refine"):
        np.testing.assert_allclose(reader.heads[stage].survival(x),
                                   writer.heads[stage].survival(x))


def test_probe_width_and_matrix():
    assert probe_dim(576) == 576 and probe_dim(4096) == 512 and probe_dim(576, 64) == 64
    np.testing.assert_array_equal(probe_matrix(6, 6), np.eye(6))  # the hidden state itself
    m = probe_matrix(6, 3)  # a fixed random projection, the same on every replica
    assert m.shape == (6, 3) and np.abs(m).min() > 0 and np.array_equal(m, probe_matrix(6, 3))
    assert [g for g in range(100) if is_checkpoint(g, 32)] == [0, 32, 64, 96]
    assert [g for g in range(100) if is_checkpoint(g, 0)] == [0]
    # each stage's width names its Redis keys: a new configuration starts afresh
    keys = {length_head_key("m", s, d) for s in ("prefill", "refine") for d in (64, 576)}
    assert len(keys) == 4


def test_batched_learning_matches_row_by_row_and_the_worker_matches_inline():
    """learned_stats adds all rows in one product: the same statistics as adding each
    request's rows on its own; the background sync solves the same heads as an inline one."""
    rng = np.random.default_rng(9)
    refiners = [LengthRefiner(memory_stores(), RefinerConfig(
        min_requests=4, push_s=0, refresh_s=0, background=bg)) for bg in (True, False)]
    by_hand = {"prefill": HeadStats.zeros(12 + 3), "refine": HeadStats.zeros(12 + 3)}
    for i in range(12):
        points = None
        for refiner in refiners:
            seq = _request(f"r{i}", 3 + i, 20 + 7 * i)
            got = _run_to_limit(refiner, seq, np.random.default_rng(i), dim=12, every=16)
            points = points or got
            refiner.tick()
        for stage, stats in by_hand.items():
            rows = [(g, p) for g, p in points if stage == "refine" or g == 0]
            stats.add(np.stack([features(x, 3 + i, 20 + 7 * i, g) for g, x in rows]),
                      targets(np.array([20 + 7 * i - g for g, _ in rows])))
    for refiner in refiners:
        refiner.flush()
        assert refiner.learned == 12 and not refiner.queue
        for stage, stats in by_hand.items():
            got = refiner.stores[stage].load()
            assert got.requests == 12 and got.rows == stats.rows
            np.testing.assert_allclose(got.gram, stats.gram)
            np.testing.assert_allclose(got.cross, stats.cross)
    x = features(rng.normal(size=12), 5, 60, 16)
    np.testing.assert_allclose(*(r.heads["refine"].survival(x) for r in refiners))
    assert learned_stats([], "refine") is None


def test_served_stack_learns_both_heads_into_redis(demo_model_dir):
    """`pipellm up --hidden-length`: compute probes, learns in its worker and pushes both
    heads' statistics to Redis, under keys named by each stage's probe width."""
    import time

    from pipellm.services.compute.length.store import length_head_key
    from pipellm.shared.model_config import ModelConfig
    from tests.stack import Stack

    stack = Stack(demo_model_dir, "--served-model-name", "demo", "--hidden-length",
                  "--length-refine-every", "8").start()
    try:
        for i in range(6):
            status, body = stack.post("/v1/completions", {
                "model": "demo", "prompt": f"count to {i}", "max_tokens": 20 + i,
                "temperature": 0, "ignore_eos": True})
            assert status == 200, body
        hidden = ModelConfig.from_path(str(demo_model_dir)).hidden_size
        stores = {stage: RedisStore(redis.Redis.from_url(stack.redis.url),
                                    length_head_key(str(demo_model_dir), stage, dim))
                  for stage, dim in (("prefill", hidden), ("refine", hidden))}
        deadline = time.monotonic() + 20  # pushed within a second or so of finishing
        while time.monotonic() < deadline and any(
                (s.load() or HeadStats.zeros(1)).requests < 6 for s in stores.values()):
            time.sleep(0.2)
        prefill, refine = (stores[k].load() for k in ("prefill", "refine"))
    finally:
        stack.stop()
    assert prefill.requests == refine.requests == 6
    assert prefill.dim == refine.dim == hidden + 3  # the raw hidden state + 3 scalars
    assert prefill.rows == 6 and refine.rows == sum(len(range(0, 20 + i, 8)) for i in range(6))
