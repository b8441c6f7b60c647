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

from bench import length_data, length_hidden  # noqa: E402
from bench.common import log, machine  # noqa: E402
from pipellm.loadgen import datasets as ds  # noqa: E402
from pipellm.services.compute.length.refiner import RefinerConfig  # noqa: E402
from pipellm.shared.demo_model import ensure_demo_model  # noqa: E402
from pipellm.shared.length_dist import LengthDist  # noqa: E402
from pipellm.shared.length_predictor import LengthPredictor, length_features  # noqa: E402
from pipellm.shared.redis_server import EmbeddedRedis  # noqa: E402
from pipellm.shared.tokenizer import encode, load_tokenizer  # noqa: E402

MODEL = "demo"
SWEEP = (0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
EVERY = length_data.EVERY
REPLAYED = "smollm2-t0.7"  # whose per-request predictions bench/ablation.py replays
PREDICTIONS = ROOT / "bench" / "data" / "smollm2_t0.7_predictions.json"
FINE = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.875, 0.9, 0.925, 0.95, 0.97, 0.99,
        0.995)


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
    p.add_argument("--lengths", choices=("chatgpt-demo", "smollm2"), default="chatgpt-demo",
                   help="chatgpt-demo: the ChatGPT answers in demo-tokenizer tokens (text "
                        "predictor only); smollm2: SmolLM2's own lengths (bench/length_data.py) "
                        "and the ChatGPT answers in SmolLM2 tokens, with the hidden-state rows")
    p.add_argument("--shuffles", type=int, default=3, help="smollm2: shuffled orders besides "
                                                            "the arrival order")
    p.add_argument("--probe-dim", type=int, default=0,
                   help="smollm2: the heads' features (--length-probe-dim; 0: the default)")
    p.add_argument("--l2", type=float, nargs=2, default=RefinerConfig.l2,
                   metavar=("PREFILL", "REFINE"), help="smollm2: the heads' ridge penalties")
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
    if which in ("hidden", "refined"):  # bench/length_hidden.py's predictions
        got = [length_hidden.reservations(r["item"], r["hidden"], r["global"], q, EVERY)
               for r in reqs]
        k = 0 if which == "hidden" else 1
        s = score(reqs, [g[k] for g in got], [r["true"] for r in reqs])
        s["mae"] = round(statistics.fmean(g[2 + k] for g in got), 1)
        return s
    if which == "global_refined":
        got = [length_hidden.conditioned(r["item"], r["global"], q, EVERY) for r in reqs]
        s = score(reqs, [g[0] for g in got], [r["true"] for r in reqs])
        s["mae"] = round(statistics.fmean(g[1] for g in got), 1)
        return s
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


def at_most(reqs: list[dict], which: str, target: float) -> dict | None:
    """The least reserved_over_used of `which` over levels whose outgrow rate is <= `target`:
    what it reserves without outgrowing more often than the baseline."""
    pts = [dict(level=q, **at_level(reqs, which, q)) for q in FINE]
    ok = [p for p in pts if p["outgrow_rate"] <= target]
    return min(ok, key=lambda p: p["reserved_over_used"], default=None)


def evaluate(reqs: list[dict], learned: tuple[str, ...] = ()) -> dict:
    """Every method at p90, the quantile sweep, and reserved/used at global_p90's outgrow rate.
    `learned`: the hidden-state rows present ("hidden", "refined", "global_refined")."""
    keys = {"predictor": "dist", **{k: k for k in learned}}
    methods = {
        "max_tokens": score(reqs, [r["max_tokens"] for r in reqs],
                            [r["max_tokens"] for r in reqs]),
        "global_p90": at_level(reqs, "global", 0.9),
        **{name: at_level(reqs, key, 0.9) for name, key in keys.items()},
        "oracle": score(reqs, [r["true"] for r in reqs], [r["true"] for r in reqs]),
    }
    sweep = {f"p{round(q * 100)}": {"global": at_level(reqs, "global", q),
                                    **{n: at_level(reqs, k, q) for n, k in keys.items()}}
             for q in SWEEP}
    target = methods["global_p90"]["outgrow_rate"]
    match = {"outgrow_rate": target, "global": methods["global_p90"]["reserved_over_used"],
             **{n: matched(reqs, k, target) for n, k in keys.items()},
             # the other way round: global's reserved/used at each method's p90 outgrow rate
             "global_at": {n: matched(reqs, "global", methods[n]["outgrow_rate"])
                           for n in keys}}
    most = {n: at_most(reqs, k, target) for n, k in keys.items()}
    return dict(methods=methods, quantile_sweep=sweep, matched_outgrow=match,
                at_most_outgrow=most)


def print_tables(ev: dict) -> None:
    print(f"\n{'method':12s} {'mae':>8s} {'outgrow':>8s} {'reserved/used':>14s}")
    for name, m in ev["methods"].items():
        print(f"{name:12s} {m['mae']:8.1f} {m['outgrow_rate']:8.3f} "
              f"{m['reserved_over_used']:14.3f}")
    print("  (mae: of the median; global_p90 = the running global median; refined: the mean "
          "over a request's checkpoints)")
    names = list(next(iter(ev["quantile_sweep"].values())))
    print("\nreserve at quantile level: outgrow / reserved-over-used")
    print(f"{'level':8s}" + "".join(f"{n:>22s}" for n in names))
    for lv, row in ev["quantile_sweep"].items():
        print(f"{lv:8s}" + "".join(f"{row[n]['outgrow_rate']:12.3f}"
                                   f"{row[n]['reserved_over_used']:10.3f}" for n in names))
    m = ev["matched_outgrow"]
    print(f"at global_p90's outgrow rate {m['outgrow_rate']:.3f}: reserved/used " + ", ".join(
        f"{k} {v}" for k, v in m.items() if k not in ("outgrow_rate", "global_at")))
    print("global's reserved/used at each method's own p90 outgrow rate: " + ", ".join(
        f"{k} {v} (vs {ev['methods'][k]['reserved_over_used']})"
        for k, v in m["global_at"].items()))
    print(f"the least reserved/used outgrowing at most {m['outgrow_rate']:.3f}: " + ", ".join(
        f"{k} {v['reserved_over_used']} (level {v['level']}, outgrow {v['outgrow_rate']})"
        if v else f"{k} -" for k, v in ev["at_most_outgrow"].items()))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.lengths == "smollm2":
        return main_smollm2(args)
    t_start = time.perf_counter()
    reqs, source = load_requests(args)
    log(f"{len(reqs)} requests from {source}")
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        timing = run_online(reqs, client, args.default_len)
    ev = evaluate(reqs)
    trues = sorted(r["true"] for r in reqs)
    print(f"machine: {machine()}")
    print(f"workload: {len(reqs)} requests from {source}, "
          f"{'file order' if args.seed is None else f'shuffled (seed {args.seed})'}, "
          f"max_tokens {args.max_tokens}" + (f", context {args.context}" if args.context else "")
          + f"; true output p50 {trues[len(trues) // 2]}, p90 {trues[int(0.9 * len(trues))]}, "
          f"mean {statistics.fmean(trues):.0f} (demo tokenizer)")
    print_tables(ev)
    nf = [r["n_features"] for r in reqs]
    print(f"\nlatency vs embedded redis-server (us/call, mean / p99): length_features "
          f"{timing['features_us']['mean']} / {timing['features_us']['p99']}, predict "
          f"{timing['predict_us']['mean']} / {timing['predict_us']['p99']}, update "
          f"{timing['update_us']['mean']} / {timing['update_us']['p99']}; features per request "
          f"mean {statistics.fmean(nf):.1f}, max {max(nf)}; redis keys {timing['keys']}")
    out = dict(**ev, latency_us={k: timing[k] for k in ("features_us", "predict_us", "update_us")},
               requests=len(reqs), source=source, seed=args.seed, max_tokens=args.max_tokens,
               context=args.context, seconds=round(time.perf_counter() - t_start, 1))
    print(json.dumps(out))
    return out


def smollm2_sets(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Length set -> requests (file order): SmolLM2's own lengths per setting, and the same
    samples' ChatGPT answers, in SmolLM2 tokens."""
    from pipellm.shared import default_model

    model = default_model.resolve()
    pairs = ds.sharegpt_pairs(args.data)
    prompts = length_data.chat_prompts(model, None)
    sets = {f"smollm2-{s}": length_hidden.smollm2_items(s, args.limit)
            for s in length_data.SETTINGS}
    if not all(sets.values()):
        raise SystemExit("no SmolLM2 lengths here: run python -m bench.length_data")
    n = min(len(v) for v in sets.values())
    sets = {k: v[:n] for k, v in sets.items()}
    sets["chatgpt-smollm2"] = length_hidden.chatgpt_items(list(range(n)))
    return {name: [dict(text=pairs[it.index][0], ids=prompts[it.index], prompt=it.prompt,
                        max_tokens=it.max_tokens, true=it.true, item=it) for it in items]
            for name, items in sets.items()}


def main_smollm2(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    sets, out = smollm2_sets(args), {}
    print(f"machine: {machine()}")
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        for name, base in sets.items():
            learned = ("hidden",) if name.startswith("chatgpt") else \
                ("hidden", "refined", "global_refined")
            runs = []
            for seed in [None, *range(args.shuffles)]:
                reqs = list(base)
                if seed is not None:
                    random.Random(seed).shuffle(reqs)
                reqs = [dict(r) for r in reqs]
                run_online(reqs, client, args.default_len)
                hid = length_hidden.run_online([r["item"] for r in reqs], args.probe_dim, EVERY,
                                               tuple(args.l2))
                for r, (_, dists) in zip(reqs, hid["predictions"], strict=True):
                    r["hidden"] = dists
                runs.append(evaluate(reqs, learned))
                if seed is None and name == REPLAYED:
                    save_predictions(reqs, PREDICTIONS)
            trues = sorted(r["true"] for r in base)
            print(f"\n== {name}: {len(base)} requests, max_tokens {base[0]['max_tokens']}; true "
                  f"p50 {trues[len(trues) // 2]}, p90 {trues[int(0.9 * len(trues))]}, mean "
                  f"{statistics.fmean(trues):.0f}; arrival order")
            print_tables(runs[0])
            out[name] = dict(**runs[0], shuffled=_means(runs[1:]))
            print(f"mean over {args.shuffles} shuffled orders: {json.dumps(out[name]['shuffled'])}")
    first = out["smollm2-t0.7"]
    result = dict(**{k: first[k] for k in ("methods", "quantile_sweep", "matched_outgrow",
                                                 "at_most_outgrow")},
                  sets=out, requests=len(sets["smollm2-t0.7"]), source="smollm2-t0.7",
                  seed=None, max_tokens=length_data.MAX_TOKENS, context=0,
                  probe_dim=args.probe_dim, l2=list(args.l2),
                  seconds=round(time.perf_counter() - t_start, 1))
    print(json.dumps(result))
    return result


def save_predictions(reqs: list[dict], path: Path) -> None:
    """Each request's predictions in the arrival-order run, for bench/ablation.py to replay:
    sample index -> {"prior": the text predictor's quantiles at arrival, "checkpoints":
    [[generated, the hidden-state head's quantiles of the total length], ...]} (none until the
    head has learned enough)."""
    out = {}
    for r in reqs:
        dists = r["hidden"] or []
        out[r["item"].index] = {"prior": list(r["dist"].values), "checkpoints": [
            [k * EVERY, list(d.values)] for k, d in enumerate(dists)]}
    path.write_text(json.dumps({"every": EVERY, "max_tokens": length_data.MAX_TOKENS,
                                "predictions": out}, separators=(",", ":")))


def _means(runs: list[dict]) -> dict:
    """Per method: mean MAE and mean reserved/used at global_p90's outgrow rate over runs."""
    if not runs:
        return {}
    names = [n for n in runs[0]["methods"] if n not in ("max_tokens", "oracle")]
    out = {}
    for n in names:
        key = "global" if n == "global_p90" else n
        matched_vals = [r["matched_outgrow"].get(key) for r in runs]
        most = [(r["at_most_outgrow"].get(n) or {}).get("reserved_over_used") for r in runs]
        out[n] = {"mae": round(statistics.fmean(r["methods"][n]["mae"] for r in runs), 1),
                  "matched": round(statistics.fmean(matched_vals), 4)
                  if None not in matched_vals else None,
                  "at_most": round(statistics.fmean(most), 4) if None not in most else None}
    return out


if __name__ == "__main__":
    main()
