"""Scaling out in the simulator: QPS at the SLO of 1, 2, 4 and 8 replicas behind a router.

Every number here is SIMULATED. Each replica is the real engine (scheduler, KV allocator, prefix
cache) on its own modelled GPU (pipellm/services/compute/sim, an H100 serving Llama-3-8B by
default), all on one virtual timeline (pipellm/services/compute/sim_cluster.py), fed by one router
running a policy of pipellm/shared/routing.py: round robin, SGLang's cache-aware policy,
predicted-load (where the request's predicted KV fits, the least prefill backlog, then the least
predicted KV demand) and predicted-load with prefix affinity. The engine settings are
bench/prefix_sim.py's (the engine's defaults, prefix caching on, oracle predicted lengths: the
true output length, so predicted-load sees each request's true KV demand), and so are the
workloads (prompts as token ids, each distinct text piece a run of seeded random ids):

    azure      the Azure 2023 conversation trace, its own arrival times scaled to the rate; it
               has no text, so every prompt is unique (no prefix hits)
    multiturn  ShareGPT lengths as 4-turn conversations, turn by turn across them (each
               conversation moved up to a quarter of a turn's block: `jitter_turns`), Poisson
               arrivals; a turn's prompt holds the previous turn's prompt and answer

Each replica count N serves N x --requests requests (the first ones of the trace, or N x
--requests / 4 conversations), so that every replica sees about --requests requests and a run
at N x the rate lasts as long for every N. The SLO is bench/ablation.py's: every request
completes, p99 TTFT <= 3 s, p99 TPOT <= 50 ms. QPS at the SLO (total over the replicas) is
found as in the ablation (`rate_search`): from a starting rate up (or down) by a growing
factor while the outcome stays the same, then bisected geometrically between the last pass
and the first failure: N = 1 starts at --start-qps, factor 2, and bisects to 2^(2^-bisect_1);
N > 1 starts from linear scaling of the same policy's last count measured, factor --factor,
to --factor^(2^-bisect). With one replica every policy routes alike, so N = 1 runs once.

Then, at the top count, every policy runs at the highest QPS at the SLO any policy reached
there (its TTFTs at one rate: finer than the searches' steps; --no-same-rate skips it).

    python -m bench.scale_sim [--quick] [--replicas 1,2,4,8] [--requests 1000] [--jobs 1]
        [--workloads azure,multiturn] [--policies round-robin,cache-aware,predicted-load,...]

The engine's Python costs about 3 ms of CPU a simulated request, so the full run (a search is
4-5 runs of N x 1000 requests) takes about 35 min on 2 EPYC cores, 18 min with --jobs 2
(searches in two processes); --quick (1 and 2 replicas, 200 requests each) 15-25 s. Fewer
requests are no shortcut: with a few hundred a replica, a run is mostly its start-up transient
and the QPS at the SLO comes out 1.5-10x too high (a burst that fits in the KV cache meets the
SLO at any rate).

A priority mix (issue 51): `--interactive-share X` sends a seeded share X of the requests at
priority 0, the rest at 1, with `--scheduling-policy` (fcfs, priority or predicted) on every
replica; the SLO still holds over all requests, and every row adds the interactive class's p99
TTFT (`p99_ttft_ms_interactive`). The router does not look at priorities (each replica orders
its own queue).

Targets (issue 37): 8 replicas >= 0.95 x 8 = 7.6 x one replica's QPS at the SLO, and
predicted-load at least as good as cache-aware on the Azure trace. The last line printed is one
JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.ablation import MAX_QPS, SLO_TPOT_MS, SLO_TTFT_MS, meets_slo  # noqa: E402
from bench.common import log, machine  # noqa: E402
from bench.prefix_sim import TURNS, PrefixWorkload  # noqa: E402
from bench.virtual import RequestRecord, percentile, summarize  # noqa: E402
from pipellm.services.compute.engine import StepResult  # noqa: E402
from pipellm.services.compute.sim.hardware import model as model_spec  # noqa: E402
from pipellm.services.compute.sim_cluster import SimCluster  # noqa: E402
from pipellm.shared.config import EngineConfig, SchedulingPolicyName  # noqa: E402
from pipellm.shared.routing import POLICIES, make_policy  # noqa: E402
from pipellm.shared.sampling import InvalidParams, SamplingParams  # noqa: E402
from pipellm.shared.settings import with_settings  # noqa: E402

WORKLOADS = ("azure", "multiturn")
TARGET_LINEAR = 0.95  # N replicas: at least 0.95 N x one replica's QPS at the SLO
ONE = "(any)"  # the policy of the N = 1 row: one replica, every policy routes alike
# (workload, policy): the policy it routes exactly as there. No two Azure prompts share a
# 16-token block (each is unique), so the affinity never applies.
SAME_AS = {("azure", "predicted-load-affinity"): "predicted-load"}


def simulate_cluster(config: EngineConfig, replicas: int, policy: str,
                     items: Sequence[tuple], seed: int = 0, late_ttft_s: float = math.inf,
                     max_late: int | None = None) -> tuple[list[RequestRecord], dict]:
    """Run `items` ((arrival, prompt_len, output_len, predicted, max_tokens, prompt ids[,
    priority]), as bench/virtual.py's) through `replicas` engines routed by `policy`: the
    records, in item order, and the cluster's counters. With `max_late`, it stops (requests
    left unfinished) once more than `max_late` requests got their first token over
    `late_ttft_s` late."""
    cluster = SimCluster(config, replicas, make_policy(policy))
    records = [RequestRecord(i, float(w[0]), int(w[1]), int(w[2])) for i, w in enumerate(items)]
    order = sorted(range(len(items)), key=lambda i: records[i].arrival)
    rng, live, nxt, late = random.Random(seed), {}, 0, 0
    while nxt < len(order) or cluster.has_work():
        arrival = records[order[nxt]].arrival if nxt < len(order) else math.inf
        if arrival <= cluster.next_step():
            _route(cluster, records[order[nxt]], items[order[nxt]], rng, live)
            nxt += 1
            continue
        i, before, result = cluster.step(arrival)
        late += _record(result, live, before, cluster.replicas[i].clock.now, late_ttft_s)
        if max_late is not None and late > max_late:
            break
    return records, cluster.stats()


def _route(cluster: SimCluster, rec: RequestRecord, item: tuple, rng: random.Random,
           live: dict[str, RequestRecord]) -> None:
    ids = list(item[5]) if len(item) > 5 and item[5] else [1] * rec.prompt_len
    rec.max_tokens = int(item[4]) if len(item) > 4 and item[4] else rec.output_len
    predicted = item[3] if len(item) > 3 else None
    try:
        params = SamplingParams(max_tokens=rec.max_tokens, seed=rng.getrandbits(63))
        cluster.add(rec.arrival, ids, params, str(rec.index), predicted, rec.output_len,
                    priority=item[6] if len(item) > 6 else 0)
    except InvalidParams:
        rec.finish, rec.finish_reason = rec.arrival, "rejected"
        return
    live[str(rec.index)] = rec


def _record(result: StepResult, live: dict[str, RequestRecord], start: float, end: float,
            late_ttft_s: float) -> int:
    """A step's admissions (at its start) and tokens (at its end) into the records; how many
    first tokens came over `late_ttft_s` after their request's arrival."""
    late = 0
    for rid in result.admitted:
        rec = live[rid]
        rec.admissions += 1
        rec.admitted = start if rec.admitted is None else rec.admitted
    for e in result.outputs:
        rec = live[e.request_id]
        if rec.first_token is None:
            rec.first_token = end
            late += end - rec.arrival > late_ttft_s
        rec.token_times.append(end)
        if e.finish_reason is not None:
            rec.finish, rec.finish_reason = end, e.finish_reason
            del live[e.request_id]
    return late


def rate_search(ok: Callable[[float], dict | None], start: float, factor: float,
                bisect: int, top: float = MAX_QPS) -> dict | None:
    """The summary at the highest rate found meeting the SLO (`ok`: its summary, or None when
    it misses). First `top`, where the requests come as one burst: if that passes, its
    summary marked "absorbed" (the SLO holds at every rate: no QPS at the SLO to find). Then
    from `start` up while it passes (down while it fails), by `factor`, then its square, its
    fourth power...; then geometric bisection between the last pass and the first failure
    until they are at most factor^(2^-bisect) apart. None if it fails down to 1/64 req/s."""
    if burst := ok(top):
        return burst | {"absorbed": True}
    passed = ok(start)
    failed, qps, step = (None if passed else start), start, factor
    while passed is None or failed is None:
        qps = min(qps * step, top) if failed is None else qps / step
        if qps < 1 / 64:
            return None
        s = None if qps == top else ok(qps)  # the burst failed
        passed, failed = (s, failed) if s else (passed, qps)
        step *= step
    lo, hi = passed["qps"], failed
    while hi / lo > factor ** (0.5 ** bisect) * (1 + 1e-9):
        mid = math.sqrt(lo * hi)
        if s := ok(mid):
            passed, lo = s, mid
        else:
            hi = mid
    return passed


def jitter_turns(wl: PrefixWorkload, seed: int) -> None:
    """Multiturn: within each turn's block of conversations, move each conversation by up to a
    quarter of the block (sorted by position + a seeded uniform jitter). Otherwise a
    conversation's next turn comes exactly one block after its last, and with a block a
    multiple of the replica count round robin sends all of a conversation's turns to one
    replica."""
    chats, rng, items = -(-len(wl.items) // TURNS), random.Random(seed), []
    for k in range(0, len(wl.items), chats):
        block = wl.items[k : k + chats]
        order = sorted(range(len(block)), key=lambda c: c + rng.uniform(0, chats / 4))
        items += [block[c] for c in order]
    wl.items = items


def run(args, config: EngineConfig, wl: PrefixWorkload, replicas: int, policy: str,
        qps: float, stop_early: bool = True) -> dict:
    """One simulation at `qps`: bench/virtual.py's summary, the prefix hit rate and how evenly
    requests were routed (most routed to one replica / the mean). `stop_early`: stop once the
    SLO surely fails (the summary then misses it)."""
    items = with_priorities(wl.at(qps, "oracle"), args.interactive_share, args.seed)
    # the SLO surely fails (p99 TTFT over it) once n - floor(0.99 (n - 1)) TTFTs are over it
    max_late = len(items) - math.floor(0.99 * (len(items) - 1)) - 1 if stop_early else None
    records, stats = simulate_cluster(config, replicas, policy, items, args.seed,
                                      SLO_TTFT_MS / 1e3, max_late)
    s = summarize(records)
    routed = stats["routed"]
    fast = [r.ttft * 1e3 for r in records if args.interactive_share and
            r.first_token is not None and items[r.index][6] == 0]  # (none without a mix)
    return s | {"qps": qps, "ttft_ms_p99_interactive": percentile(fast, 99),
                "preemptions": stats["preemptions"],
                "hit_rate": stats["prefix_hits"] / max(stats["prefix_queries"], 1),
                "routed_max_over_mean": max(routed) * len(routed) / max(sum(routed), 1)}


def with_priorities(items: list[tuple], share: float, seed: int) -> list[tuple]:
    """`items` (arrival, prompt, output, predicted, max_tokens, ids) with a priority each: 0
    for a seeded random `share` of them (interactive), else 1; all 0 when share is 0."""
    rng = random.Random(seed + 1)
    return [(*it[:6], 0 if not share or rng.random() < share else 1) for it in items]


def workload_at(args, name: str, replicas: int) -> PrefixWorkload:
    """`name`'s requests for `replicas` replicas: --requests per replica."""
    wl = PrefixWorkload(name, args.requests * replicas, model_spec(args.model).context,
                        args.seed)
    if name == "multiturn":
        jitter_turns(wl, args.seed)
    return wl


def search(args, config: EngineConfig, workload: str, n: int, policy: str,
           prev: tuple[int, float] | None) -> dict:
    """The row of `n` replicas routed by `policy` (ONE: a single replica). `prev`: (replicas,
    QPS at the SLO) of the policy's last count measured, to start from linear scaling; None:
    from --start-qps per replica."""
    t0, wl = time.perf_counter(), workload_at(args, workload, n)
    name = args.policies[0] if policy == ONE else policy

    def ok(qps: float) -> dict | None:
        s = run(args, config, wl, n, name, qps)
        return s if meets_slo(s) else None

    if prev is None:
        at = rate_search(ok, args.start_qps * n, 2.0, args.bisect_1, MAX_QPS * n)
    else:
        at = rate_search(ok, prev[1] * n / prev[0], args.factor, args.bisect, MAX_QPS * n)
    out = row(workload, n, policy, at, time.perf_counter() - t0)
    log(f"{workload} x{n} {policy}: {out['qps_at_slo']} req/s at the SLO "
        f"({out['wall_s']:.0f} s{', every rate met it' if out['burst_absorbed'] else ''})")
    return out


def chain(args, config: EngineConfig, workload: str, policy: str, one: dict | None,
          ) -> list[dict]:
    """`policy`'s rows for each replica count above 1, in order."""
    rows, prev = [], (1, one["qps_at_slo"]) if one and one["qps_at_slo"] else None
    for n in args.replicas:
        if n > 1:
            rows.append(search(args, config, workload, n, policy, prev))
            prev = (n, rows[-1]["qps_at_slo"]) if rows[-1]["qps_at_slo"] else prev
    return rows


def measure(args, config: EngineConfig, mapper=map) -> list[dict]:
    """Every workload's rows: one replica first, then each policy's counts (`mapper`: map, or
    a process pool's). A policy identical to another on a workload (SAME_AS) copies its rows."""
    workloads = args.workloads.split(",")
    ones = list(mapper(search, *zip(*[(args, config, w, 1, ONE, None) for w in workloads],
                                     strict=True))) if 1 in args.replicas else []
    one = {r["workload"]: r for r in ones}
    tasks = [(args, config, w, p, one.get(w)) for w in workloads for p in args.policies
             if SAME_AS.get((w, p)) not in args.policies]
    rows = ones + [r for rs in mapper(chain, *zip(*tasks, strict=True)) for r in rs]
    for (w, p), same in SAME_AS.items():
        if w in workloads and p in args.policies and same in args.policies:
            rows += [r | {"policy": p, "same_as": same} for r in rows
                     if r["workload"] == w and r["policy"] == same]
    order = {p: i for i, p in enumerate([ONE, *args.policies])}
    return sorted(rows, key=lambda r: (workloads.index(r["workload"]), r["replicas"],
                                       order[r["policy"]]))


def at_rate(args, config: EngineConfig, workload: str, n: int, policy: str, qps: float,
            ) -> dict:
    """`policy` on `n` replicas at `qps`, run to the end: TTFTs and whether the SLO held."""
    s = run(args, config, workload_at(args, workload, n), n, policy, qps, stop_early=False)
    return {"workload": workload, "replicas": n, "policy": policy, "qps": qps,
            "meets_slo": meets_slo(s), "p50_ttft_ms": round(s["ttft_ms_p50"], 1),
            "p99_ttft_ms": round(s["ttft_ms_p99"], 1), "mean_ttft_ms": round(s["ttft_ms_mean"], 1),
            "p99_tpot_ms": round(s["tpot_ms_p99"], 2), "hit_rate": round(s["hit_rate"], 3),
            "p99_ttft_ms_interactive": _round(s["ttft_ms_p99_interactive"])}


def same_rate(args, config: EngineConfig, rows: list[dict], mapper=map) -> list[dict]:
    """At the top replica count, every policy at the highest QPS at the SLO any policy reached
    there (as printed, to 0.01 req/s): their TTFTs at one rate, a finer comparison than the
    searches' steps."""
    top, tasks = max(args.replicas), []
    for w in args.workloads.split(","):
        at_top = [r for r in rows if (r["workload"], r["replicas"]) == (w, top)
                  and r["policy"] != ONE and not r.get("same_as")]
        rates = [r["qps_at_slo"] for r in at_top if r["qps_at_slo"]]
        tasks += [(args, config, w, top, r["policy"], max(rates)) for r in at_top if rates]
    return list(mapper(at_rate, *zip(*tasks, strict=True))) if tasks else []


def row(workload: str, n: int, policy: str, at: dict | None, wall: float) -> dict:
    r, at = _round, at or {}
    measured = bool(at) and not at.get("absorbed")  # else: no rate missed the SLO
    return {"workload": workload, "replicas": n, "policy": policy,
            "qps_at_slo": r(at["qps"], 2) if measured else None,
            "burst_absorbed": bool(at.get("absorbed")),
            "qps_per_replica": r(at["qps"] / n, 2) if measured else None,
            "p99_ttft_ms": r(at.get("ttft_ms_p99")), "p99_tpot_ms": r(at.get("tpot_ms_p99"), 2),
            "p50_ttft_ms": r(at.get("ttft_ms_p50")), "hit_rate": r(at.get("hit_rate"), 3),
            "p99_ttft_ms_interactive": r(at.get("ttft_ms_p99_interactive")),
            "preemptions": at.get("preemptions"),
            "routed_max_over_mean": r(at.get("routed_max_over_mean"), 3), "wall_s": r(wall)}


def _round(x, nd=1):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, nd)


def headline(args, rows: list[dict]) -> dict:
    """Per workload and policy: QPS at the SLO by replica count and the top count's ratio to
    one replica; predicted-load / cache-aware at each count; whether the targets are met."""
    top = max(args.replicas)
    qps: dict = {}
    for r in rows:
        for policy in args.policies if r["policy"] == ONE else [r["policy"]]:
            qps.setdefault(r["workload"], {}).setdefault(policy, {})[r["replicas"]] = \
                r["qps_at_slo"]
    scaling = {w: {p: _ratio(q.get(top), q.get(1)) for p, q in by.items()}
               for w, by in qps.items()}
    vs_ca = {w: {p: {n: _ratio(q.get(n), by.get("cache-aware", {}).get(n))
                     for n in args.replicas if n > 1} for p, q in by.items() if p != "cache-aware"}
             for w, by in qps.items()}
    pl_vs_ca = {w: by.get("predicted-load", {}) for w, by in vs_ca.items()}
    linear = {w: {p: None if x is None else x >= TARGET_LINEAR * top for p, x in by.items()}
              for w, by in scaling.items()}
    azure = pl_vs_ca.get("azure", {}).get(top)
    return {"qps_at_slo": qps, f"scaling_{top}_vs_1": scaling,
            "predicted_load_vs_cache_aware": pl_vs_ca, "vs_cache_aware": vs_ca,
            "targets": {f"{top}_replicas_ge_{TARGET_LINEAR * top:g}x": linear,
                        "predicted_load_ge_cache_aware_azure":
                            None if azure is None else azure >= 1.0}}


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def print_report(args, rows: list[dict], head: dict, same: list[dict]) -> None:
    top = max(args.replicas)
    print("\n| workload | policy | " + " | ".join(f"{n} replica{'s' * (n > 1)}"
                                                  for n in args.replicas)
          + f" | {top} vs 1 |")
    print("|---|---|" + "---|" * (len(args.replicas) + 1))
    for w, by in head["qps_at_slo"].items():
        for p, q in by.items():
            cells = " | ".join("-" if q.get(n) is None else f"{q[n]:.1f}" for n in args.replicas)
            print(f"| {w} | {p} | {cells} | {head[f'scaling_{top}_vs_1'][w][p]} |")
    print("\n| workload | replicas | policy | QPS at SLO | per replica | p99 TTFT ms | p99 TPOT ms "
          "| p50 TTFT ms | hit rate | preemptions | routed max/mean | interactive p99 TTFT ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['replicas']} | {r['policy']} | {r['qps_at_slo']} | "
              f"{r['qps_per_replica']} | {r['p99_ttft_ms']} | {r['p99_tpot_ms']} | "
              f"{r['p50_ttft_ms']} | {r['hit_rate']} | {r['preemptions']} | "
              f"{r['routed_max_over_mean']} | {r['p99_ttft_ms_interactive']} |")
    if same:
        print("\n| workload | replicas | at QPS | policy | p50 TTFT ms | mean TTFT ms "
              "| p99 TTFT ms | p99 TPOT ms | hit rate | SLO met | interactive p99 TTFT ms |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in same:
            print(f"| {r['workload']} | {r['replicas']} | {r['qps']} | {r['policy']} | "
                  f"{r['p50_ttft_ms']} | {r['mean_ttft_ms']} | {r['p99_ttft_ms']} | "
                  f"{r['p99_tpot_ms']} | {r['hit_rate']} | {r['meets_slo']} | "
                  f"{r['p99_ttft_ms_interactive']} |")
    print()
    for w, by in head["predicted_load_vs_cache_aware"].items():
        print(f"{w}: predicted-load / cache-aware QPS at the SLO by replicas: {by}")
    for name, met in head["targets"].items():
        print(f"target {name}: {met}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--replicas", default="1,2,4,8")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--requests", type=int, default=1000, help="per replica")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--start-qps", type=float, default=16.0, help="N = 1's first rate")
    p.add_argument("--bisect-1", type=int, default=6, help="N = 1's bisections")
    p.add_argument("--factor", type=float, default=1.05, help="N > 1's search factor")
    p.add_argument("--bisect", type=int, default=2, help="N > 1's bisections")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduling-policy", default="fcfs", choices=list(SchedulingPolicyName),
                   help="every replica's --scheduling-policy")
    p.add_argument("--interactive-share", type=float, default=0.0,
                   help="share of requests sent at priority 0 (the rest at 1); 0: all at 0")
    p.add_argument("--no-same-rate", dest="same_rate", action="store_false",
                   help="skip running every policy at the top count's best QPS at the SLO")
    p.add_argument("--jobs", type=int, default=1, help="searches run at once (processes)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1 and 2 replicas, 200 requests each, coarse searches")
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.requests = "1,2", min(args.requests, 200)
        args.bisect_1, args.bisect, args.factor = min(args.bisect_1, 3), 1, 1.1
    args.replicas = sorted({int(n) for n in args.replicas.split(",")})
    args.policies = args.policies.split(",")
    for name in args.policies:
        make_policy(name)  # ValueError with the choices for an unknown name
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    config = with_settings(EngineConfig(), backend="sim", sim_clock="virtual", sim_gpu=args.gpu,
                           sim_model=args.model,
                           enable_prefix_caching=not args.no_prefix_caching,
                           scheduling_policy=args.scheduling_policy)
    print(f"machine: {machine()}; simulated {args.model} on {args.gpu} per replica; "
          f"{args.requests} requests per replica; SLO p99 TTFT {SLO_TTFT_MS:.0f} ms, p99 TPOT "
          f"{SLO_TPOT_MS:.0f} ms; oracle lengths; prefix caching "
          f"{'off' if args.no_prefix_caching else 'on'}")
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) if args.jobs > 1 else nullcontext() as pool:
        mapper = pool.map if pool else map
        rows = measure(args, config, mapper)
        same = same_rate(args, config, rows, mapper) if args.same_rate else []
    head = headline(args, rows)
    print_report(args, rows, head, same)
    out = head | {"same_rate": same, "model": args.model, "gpu": args.gpu,
                  "requests_per_replica": args.requests, "predict": "oracle",
                  "prefix_caching": not args.no_prefix_caching,
                  "scheduling_policy": str(args.scheduling_policy),
                  "interactive_share": args.interactive_share,
                  "wall_s": round(time.perf_counter() - t0, 1), "machine": machine()}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
