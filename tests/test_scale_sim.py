"""The cluster simulation (pipellm/services/compute/sim_cluster.py) and bench/scale_sim.py: replicas
on one virtual timeline serve every request, one replica replays bench/virtual.py exactly,
predicted-load beats round robin on a skewed load, the rate search and a small run of the
bench end with its JSON line."""

from __future__ import annotations

import json
import math

import pytest

from bench import scale_sim
from bench.virtual import simulate, summarize
from pipellm.services.compute.sim_cluster import SimCluster, engine_demand
from pipellm.shared.config import EngineConfig
from pipellm.shared.routing import RoundRobin
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.settings import with_settings

CONFIG = with_settings(EngineConfig(), backend="sim", sim_clock="virtual", sim_gpu="h100",
                       sim_model="llama-3-8b", enable_prefix_caching=True)


def items(n: int, gap: float, lengths) -> list[tuple]:
    """n requests `gap` s apart, (prompt, output) from lengths(i), unique prompts, oracle."""
    out = []
    for i in range(n):
        p, o = lengths(i)
        out.append((i * gap, p, o, o, o, tuple(1000 * i + 3 + k % 997 for k in range(p))))
    return out


def test_two_replicas_finish_every_request_and_demand_follows_the_engines():
    cluster = SimCluster(CONFIG, 2, RoundRobin())
    for i in range(6):
        params = SamplingParams(max_tokens=20 + i)
        cluster.add(0.1 * i, [5 + i] * (100 + i), params, f"r{i}", 20 + i)
    assert [r.routed for r in cluster.replicas] == [3, 3]
    for r in cluster.replicas:
        assert r.demand == engine_demand(r.engine) == sum(100 + i + 20 + i for i in range(6)
                                                            if f"r{i}" in r.held)
    done = set()
    while cluster.has_work():
        i, start, result = cluster.step()
        assert cluster.replicas[i].clock.now >= start
        done |= {e.request_id for e in result.outputs if e.finish_reason is not None}
        for r in cluster.replicas:
            assert r.demand == engine_demand(r.engine)
    assert done == {f"r{i}" for i in range(6)}
    assert all(r.demand == 0 and r.load().queued == 0 for r in cluster.replicas)

    records, stats = scale_sim.simulate_cluster(
        CONFIG, 2, "predicted-load", items(40, 0.05, lambda i: (200 + 37 * i, 30 + i)))
    assert all(r.finish_reason == "length" and r.generated == r.output_len for r in records)
    assert sum(stats["routed"]) == 40 and min(stats["routed"]) > 0


def test_the_prefill_backlog_is_what_the_engine_publishes_and_drains_as_it_prefills():
    cluster = SimCluster(CONFIG, 1, RoundRobin())
    for i in range(3):
        cluster.add(0.0, [7 + i] * 400, SamplingParams(max_tokens=8), f"r{i}", 8)
    replica = cluster.replicas[0]
    load = replica.load()
    assert load.prefill == replica.engine.stats().prefill == 1200 and load.waiting == 3
    assert load.capacity == replica.engine.stats().capacity > 0
    backlog = [load.prefill]
    while cluster.has_work():
        cluster.step()
        backlog.append(replica.load().prefill)
        assert backlog[-1] == replica.engine.stats().prefill
    # 512-token steps, decodes first: the second step also decodes the first request
    assert backlog[:4] == [1200, 688, 177, 0] and set(backlog[4:]) == {0}


def test_one_replica_replays_the_single_engine_simulation_exactly():
    wl = items(60, 0.02, lambda i: (300 + 50 * (i % 7), 40 + 5 * (i % 5)))
    one, _ = scale_sim.simulate_cluster(CONFIG, 1, "cache-aware", wl)
    assert summarize(one) == summarize(simulate(CONFIG, wl))


def test_predicted_load_beats_round_robin_on_a_skewed_load():
    """Every other request is long: round robin sends all of them to replica 0."""
    wl = items(60, 0.01, lambda i: (3000, 300) if i % 2 == 0 else (50, 10))
    rr = summarize(scale_sim.simulate_cluster(CONFIG, 2, "round-robin", wl)[0])
    pl = summarize(scale_sim.simulate_cluster(CONFIG, 2, "predicted-load", wl)[0])
    assert pl["completed"] == rr["completed"] == 60
    assert pl["ttft_ms_p99"] < 0.8 * rr["ttft_ms_p99"]
    assert pl["duration_s"] < rr["duration_s"]


def test_rate_search_brackets_the_threshold():
    def ok(qps):
        return {"qps": qps} if qps <= 37.3 else None

    found = scale_sim.rate_search(ok, 16.0, 2.0, 6)["qps"]
    assert 37.3 / 2 ** (1 / 64) <= found <= 37.3
    found = scale_sim.rate_search(ok, 80.0, 1.05, 2)["qps"]
    assert 37.3 / 1.05 ** 0.25 <= found <= 37.3
    assert scale_sim.rate_search(lambda q: {"qps": q}, 16.0, 2.0, 2, top=100)["absorbed"]
    assert scale_sim.rate_search(lambda q: None, 16.0, 2.0, 2) is None


def test_jitter_turns_permutes_within_each_turn():
    args = scale_sim.parse_args(["--requests", "40"])
    wl = scale_sim.workload_at(args, "multiturn", 2)  # 80 requests: 4 turns of 20
    plain = scale_sim.PrefixWorkload("multiturn", 80, 8192, args.seed)
    assert wl.items != plain.items
    for k in range(0, 80, 20):
        assert sorted(wl.items[k:k + 20]) == sorted(plain.items[k:k + 20])


def test_bench_small_run_ends_with_its_json(capsys):
    """60 requests a replica fit at once (every rate meets the SLO): the searches end at the
    burst, and the headline says so (None) rather than a rate."""
    out = scale_sim.main(["--quick", "--requests", "60", "--policies",
                          "round-robin,predicted-load,predicted-load-affinity"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["requests_per_replica"] == 60 and set(line["qps_at_slo"]) == {"azure",
                                                                              "multiturn"}
    for by in line["qps_at_slo"].values():
        assert set(by) == {"round-robin", "predicted-load", "predicted-load-affinity"}
        assert all(set(q) == {"1", "2"} for q in by.values())
    assert line["qps_at_slo"]["azure"]["predicted-load-affinity"] == \
        line["qps_at_slo"]["azure"]["predicted-load"]  # nothing shared: the same routing
    assert all(q == {"1": None, "2": None} for by in line["qps_at_slo"].values()
               for q in by.values())
    assert line["targets"]["2_replicas_ge_1.9x"]["azure"]["round-robin"] is None
    assert out["gpu"] == "h100"
    assert line["targets"]["predicted_load_ge_cache_aware_azure"] is None  # not run


@pytest.mark.parametrize("bad", [0, -1])
def test_cluster_needs_a_replica(bad):
    with pytest.raises(ValueError):
        SimCluster(CONFIG, bad, RoundRobin())
    assert math.isinf(SimCluster(CONFIG, 1, RoundRobin()).next_step())


def test_a_requests_priority_reaches_whichever_replica_serves_it():
    """Round robin over two replicas: each request's Sequence, on either replica, carries the
    priority it was added with; under the priority policy the most urgent of the queued runs
    first."""
    config = with_settings(CONFIG, scheduling_policy="priority", max_running=1)
    cluster = SimCluster(config, 2, RoundRobin())
    priorities = [5, 3, -1, 0, 2, -4]
    for i, p in enumerate(priorities):
        cluster.add(0.0, [9 + i] * 50, SamplingParams(max_tokens=4), f"r{i}", 4, priority=p)
    seen = {rid: seq.priority for r in cluster.replicas for rid, seq in r.engine.requests.items()}
    assert seen == {f"r{i}": p for i, p in enumerate(priorities)}
    assert [r.routed for r in cluster.replicas] == [3, 3]
    first = {}
    while cluster.has_work():
        i, _, result = cluster.step()
        for e in result.outputs:
            first.setdefault(i, e.request_id)
    assert first == {0: "r2", 1: "r5"}  # replica 0 holds r0, r2, r4; replica 1 r1, r3, r5


def test_the_bench_runs_a_priority_mix_through_the_cluster():
    """--interactive-share: a seeded share of the requests at priority 0, the rest 1, reaching
    the replicas' priority policy: the interactive class's TTFT beats the batch class's."""
    args = scale_sim.parse_args(["--scheduling-policy", "priority", "--interactive-share",
                                 "0.2", "--requests", "80"])
    mixed = scale_sim.with_priorities([(0.0, 1, 1, 1, 1, ())] * 200, 0.2, 0)
    assert 20 <= sum(p == 0 for *_, p in mixed) <= 60 and {p for *_, p in mixed} == {0, 1}
    assert {p for *_, p in scale_sim.with_priorities(mixed, 0.0, 0)} == {0}
    config = with_settings(CONFIG, scheduling_policy=args.scheduling_policy, max_running=4)
    wl = items(80, 0.0, lambda i: (300, 60))  # one burst: a queue at each replica
    recs, _ = scale_sim.simulate_cluster(config, 2, "round-robin",
                                         scale_sim.with_priorities(wl, 0.2, 0))
    prio = scale_sim.with_priorities(wl, 0.2, 0)
    fast = [r.ttft for r in recs if prio[r.index][6] == 0]
    slow = [r.ttft for r in recs if prio[r.index][6] == 1]
    assert fast and max(fast) < sorted(slow)[len(slow) // 2]
