"""Scheduling policies on the simulated GPU (issue 51): SIMULATED numbers, the real scheduler.

The engine's scheduler (--scheduling-policy) runs on the virtual clock (bench/virtual.py) with
the KV capacity and roofline step times of the modelled GPU and model (default: H100,
Llama-3-8B, engine defaults otherwise). Workloads: ShareGPT lengths with Poisson arrivals,
and the Azure 2023 conversation trace with its own arrival times scaled to the rate. Requests
send no max_tokens (they may run to the context) and end with EOS at their true length. The
rate is `--load` x the saturating rate: from the FCFS offline capacity (every request at once:
completed requests / s) up by 25% steps until FCFS's p50 TTFT reaches SATURATED_TTFT_S (a
queue holds most requests back).

- priority: 10% of the requests (drawn at random) are interactive, priority 0, the rest
  priority 1; fcfs vs priority, oracle lengths. Wanted: the interactive p99 TTFT >= 5x lower,
  total throughput within 10%.
- predicted: all priority 0; fcfs vs predicted, with oracle lengths and with the learned
  predictor (shared/length_predictor.py on a private Redis, cold at the start of each run,
  predicting at arrival and learning at finish, as bench/ablation.py). Wanted: mean and p50
  end-to-end latency >= 30% lower with learned lengths; `kept` is the share of the oracle's
  gain the learned predictor keeps; the longest first-admission wait against
  --max-queue-delay-ms.

    python -m bench.priority_sim [--requests 2000] [--load 1.0] [--workloads sharegpt,azure]

The last line printed is JSON: {"config", "priority": {workload: ...}, "predicted": ...}.
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.virtual import azure_trace, percentile, simulate, summarize  # noqa: E402
from loadgen.datasets import SHAREGPT_FILE, default_data_dir, load_sharegpt  # noqa: E402
from shared.config import EngineConfig  # noqa: E402
from shared.length_dist import LengthDist  # noqa: E402
from shared.length_features import length_features  # noqa: E402
from shared.settings import add_config_args, config_from_args, with_settings  # noqa: E402

INTERACTIVE_SHARE = 0.10
SATURATED_TTFT_S = 1.0


class Workload:
    """n requests of one data set: (prompt_len, output_len, prompt text) and the data set's
    own relative arrival times (None: Poisson at the chosen rate)."""

    def __init__(self, name: str, n: int, context: int, seed: int):
        self.name, self.seed = name, seed
        if name == "azure":
            trace = [w for w in azure_trace(default_data_dir() / "azure_llm_trace_conv_2023.csv",
                                            n * 2) if w[1] + w[2] <= context][:n]
            self.times = [t - trace[0][0] for t, _, _ in trace]
            self.reqs = [(p, o, "") for _, p, o in trace]
        else:
            pool = [w for w in load_sharegpt(default_data_dir() / SHAREGPT_FILE)
                    if w.prompt_len + w.output_len <= context]
            random.Random(seed).shuffle(pool)
            self.reqs = [(w.prompt_len, w.output_len, w.prompt or "")
                         for w in (pool[i % len(pool)] for i in range(n))]
            self.times = None
        self.max_tokens = [context - p for p, _, _ in self.reqs]  # no max_tokens sent
        rng = random.Random(seed + 1)
        self.priority = [0 if rng.random() < INTERACTIVE_SHARE else 1 for _ in self.reqs]

    def arrivals(self, qps: float) -> list[float]:
        if self.times is not None:
            native = (len(self.times) - 1) / self.times[-1]
            return [t * native / qps for t in self.times]
        rng, t, out = random.Random(self.seed), 0.0, []
        for _ in self.reqs:
            t += rng.expovariate(qps)
            out.append(t)
        return out

    def items(self, qps: float | None, priorities: bool) -> list[tuple]:
        """(arrival, prompt, output, oracle prediction, max_tokens, ids, priority); qps None:
        all at time 0."""
        times = self.arrivals(qps) if qps else [0.0] * len(self.reqs)
        return [(t, p, o, o, m, None, pr if priorities else 0) for t, (p, o, _), m, pr in
                zip(times, self.reqs, self.max_tokens, self.priority, strict=True)]


class Learned:
    """The Redis length predictor driven by the simulation, cold at the start (an
    OnlinePredictor of bench/virtual.py)."""

    _redis = None

    def __init__(self, wl: Workload, model: str):
        import redis

        from shared.length_predictor import LengthPredictor
        from shared.redis_server import EmbeddedRedis

        if Learned._redis is None:
            Learned._redis = EmbeddedRedis().start()
            atexit.register(Learned._redis.stop)
        client = redis.Redis.from_url(Learned._redis.url)
        self.predictor = LengthPredictor(client, model, prefix=f"prio:{uuid.uuid4().hex}")
        self.max_tokens = wl.max_tokens  # no text in the trace: its prompt length still counts
        self.features = [length_features(text, [1] * p, m, model) for (p, _, text), m in
                         zip(wl.reqs, wl.max_tokens, strict=True)]

    def predict(self, index: int) -> LengthDist:
        return self.predictor.predict(self.features[index], self.max_tokens[index])

    def learn(self, index: int, output_len: int) -> None:
        self.predictor.update(self.features[index], output_len)

    def refine(self, index: int, generated: int) -> None:
        return None


def run(config: EngineConfig, items: list[tuple], policy: str, predictor=None) -> dict:
    """One simulation under `policy`: summarize()'s numbers, plus end-to-end latency, the
    longest first-admission wait, and the interactive class's TTFT."""
    cfg = with_settings(config, scheduling_policy=policy)
    recs = simulate(cfg, items, 0, predictor=predictor)
    out = summarize(recs)
    done = [r for r in recs if r.finish is not None and r.finish_reason != "rejected"]
    e2e = [(r.finish - r.arrival) for r in done]
    waits = [r.admitted - r.arrival for r in done]
    fast = [r.ttft * 1e3 for r in done if items[r.index][6] == 0]
    return out | {"e2e_s_mean": sum(e2e) / len(e2e), "e2e_s_p50": percentile(e2e, 50),
                  "e2e_s_p99": percentile(e2e, 99), "wait_s_max": max(waits),
                  "ttft_ms_p99_interactive": percentile(fast, 99),
                  "ttft_ms_p99_batch": percentile(
                      [r.ttft * 1e3 for r in done if items[r.index][6] == 1], 99)}


def saturating_rate(config: EngineConfig, wl: Workload) -> float:
    """The lowest rate, from the FCFS offline capacity (completed requests / s with every
    request at time 0) up in 25% steps, at which FCFS's p50 TTFT reaches SATURATED_TTFT_S."""
    rate = summarize(simulate(config, wl.items(None, False), 0))["req_s"]
    for _ in range(20):
        if summarize(simulate(config, wl.items(rate, False), 0))["ttft_ms_p50"] >= \
                SATURATED_TTFT_S * 1e3:
            break
        rate *= 1.25
    return rate


def priority_experiment(config: EngineConfig, wl: Workload, qps: float) -> dict:
    items = wl.items(qps, True)
    fcfs, prio = run(config, items, "fcfs"), run(config, items, "priority")
    return {"fcfs": _pick(fcfs), "priority": _pick(prio),
            "interactive_p99_ttft_gain": fcfs["ttft_ms_p99_interactive"]
            / prio["ttft_ms_p99_interactive"],
            "throughput_ratio": prio["total_tok_s"] / fcfs["total_tok_s"]}


def predicted_experiment(config: EngineConfig, wl: Workload, qps: float) -> dict:
    items, out = wl.items(qps, False), {}
    for lengths in ("oracle", "learned"):
        learned = lengths == "learned"
        fcfs = run(config, items, "fcfs", Learned(wl, config.sim.model) if learned else None)
        pred = run(config, items, "predicted", Learned(wl, config.sim.model) if learned else None)
        out[lengths] = {"fcfs": _pick(fcfs), "predicted": _pick(pred),
                        "mean_e2e_cut": 1 - pred["e2e_s_mean"] / fcfs["e2e_s_mean"],
                        "p50_e2e_cut": 1 - pred["e2e_s_p50"] / fcfs["e2e_s_p50"],
                        "throughput_ratio": pred["total_tok_s"] / fcfs["total_tok_s"]}
    o, learned = out["oracle"], out["learned"]
    out["kept_mean"] = learned["mean_e2e_cut"] / o["mean_e2e_cut"] if o["mean_e2e_cut"] else None
    out["kept_p50"] = learned["p50_e2e_cut"] / o["p50_e2e_cut"] if o["p50_e2e_cut"] else None
    return out


KEYS = ("completed", "duration_s", "total_tok_s", "output_tok_s", "ttft_ms_p50", "ttft_ms_p99",
        "ttft_ms_p99_interactive", "ttft_ms_p99_batch", "e2e_s_mean", "e2e_s_p50", "e2e_s_p99",
        "wait_s_max", "preemptions")


def _pick(s: dict) -> dict:
    return {k: round(s[k], 3) if isinstance(s[k], float) else s[k] for k in KEYS if k in s}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, EngineConfig]:
    p = argparse.ArgumentParser(prog="python -m bench.priority_sim",
                                description=__doc__.split("\n\n")[0])
    add_config_args(p, EngineConfig)
    p.add_argument("--workloads", default="sharegpt,azure")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--load", type=float, default=1.0, help="x the FCFS saturating rate")
    p.add_argument("--experiments", default="priority,predicted")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    return args, config_from_args(EngineConfig, args, backend="sim", sim_clock="virtual")


def main(argv: list[str] | None = None) -> dict:
    args, config = parse_args(argv)
    from services.compute.sim.hardware import model

    context = model(config.sim.model).context
    result = {"config": {"gpu": config.sim.gpu, "model": config.sim.model,
                         "requests": args.requests, "load": args.load,
                         "max_queue_delay_ms": config.scheduler.max_queue_delay_ms,
                         "max_batched_tokens": config.scheduler.max_batched_tokens,
                         "max_running": config.scheduler.max_running}}
    for name in args.workloads.split(","):
        wl = Workload(name, args.requests, context, args.seed)
        qps = args.load * saturating_rate(config, wl)
        print(f"{name}: FCFS saturating rate x {args.load} = {qps:.2f} req/s", flush=True)
        for exp in args.experiments.split(","):
            fn = priority_experiment if exp == "priority" else predicted_experiment
            r = fn(config, wl, qps) | {"qps": round(qps, 3)}
            result.setdefault(exp, {})[name] = r
            print(f"{name} {exp}: {json.dumps(r)}", flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
