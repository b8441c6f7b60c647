"""The talk's ablation on a simulated GPU: QPS at SLO and throughput of each design choice.

Every number here except the last row is SIMULATED: the real scheduler and KV allocator run on
the virtual clock (bench/virtual.py) with the KV capacity of the GPU and model
and roofline step times (pipellm/services/compute/sim/cost.py, efficiency factors not yet calibrated
on a GPU). For each model and workload, each variant gets:
- qps_at_slo: the highest Poisson arrival rate (ShareGPT) or time-scaled trace rate (Azure) at
  which p99 TTFT <= 3 s and p99 TPOT <= 50 ms (the talk's SLO), found by doubling then
  bisection on the same requests; output_throughput, p99s and preemptions are at that rate;
- max_output_throughput: every request at once (the offline maximum).
Requests send no max_tokens (as chat clients commonly do): they may run to the context, so the
max-length policy reserves prompt + (context - prompt); each really ends with EOS at its true
length. The oracle knows each true length; the learned predictor
(pipellm/shared/length_predictor.py, a real Redis) starts cold in every run, predicts at arrival
and learns at finish, in virtual-time order; `predicted` reserves its median but at most 64 tokens
ahead (the default --kv-reserve-horizon; "whole-length segments" reserves the whole median) and
regrows outgrown segments to the conditional p90, again at most 64 ahead.

The `smollm2` workload (SmolLM2's own t=0.7 lengths, bench/length_data.py) adds two rows that
replay the predictions bench/length_predictor.py --lengths smollm2 recorded per request: the
text predictor's at arrival, then the hidden-state head's after prefill, and (refined) every 32
generated tokens, applied when the engine's refiner would apply them. They were recorded online
in file order; the replay shuffles the requests, so a request may be served with a head that
had learned from requests arriving after it here (a small advantage the live engine lacks).

The last row, pipelined vs inline detokenization, is a real-time run through the real services
(bench/pipeline_overlap.py with `--sim-model`): real processes and sockets, simulated GPU steps.

    python -m bench.ablation [--quick] [--models llama-2-7b,llama-3-8b] [--requests N]

The last line printed is JSON: {"rows": [{"name", "model", "workload", "qps_at_slo",
"output_throughput", "p99_ttft_ms", "p99_tpot_ms", "preemptions", ...}, ...]}.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import math
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import length_data  # noqa: E402
from bench.common import log, machine  # noqa: E402
from bench.length_predictor import PREDICTIONS  # noqa: E402
from bench.virtual import (  # noqa: E402
    azure_trace,
    simulate,
    summarize,
    with_arrivals,
)
from pipellm.loadgen.datasets import (  # noqa: E402
    SHAREGPT_FILE,
    default_data_dir,
    load_sharegpt,
    sharegpt_pairs,
    synthetic,
)
from pipellm.services.compute.sim.hardware import model as model_spec  # noqa: E402
from pipellm.shared.config import EngineConfig  # noqa: E402
from pipellm.shared.length_dist import LengthDist  # noqa: E402
from pipellm.shared.length_predictor import LengthPredictor, length_features  # noqa: E402
from pipellm.shared.redis_server import EmbeddedRedis  # noqa: E402
from pipellm.shared.settings import with_settings  # noqa: E402

SLO_TTFT_MS, SLO_TPOT_MS = 3000.0, 50.0
MAX_QPS = 4096  # the search's top; passing there means the KV cache took the whole burst


PAGED = "merged, paged 16-token blocks"
PAGED_PEAK = "merged, paged 16-token blocks, predicted admission (learned)"


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    overrides: dict
    predict: str = "none"  # none | oracle | predictor | hidden | refined
    talk: str = ""  # the talk's claim for this row
    workloads: tuple[str, ...] = ()  # only these (empty: all)


VARIANTS = (
    Variant("static batching, max-length KV", {"batching": "static", "kv_policy": "max"}),
    Variant("merged steps, max-length KV", {"kv_policy": "max"},
            talk="+100% QPS over static batching"),
    Variant(PAGED, {"kv_policy": "paged"}),
    Variant(PAGED_PEAK, {"kv_policy": "paged", "kv_admission": "peak"}, "predictor"),
    Variant("merged, predicted KV (oracle)", {"kv_policy": "predicted"}, "oracle",
            "+200% QPS over max-length reservation"),
    Variant("merged, predicted KV (learned predictor)", {"kv_policy": "predicted"}, "predictor",
            "+200% QPS over max-length reservation"),
    Variant("merged, predicted KV (learned), whole-length segments",
            {"kv_policy": "predicted", "kv_reserve_horizon": 0}, "predictor"),
    Variant("merged, predicted KV (hidden state, after prefill)", {"kv_policy": "predicted"},
            "hidden", workloads=("smollm2",)),
    Variant("merged, predicted KV (hidden state, refined every 32 tokens)",
            {"kv_policy": "predicted"}, "refined", workloads=("smollm2",)),
    Variant("merged, predicted KV (learned), INT8 KV",
            {"kv_policy": "predicted", "sim_kv_dtype": "int8"}, "predictor",
            "2x requests, +50% throughput over FP16 KV"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-2-7b,llama-3-8b")
    p.add_argument("--workloads", default="sharegpt,azure",
                   help="of sharegpt, azure and smollm2 (SmolLM2's own lengths with the "
                        "hidden-state predictions recorded by bench/length_predictor.py "
                        "--lengths smollm2, replayed: the hidden-state rows)")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--max-running", type=int, default=1024)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--bisect", type=int, default=5, help="bisection steps after doubling")
    p.add_argument("--pipeline-requests", type=int, default=200,
                   help="requests of the real-time pipelined-vs-inline run (0: skip it)")
    p.add_argument("--paged-attn-slowdown", type=float, default=1.0,
                   help="the paged rows' attention KV-read cost against contiguous segments "
                        "(bench/kernels.py's paged_attn_slowdown on the GPU modelled)")
    p.add_argument("--kv-peak-quantile", type=float, default=None,
                   help="every predicted row's admission peak quantile (default: the engine's, "
                        "--kv-peak-quantile)")
    p.add_argument("--kv-admission", default=None,
                   help="the predicted-KV rows' admission (default: the engine's, "
                        "--kv-admission)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="one model, one workload, 200 requests")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.workloads = args.models.split(",")[0], args.workloads.split(",")[0]
        args.requests, args.bisect, args.pipeline_requests = 200, 3, 0
    return args


class Workload:
    """(prompt_len, output_len) pairs of one data set, as arrivals at a chosen rate."""

    def __init__(self, name: str, n: int, context: int, seed: int):
        self.name, self.seed = name, seed
        if name == "smollm2":
            self._smollm2(n, context)
        elif name == "azure":
            trace = [w for w in azure_trace(default_data_dir() / "azure_llm_trace_conv_2023.csv",
                                            n * 2) if w[1] + w[2] <= context][:n]
            self.native_qps = (len(trace) - 1) / (trace[-1][0] - trace[0][0])
            self.items = trace
            self.texts = [""] * len(trace)
        else:
            path = default_data_dir() / SHAREGPT_FILE
            if not path.is_file():
                log(f"WARNING: {path} not found; synthetic lengths, no prompt text")
            pool = [w for w in (load_sharegpt(path) if path.is_file() else synthetic(1024, seed))
                    if w.prompt_len + w.output_len <= context]
            random.Random(seed).shuffle(pool)
            picked = [pool[i % len(pool)] for i in range(n)]
            self.items = [(0.0, w.prompt_len, w.output_len) for w in picked]
            self.texts = [w.prompt or "" for w in picked]
        if name != "smollm2":
            self.max_tokens = [context - p for _, p, _ in self.items]  # no max_tokens sent
        self._features: dict[str, list[list[int]]] = {}

    def _smollm2(self, n: int, context: int) -> None:
        """SmolLM2's own t=0.7 answers to the ShareGPT questions (bench/length_data.py), with the
        predictions bench/length_predictor.py --lengths smollm2 recorded for each, in shuffled
        order; max_tokens as generated (1024)."""
        recorded = json.loads(PREDICTIONS.read_text())
        preds = recorded["predictions"]
        rows = [r for r in length_data.load()[1]["t0.7"] if str(r["index"]) in preds]
        rows = [r for r in rows if r["prompt_tokens"] + r["output_tokens"] <= context]
        random.Random(self.seed).shuffle(rows)
        picked = [rows[i % len(rows)] for i in range(n)]
        questions = [q for q, _ in sharegpt_pairs(default_data_dir() / SHAREGPT_FILE)]
        self.items = [(0.0, r["prompt_tokens"], r["output_tokens"]) for r in picked]
        self.texts = [questions[r["index"]] for r in picked]
        self.max_tokens = [recorded["max_tokens"]] * len(picked)
        self.recorded = [preds[str(r["index"])] for r in picked]

    def features(self, model: str) -> list[list[int]]:
        """Each request's length features (computed once per model, reused by every run)."""
        if model not in self._features:
            self._features[model] = [length_features(t, [], m, model) for t, m in
                                     zip(self.texts, self.max_tokens, strict=True)]
        return self._features[model]

    def at(self, qps: float, predict: str) -> list[tuple]:
        """Items (arrival, prompt, output, predicted, max_tokens) at `qps` (inf: all at once)."""
        if self.name == "azure" and math.isfinite(qps):
            scale = qps / self.native_qps
            timed = [(t / scale, p, o) for t, p, o in self.items]
        else:
            timed = with_arrivals([(p, o) for _, p, o in self.items], qps, self.seed)
        return [(t, p, o, o if predict == "oracle" else None, m)
                for (t, p, o), m in zip(timed, self.max_tokens, strict=True)]


class OnlineLengths:
    """The Redis length predictor (pipellm/shared/length_predictor.py) driven by the simulation:
    each run starts cold under a fresh key prefix, predicts at arrival and learns at finish."""

    _redis = None  # one embedded redis-server for the whole benchmark

    def __init__(self, wl: Workload, model: str):
        if OnlineLengths._redis is None:
            OnlineLengths._redis = EmbeddedRedis().start()
            atexit.register(OnlineLengths._redis.stop)
        client = redis.Redis.from_url(OnlineLengths._redis.url)
        self.predictor = LengthPredictor(client, model, prefix=f"ablation:{uuid.uuid4().hex}")
        self.max_tokens, self.features = wl.max_tokens, wl.features(model)

    def predict(self, index: int) -> LengthDist:
        return self.predictor.predict(self.features[index], self.max_tokens[index])

    def learn(self, index: int, output_len: int) -> None:
        self.predictor.update(self.features[index], output_len)

    def refine(self, index: int, generated: int) -> None:
        return None


class Replayed:
    """Predictions recorded per request (bench/length_predictor.py --lengths smollm2): the text
    predictor's at arrival, then the hidden-state head's after prefill (generated 0) and, with
    `refined`, at every later checkpoint, as the engine's refiner applies them."""

    def __init__(self, wl: Workload, refined: bool):
        self.recorded, self.refined = wl.recorded, refined

    def predict(self, index: int) -> LengthDist:
        return LengthDist(tuple(self.recorded[index]["prior"]))

    def learn(self, index: int, output_len: int) -> None:
        pass

    def refine(self, index: int, generated: int) -> LengthDist | None:
        if generated and not self.refined:
            return None
        for g, values in self.recorded[index]["checkpoints"]:
            if g == generated:
                return LengthDist(tuple(values))
        return None


def run(config: EngineConfig, wl: Workload, variant: Variant, qps: float) -> dict:
    stats: dict = {}
    online = OnlineLengths(wl, config.sim.model) if variant.predict == "predictor" else \
        Replayed(wl, variant.predict == "refined") if variant.predict in ("hidden", "refined") \
        else None
    summary = summarize(simulate(config, wl.at(qps, variant.predict), wl.seed, stats,
                                 predictor=online))
    return summary | {"qps": qps, "kv_capacity": stats["capacity"], "moves": stats["moves"]}


def meets_slo(s: dict) -> bool:
    return (s.get("completed") == s["requests"] and s["ttft_ms_p99"] <= SLO_TTFT_MS
            and (math.isnan(s["tpot_ms_p99"]) or s["tpot_ms_p99"] <= SLO_TPOT_MS))


def qps_at_slo(config: EngineConfig, wl: Workload, variant: Variant, bisect: int) -> dict | None:
    """Summary at the highest rate meeting the SLO (None if even 1/64 req/s misses it): from
    0.5 req/s double while it passes (or halve while it fails), then bisect geometrically
    between the last pass and the first failure."""
    def ok(qps: float) -> dict | None:
        s = run(config, wl, variant, qps)
        return s if meets_slo(s) else None

    step = 2.0 if (passed := ok(0.5)) else 0.5
    failed, qps = (None, 1.0) if passed else (0.5, 0.25)
    while 1 / 64 <= qps <= MAX_QPS:
        s = ok(qps)
        if (s is None) == (step > 1):  # the first change: a failure going up, a pass going down
            passed, failed = (passed, qps) if s is None else (s, failed)
            break
        passed, failed = (s, failed) if s else (passed, qps)
        qps *= step
    else:
        return passed  # passes at the top, or fails at the bottom (None)
    lo, hi = passed["qps"], failed
    for _ in range(bisect):
        mid = math.sqrt(lo * hi)
        s = run(config, wl, variant, mid)
        if meets_slo(s):
            passed, lo = s, mid
        else:
            hi = mid
    return passed


def measure(args, model: str, workload: str) -> list[dict]:
    base = with_settings(EngineConfig(), backend="sim", sim_clock="virtual", sim_gpu=args.gpu,
                         sim_model=model, sim_paged_attn_slowdown=args.paged_attn_slowdown,
                         max_running=args.max_running,
                         max_batched_tokens=args.max_batched_tokens)
    if args.kv_peak_quantile is not None:
        base = with_settings(base, kv_peak_quantile=args.kv_peak_quantile)
    wl = Workload(workload, args.requests, model_spec(model).context, args.seed)
    variants = [v for v in VARIANTS if not v.workloads or workload in v.workloads]
    rows, configs = [], [with_settings(base, **v.overrides, **admission(args, v))
                         for v in variants]
    paged_qps = None  # paged's QPS at SLO (MAX_QPS if it absorbed the burst)
    for v, config in zip(variants, configs, strict=True):
        t0 = time.perf_counter()
        at = qps_at_slo(config, wl, v, args.bisect)
        paged_qps = (at or {}).get("qps") if v.name == PAGED else paged_qps
        offline = run(config, wl, v, math.inf)
        rows.append(row(v, model, workload, at, offline))
        log(f"{model} {workload} {v.name}: {rows[-1]['qps_at_slo']} req/s at SLO "
            f"({time.perf_counter() - t0:.0f} s)")
    for v, config, r in zip(variants, configs, rows, strict=True):  # all at paged's rate
        at = run(config, wl, v, paged_qps) if paged_qps else {}
        r["preemptions_at_paged_qps"] = at.get("preemptions")
        r["meets_slo_at_paged_qps"] = meets_slo(at) if at else None
    return rows


def admission(args, v: Variant) -> dict:
    """--kv-admission's override for a predicted-KV row."""
    if args.kv_admission is None or v.overrides.get("kv_policy") != "predicted":
        return {}
    return {"kv_admission": args.kv_admission}


def row(v: Variant, model: str, workload: str, at: dict | None, offline: dict) -> dict:
    def r(x, nd=1):
        return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, nd)

    at = at or {}
    absorbed = at.get("qps", 0) >= MAX_QPS  # met at every rate: all requests fit at once
    return {"name": v.name, "model": model, "workload": workload, "simulated": True,
            "qps_at_slo": None if absorbed else r(at.get("qps"), 2), "burst_absorbed": absorbed,
            "output_throughput": r(at.get("output_tok_s")),
            "p99_ttft_ms": r(at.get("ttft_ms_p99")), "p99_tpot_ms": r(at.get("tpot_ms_p99"), 2),
            "preemptions": at.get("preemptions"),
            "max_concurrent": at.get("max_concurrent"), "moves": at.get("moves"),
            "kv_capacity": offline["kv_capacity"],
            "max_output_throughput": r(offline.get("output_tok_s")),
            "offline_max_concurrent": offline.get("max_concurrent"),
            "offline_preemptions": offline.get("preemptions"), "talk": v.talk}


def pipeline_row(args, model: str) -> dict | None:
    """Pipelined vs inline detokenization: bench/pipeline_overlap.py in real time, sim GPU."""
    cmd = [sys.executable, "-m", "bench.pipeline_overlap", "--sim-model", model, "--sim-gpu",
           args.gpu, "--num-requests", str(args.pipeline_requests)]
    log("pipelined vs inline: " + " ".join(cmd[1:]))
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        log(f"pipeline_overlap failed: {out.stderr[-2000:]}")
        return None
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {"name": "pipelined vs inline detokenization (real time, real services)",
            "model": model, "workload": res["workload"], "simulated": "GPU steps only",
            "qps_at_slo": None, "output_throughput": res["pipelined_tok_s"],
            "p99_ttft_ms": None, "p99_tpot_ms": None, "preemptions": None,
            "inline_output_throughput": res["inline_tok_s"], "qps_ratio": res["qps_ratio"],
            "talk": "+10-20% QPS"}


COMPARISONS = (  # (row, baseline row, what the talk claims)
    ("merged steps, max-length KV", "static batching, max-length KV", "2.0x"),
    ("merged, predicted KV (oracle)", "merged steps, max-length KV", "3.0x"),
    ("merged, predicted KV (oracle)", PAGED, ">= 1x, <= 1/5 preemptions"),
    ("merged, predicted KV (learned predictor)", "merged steps, max-length KV", "3.0x"),
    ("merged, predicted KV (learned predictor)", PAGED, ">= 1x, <= 1/5 preemptions"),
    ("merged, predicted KV (learned), whole-length segments", PAGED, "-"),
    (PAGED_PEAK, PAGED, "-"),
    ("merged, predicted KV (learned), INT8 KV", "merged, predicted KV (learned predictor)",
     "1.5x tput"),
    ("merged, predicted KV (hidden state, after prefill)",
     "merged, predicted KV (learned predictor)", "-"),
    ("merged, predicted KV (hidden state, refined every 32 tokens)",
     "merged, predicted KV (learned predictor)", "-"),
    ("merged, predicted KV (hidden state, refined every 32 tokens)", PAGED, "-"),
)


def ratios(rows: list[dict]) -> list[dict]:
    """QPS-at-SLO and offline-throughput ratios of each comparison, per model and workload."""
    out = []
    for key in sorted({(r["model"], r["workload"]) for r in rows if r["simulated"] is True}):
        by = {r["name"]: r for r in rows if (r["model"], r["workload"]) == key}
        for name, base, talk in COMPARISONS:
            if name in by and base in by:
                a, b = by[name], by[base]
                out.append({"model": key[0], "workload": key[1], "row": name, "vs": base,
                            "qps_ratio": _ratio(a["qps_at_slo"], b["qps_at_slo"]),
                            "throughput_ratio": _ratio(a["max_output_throughput"],
                                                       b["max_output_throughput"]),
                            "concurrency_ratio": _ratio(a["offline_max_concurrent"],
                                                        b["offline_max_concurrent"]),
                            "preemptions_at_paged_qps": [a["preemptions_at_paged_qps"],
                                                         b["preemptions_at_paged_qps"]],
                            "talk": talk})
    return out


def _ratio(a, b) -> float | None:
    return round(a / b, 2) if a and b else None


def print_table(rows: list[dict], comps: list[dict]) -> None:
    print("| model | workload | variant | QPS at SLO | out tok/s | p99 TTFT ms | p99 TPOT ms "
          "| preemptions | preemptions at paged's QPS (SLO met) | offline out tok/s "
          "| offline max concurrent |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        qps = f"all fit (>= {MAX_QPS})" if r.get("burst_absorbed") else r["qps_at_slo"]
        print(f"| {r['model']} | {r['workload']} | {r['name']} | {qps} | "
              f"{r['output_throughput']} | {r['p99_ttft_ms']} | {r['p99_tpot_ms']} | "
              f"{r['preemptions']} | {r.get('preemptions_at_paged_qps')} "
              f"({_yes(r.get('meets_slo_at_paged_qps'))}) | "
              f"{r.get('max_output_throughput', '-')} | "
              f"{r.get('offline_max_concurrent', '-')} |")
    print("\n| model | workload | row | vs | QPS ratio | offline tput ratio | concurrency ratio "
          "| preemptions at paged's QPS (row vs) | target |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in comps:
        pre = c["preemptions_at_paged_qps"]
        print(f"| {c['model']} | {c['workload']} | {c['row']} | {c['vs']} | {c['qps_ratio']} | "
              f"{c['throughput_ratio']} | {c['concurrency_ratio']} | {pre[0]} vs {pre[1]} | "
              f"{c['talk']} |")


def _yes(ok: bool | None) -> str:
    return "-" if ok is None else "yes" if ok else "no"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"machine: {machine()}; simulated GPU {args.gpu}; {args.requests} requests per run; "
          f"max_running {args.max_running}, max_batched_tokens {args.max_batched_tokens}; "
          f"SLO p99 TTFT <= {SLO_TTFT_MS:.0f} ms, p99 TPOT <= {SLO_TPOT_MS:.0f} ms")
    rows = []
    for model in args.models.split(","):
        for workload in args.workloads.split(","):
            rows += measure(args, model, workload)
    if args.pipeline_requests:
        extra = pipeline_row(args, args.models.split(",")[0])
        rows += [extra] if extra else []
    comps = ratios(rows)
    print_table(rows, comps)
    print(json.dumps({"rows": rows, "ratios": comps}))


if __name__ == "__main__":
    main()
