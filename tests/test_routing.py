"""Routing policies (pipellm/shared/routing.py): pure unit tests, no engine."""

from __future__ import annotations

import pytest

from pipellm.shared.routing import (
    POLICIES,
    CacheAware,
    NoHealthyReplica,
    PredictedLoad,
    PredictedLoadWithAffinity,
    PrefixIndex,
    ReplicaLoad,
    RoundRobin,
    RouteInfo,
    make_policy,
)


def req(prompt, predicted: int = 0) -> RouteInfo:
    prompt = tuple(prompt)
    return RouteInfo(prompt, len(prompt) + predicted)


def loads(*demands: int, queued: tuple[int, ...] = (), down: tuple[int, ...] = (),
          prefill: tuple[int, ...] = (), capacity: int = 0):
    q, p = queued or (0,) * len(demands), prefill or (0,) * len(demands)
    return [ReplicaLoad(demand=d, running=n, healthy=i not in down, prefill=b, capacity=capacity)
            for i, (d, n, b) in enumerate(zip(demands, q, p, strict=True))]


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_skips_unhealthy_replicas_and_fails_clearly_without_any(name):
    policy = make_policy(name)
    assert policy.name == name
    for k in range(6):
        picked = policy.choose(req(range(k, k + 40)), loads(0, 0, 0, down=(0, 2)))
        assert picked == 1
    for bad in ([], loads(0, 0, down=(0, 1))):
        with pytest.raises(NoHealthyReplica, match="no healthy replica"):
            policy.choose(req([1, 2, 3]), bad)


def test_make_policy_builds_fresh_policies_with_settings_and_lists_the_choices():
    a, b = make_policy("round-robin"), make_policy("round-robin")
    assert a is not b and [a.choose(req([1]), loads(0, 0)) for _ in range(3)] == [0, 1, 0]
    assert b.choose(req([1]), loads(0, 0)) == 0
    ca = make_policy("cache-aware", cache_threshold=0.9, balance_abs_threshold=4)
    assert isinstance(ca, CacheAware) and ca.cache_threshold == 0.9
    with pytest.raises(ValueError, match="round-robin, cache-aware, predicted-load"):
        make_policy("random")


def test_round_robin_cycles_over_the_healthy_replicas():
    rr = RoundRobin()
    assert [rr.choose(req([1]), loads(9, 0, 0)) for _ in range(4)] == [0, 1, 2, 0]
    assert [rr.choose(req([1]), loads(0, 0, 0, down=(2,))) for _ in range(3)] == [1, 0, 1]


def test_predicted_load_takes_the_least_demand_then_the_shortest_queue_then_the_index():
    pl = PredictedLoad()
    assert pl.choose(req([1]), loads(500, 300, 400)) == 1
    assert pl.choose(req([1]), loads(300, 300, 400, queued=(5, 2, 0))) == 1
    assert pl.choose(req([1]), loads(300, 300, queued=(2, 2))) == 0
    assert pl.choose(req([1]), loads(500, 100, 400, down=(1,))) == 2


def test_predicted_load_takes_the_least_prefill_backlog_where_the_request_fits():
    """The old rule (least demand) would take replica 0 each time: its KV demand is lower, but
    its prefill queue, what a new prompt's first token waits behind, is longer."""
    pl = PredictedLoad()
    assert pl.choose(req([1]), loads(100, 900, prefill=(5000, 200))) == 1
    assert pl.choose(req([1]), loads(500, 300, 400, prefill=(7, 7, 9))) == 1  # tie: demand
    # 900 + 1 + 200 over 1,000 slots: replica 1 would preempt, so the longer queue wins
    assert pl.choose(req([1], 200), loads(100, 900, prefill=(5000, 200), capacity=1000)) == 0
    # fits nowhere: the least demand for the capacity, whatever the backlog
    assert pl.choose(req([1], 2000), loads(700, 600, prefill=(0, 900), capacity=1000)) == 1
    assert pl.choose(req([1]), loads(100, 900, prefill=(5000, 200), down=(1,))) == 0


def test_replica_load_fits_its_capacity_and_any_demand_when_unknown():
    assert ReplicaLoad(demand=900, capacity=1000).fits(100)
    assert not ReplicaLoad(demand=900, capacity=1000).fits(101)
    assert ReplicaLoad(demand=10**9).fits(10**9)  # capacity 0: unknown


def test_prefix_index_matches_whole_blocks_and_keeps_a_bounded_lru():
    idx = PrefixIndex(block=4, max_tokens=16)
    a = list(range(10))  # blocks of 4, 4 and 2
    idx.insert(idx.keys(a), 0)
    assert idx.size(0) == 10 and idx.size(1) == 0
    assert idx.match(idx.keys(a), 0) == 10
    assert idx.match(idx.keys(a[:9]), 0) == 8  # the last block differs (shorter)
    assert idx.match(idx.keys([*a[:6], 99, 98]), 0) == 4
    assert idx.match(idx.keys([99, *a]), 0) == 0  # a prefix, not any substring
    assert idx.match(idx.keys(a), 1) == 0
    b = list(range(100, 108))
    idx.insert(idx.keys(b), 0)  # 18 tokens > 16: a's last block goes first (LRU, leaves first)
    assert idx.size(0) == 16
    assert idx.match(idx.keys(a), 0) == 8 and idx.match(idx.keys(b), 0) == 8
    idx.insert(idx.keys(a[:4]), 0)  # a's first block touched: the most recent
    idx.insert(idx.keys(range(200, 208)), 0)  # 24 tokens: a's second block, b's last go
    assert idx.size(0) == 16
    assert idx.match(idx.keys(a), 0) == 4 and idx.match(idx.keys(b), 0) == 4
    with pytest.raises(ValueError):
        PrefixIndex(block=0)


def test_cache_aware_follows_the_longest_prefix_else_the_smallest_tree():
    ca = CacheAware(block=4)
    conv = list(range(1, 41))
    assert ca.choose(req(conv), loads(0, 0, 0)) == 0  # all trees empty: the first
    other = list(range(100, 120))
    assert ca.choose(req(other), loads(0, 0, 0)) == 1  # no match: the smallest tree
    assert ca.choose(req([*conv, 7, 7, 7, 7]), loads(0, 0, 0)) == 0  # 40/44 matched
    assert ca.choose(req([*other, *range(300, 340)]), loads(0, 0, 0)) == 2  # 20/60 < 0.5
    assert ca.choose(req([*other, *range(400, 412)]), loads(0, 0, 0)) == 1  # 20/32 >= 0.5
    # the cached replica is down: the prompt goes to the smallest healthy tree
    assert ca.choose(req(conv), loads(0, 0, 0, down=(0,))) == 1


def test_cache_aware_balances_when_queues_differ_by_both_thresholds():
    ca = CacheAware(block=4)
    conv = list(range(1, 41))
    assert ca.choose(req(conv), loads(0, 0)) == 0
    assert ca.choose(req(conv), loads(0, 0, queued=(32, 0))) == 0  # 32 is not over 32
    assert ca.choose(req(conv), loads(0, 0, queued=(40, 5))) == 1  # imbalanced: least queued
    assert ca.choose(req(conv), loads(0, 0, queued=(40, 5))) == 1  # now cached at both
    strict = CacheAware(block=4, balance_abs_threshold=2, balance_rel_threshold=2.0)
    assert strict.choose(req(conv), loads(0, 0)) == 0
    assert strict.choose(req(conv), loads(0, 0, queued=(12, 7))) == 0  # 12 < 2 x 7: balanced
    assert strict.choose(req(conv), loads(0, 0, queued=(15, 7))) == 1


def test_predicted_load_with_affinity_keeps_a_prefix_while_the_load_is_close():
    pa = PredictedLoadWithAffinity(margin=0.1, min_margin=100, block=4)
    conv = list(range(1, 41))
    assert pa.choose(req(conv), loads(1000, 2000)) == 0  # nothing cached: least demand
    nxt = [*conv, 5, 6, 7, 8]
    assert pa.choose(req(nxt), loads(3000, 1000)) == 0  # no backlog anywhere: the prefix
    assert pa.choose(req(nxt), loads(1000, 1000, prefill=(2000, 0))) == 1  # 1956 over
    more = [*nxt, 9, 9, 9, 9]  # 44 tokens recorded at both, 0 and 1
    assert pa.choose(req(more), loads(1000, 1000, prefill=(0, 50))) == 0  # the least backlog
    assert pa.choose(req(more), loads(3000, 1000, prefill=(0, 50), capacity=3000)) == 1  # no room
    other = list(range(200, 240))
    assert pa.choose(req(other), loads(0, 10)) == 0
    # 1040 - 40 matched over the least backlog, 0: within 10% of its demand, 10,000
    assert pa.choose(req(other), loads(10_900, 10_000, prefill=(1040, 0))) == 0
    assert pa.choose(req(other), loads(10_900, 10_000, prefill=(1041, 0))) == 1
    assert pa.choose(req(nxt), loads(100, 0, down=(0,))) == 1
    # nothing shared: exactly predicted-load
    assert pa.choose(req(range(500, 540)), loads(300, 200, 400)) == \
        PredictedLoad().choose(req(range(500, 540)), loads(300, 200, 400))


def test_predicted_load_with_affinity_weighs_the_backlog_less_the_matched_prefill():
    conv = list(range(1, 41))
    nxt = [*conv, 5, 6, 7, 8]  # 40 of its 44 tokens recorded at replica 0
    for backlog, pick in ((5140, 0), (5141, 1)):  # 5140 - 40 = 5000 + the 100-token margin
        pa = PredictedLoadWithAffinity(margin=0.1, min_margin=100, block=4)
        assert pa.choose(req(conv), loads(0, 0)) == 0
        assert pa.choose(req(nxt), loads(1000, 1000, prefill=(backlog, 5000))) == pick
    pa = PredictedLoadWithAffinity(margin=0.1, min_margin=100, block=4)
    assert pa.choose(req(conv), loads(0, 0)) == 0
    assert pa.choose(req(nxt, 100), loads(1000, 0, capacity=1100)) == 1  # it would not fit


def test_backlogs_within_one_step_leave_the_choice_to_demand():
    """A few prompt tokens more to prefill make no wait within one step: KV demand decides; a
    whole step more does."""
    req = RouteInfo((1, 2, 3), 10)
    loads = [ReplicaLoad(demand=500, prefill=10, step_tokens=512),
             ReplicaLoad(demand=100, prefill=40, step_tokens=512)]
    assert PredictedLoad().choose(req, loads) == 1
    loads[1].prefill = 600
    assert PredictedLoad().choose(req, loads) == 0
