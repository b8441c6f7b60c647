"""Output-length predictor vs baselines, online on the ShareGPT samples, against a real Redis.

Requests arrive in file order (or shuffled by --seed); each one is first predicted, then its
true output length is learned (as the detokenizer does at finish). Lengths are demo-tokenizer
tokens; a request asks `--max-tokens` (default 2048, the usual generous maximum), or with
`--context C` min(max_tokens, C - prompt); its true output length is capped at its max_tokens.
The predictor runs on an embedded redis-server, exactly as the services use it.

Methods, each an initial KV reservation (`reserved`) and a point guess (for `mae`):
  max_tokens  reserve max_tokens; point max_tokens
  global_p90  reserve the p90 of the lengths seen so far; point their median (default_len
              before any); a request's own length is not among them
  predictor   reserve its p90 quantile; point its median
  oracle      reserve and guess the true length

Metrics: mae = mean |point - true|; outgrow_rate = share of requests with true > reserved;
reserved_over_used = sum(prompt + max(reserved, true)) / sum(prompt + true) (a request that
outgrows its reservation grows to its true length). A second table sweeps the quantile level
of both global and predictor, and `matched` gives the predictor's reserved_over_used at the
outgrow rate of global_p90 (interpolated over levels): the fair trade-off comparison.
Also times length_features, predict and update per call.

    python -m bench.length_predictor [--seed N] [--max-tokens N] [--context C] [--limit N]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/length_predictor.py`
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.common import log, machine  # noqa: E402
from loadgen import datasets as ds  # noqa: E402
from shared.demo_model import ensure_demo_model  # noqa: E402
from shared.length_dist import LengthDist  # noqa: E402
from shared.length_predictor import LengthPredictor, length_features  # noqa: E402
from shared.redis_server import EmbeddedRedis  # noqa: E402
from shared.tokenizer import encode, load_tokenizer  # noqa: E402

MODEL = "demo"
SWEEP = (0.5, 0.75, 0.9, 0.95, 0.99)
FINE = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.875, 0.9, 0.925, 0.95, 0.97, 0.99, 0.995)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=ds.default_data_dir() / ds.SHAREGPT_FILE)
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--seed", type=int, default=None, help="shuffle the arrival order (default: "
                                                          "file order)")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--context", type=int, default=0,
                   help="also cap max_tokens at context - prompt (prompts >= context dropped)")
    p.add_argument("--default-len", type=int, default=128)
    return p.parse_args(argv)


def load_requests(args: argparse.Namespace) -> tuple[list[dict], str]:
    tok = load_tokenizer(ensure_demo_model())
    if args.data.is_file():
        items, source = ds.load_sharegpt(args.data, tok, limit=args.limit), args.data.name
    else:
        print(f"WARNING: {args.data} not found; falling back to a synthetic workload "
              "(random prompt words, no relation to lengths)", file=sys.stderr)
        rng = random.Random(0)
        words = "write explain list code story translate short long why how the a".split()
        items = [ds.WorkItem(" ".join(rng.choice(words) for _ in range(rng.randint(3, 60))),
                             0, w.output_len) for w in ds.synthetic(args.limit or 1024)]
        source = "synthetic"
    if args.seed is not None:
        random.Random(args.seed).shuffle(items)
    reqs = []
    for w in items:
        ids = encode(tok, w.prompt)
        max_tokens = args.max_tokens
        if args.context:
            if len(ids) >= args.context:
                continue
            max_tokens = min(max_tokens, args.context - len(ids))
        reqs.append(dict(text=w.prompt, ids=ids, prompt=len(ids), max_tokens=max_tokens,
                         true=min(w.output_len, max_tokens)))
    return reqs, source


def run_online(reqs: list[dict], client: redis.Redis, default_len: int) -> dict:
    """Predict-then-learn over the requests; per request: predictor dist, global dist, timings."""
    pred = LengthPredictor(client, MODEL, default_len=default_len, strict=True)
    pred.clear()
    seen: list[int] = []
    t_feat, t_pred, t_upd = [], [], []
    for r in reqs:
        t0 = time.perf_counter_ns()
        feats = length_features(r["text"], r["ids"], r["max_tokens"], MODEL)
        t1 = time.perf_counter_ns()
        r["dist"] = pred.predict(feats, r["max_tokens"])
        t2 = time.perf_counter_ns()
        r["n_features"] = len(feats)
        if seen:
            g = LengthDist.from_samples(seen)
            r["global"] = LengthDist(tuple(min(v, r["max_tokens"]) for v in g.values))
        else:
            r["global"] = LengthDist.point(min(default_len, r["max_tokens"]))
        t3 = time.perf_counter_ns()
        pred.update(feats, r["true"])
        t4 = time.perf_counter_ns()
        bisect.insort(seen, r["true"])
        t_feat.append(t1 - t0)
        t_pred.append(t2 - t1)
        t_upd.append(t4 - t3)
    return dict(features_us=_lat(t_feat), predict_us=_lat(t_pred), update_us=_lat(t_upd),
                keys=client.dbsize())


def _lat(ns: list[int]) -> dict:
    xs = sorted(ns)
    return dict(mean=round(statistics.fmean(xs) / 1e3, 1),
                p99=round(xs[min(int(0.99 * len(xs)), len(xs) - 1)] / 1e3, 1))


def score(reqs: list[dict], reserved: list[int], point: list[int]) -> dict:
    n = len(reqs)
    used = sum(r["prompt"] + r["true"] for r in reqs)
    held = sum(r["prompt"] + max(v, r["true"]) for r, v in zip(reqs, reserved, strict=True))
    err = sum(abs(p - r["true"]) for r, p in zip(reqs, point, strict=True))
    grew = sum(r["true"] > v for r, v in zip(reqs, reserved, strict=True))
    return dict(mae=round(err / n, 1), outgrow_rate=round(grew / n, 4),
                reserved_over_used=round(held / used, 4))


def at_level(reqs: list[dict], which: str, q: float) -> dict:
    res = [min(r[which].quantile(q), r["max_tokens"]) for r in reqs]
    return score(reqs, res, [r[which].median for r in reqs])


def matched(reqs: list[dict], which: str, target: float) -> float | None:
    """reserved_over_used of `which` at the outgrow rate `target`, interpolated over levels."""
    pts = sorted((s["outgrow_rate"], s["reserved_over_used"])
                 for s in (at_level(reqs, which, q) for q in FINE))
    for (o1, r1), (o2, r2) in pairwise(pts):
        if o1 <= target <= o2:
            return round(r1 + (r2 - r1) * (target - o1) / (o2 - o1) if o2 > o1 else r1, 4)
    return None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    reqs, source = load_requests(args)
    log(f"{len(reqs)} requests from {source}")
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        timing = run_online(reqs, client, args.default_len)
    methods = {
        "max_tokens": score(reqs, [r["max_tokens"] for r in reqs],
                            [r["max_tokens"] for r in reqs]),
        "global_p90": at_level(reqs, "global", 0.9),
        "predictor": at_level(reqs, "dist", 0.9),
        "oracle": score(reqs, [r["true"] for r in reqs], [r["true"] for r in reqs]),
    }
    sweep = {f"p{round(q * 100)}": {"global": at_level(reqs, "global", q),
                                    "predictor": at_level(reqs, "dist", q)} for q in SWEEP}
    target = methods["global_p90"]["outgrow_rate"]
    match = {"outgrow_rate": target, "global": methods["global_p90"]["reserved_over_used"],
             "predictor": matched(reqs, "dist", target)}
    trues = sorted(r["true"] for r in reqs)
    print(f"machine: {machine()}")
    print(f"workload: {len(reqs)} requests from {source}, "
          f"{'file order' if args.seed is None else f'shuffled (seed {args.seed})'}, "
          f"max_tokens {args.max_tokens}" + (f", context {args.context}" if args.context else "")
          + f"; true output p50 {trues[len(trues) // 2]}, p90 {trues[int(0.9 * len(trues))]}, "
          f"mean {statistics.fmean(trues):.0f} (demo tokenizer)")
    print(f"\n{'method':12s} {'mae':>8s} {'outgrow':>8s} {'reserved/used':>14s}")
    for name, m in methods.items():
        print(f"{name:12s} {m['mae']:8.1f} {m['outgrow_rate']:8.3f} "
              f"{m['reserved_over_used']:14.3f}")
    print("  (mae: predictor = its median, global_p90 = the running global median)")
    print(f"\nreserve at quantile level{'':5s}{'global':>22s}{'predictor':>24s}")
    print(f"{'level':8s}{'':20s}{'outgrow':>10s}{'res/used':>10s}{'':6s}{'outgrow':>10s}"
          f"{'res/used':>10s}")
    for lv, s in sweep.items():
        g, p = s["global"], s["predictor"]
        print(f"{lv:8s}{'':20s}{g['outgrow_rate']:10.3f}{g['reserved_over_used']:10.3f}{'':6s}"
              f"{p['outgrow_rate']:10.3f}{p['reserved_over_used']:10.3f}")
    print(f"at global_p90's outgrow rate {target:.3f}: reserved/used global "
          f"{match['global']:.3f}, predictor {match['predictor']}")
    nf = [r["n_features"] for r in reqs]
    print(f"\nlatency vs embedded redis-server (us/call, mean / p99): length_features "
          f"{timing['features_us']['mean']} / {timing['features_us']['p99']}, predict "
          f"{timing['predict_us']['mean']} / {timing['predict_us']['p99']}, update "
          f"{timing['update_us']['mean']} / {timing['update_us']['p99']}; features per request "
          f"mean {statistics.fmean(nf):.1f}, max {max(nf)}; redis keys {timing['keys']}")
    out = dict(methods=methods, quantile_sweep=sweep, matched_outgrow=match,
               latency_us={k: timing[k] for k in ("features_us", "predict_us", "update_us")},
               requests=len(reqs), source=source, seed=args.seed, max_tokens=args.max_tokens,
               context=args.context, seconds=round(time.perf_counter() - t_start, 1))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
