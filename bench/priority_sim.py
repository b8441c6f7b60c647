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
  predictor (pipellm/shared/length_predictor.py on a private Redis, predicting at arrival and
  learning at finish): `learned` warmed first on training requests of the same data set that the run
  never sends (Workload), `learned_cold` starting empty as bench/ablation.py's. Wanted: mean
  and p50 end-to-end latency >= 30% lower with learned lengths; `kept_*` is the share of the
  oracle's cut the learned predictor keeps; the longest first-admission wait against
  --max-queue-delay-ms. `no_wait_mean_cut`: the mean cut if no request waited for its first
  admission at all (fcfs's mean wait over its mean latency), the most an order can give when
  the rest (prefill, decode) takes as long as under fcfs. (ShareGPT's requests cycle through
  ~600 distinct prompts, so the online learner also sees repeats.)

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
from pipellm.loadgen.datasets import SHAREGPT_FILE, default_data_dir, load_sharegpt  # noqa: E402
from pipellm.shared.config import EngineConfig  # noqa: E402
from pipellm.shared.length_dist import LengthDist  # noqa: E402
from pipellm.shared.length_features import length_features  # noqa: E402
from pipellm.shared.settings import add_config_args, config_from_args, with_settings  # noqa: E402

INTERACTIVE_SHARE = 0.10
SATURATED_TTFT_S = 1.0
TRAIN_SHARE = 0.4


class Workload:
    """n requests of one data set, (prompt_len, output_len, prompt text), with the data set's
    own relative arrival times (None: Poisson at the chosen rate), and `train`: requests of
    the same data set none of them repeats, that warm the learned predictor (ShareGPT: a
    TRAIN_SHARE of the shuffled samples, the requests cycling through the rest; Azure: the n
    rows before the requests' n)."""

    def __init__(self, name: str, n: int, context: int, seed: int):
        self.name, self.seed = name, seed
        if name == "azure":
            trace = [w for w in azure_trace(default_data_dir() / "azure_llm_trace_conv_2023.csv",
                                            n * 3) if w[1] + w[2] <= context]
            self.train = [(p, o, "") for _, p, o in trace[:n]]
            trace = trace[n : 2 * n]
            self.times = [t - trace[0][0] for t, _, _ in trace]
            self.reqs = [(p, o, "") for _, p, o in trace]
        else:
            pool = [(w.prompt_len, w.output_len, w.prompt or "")
                    for w in load_sharegpt(default_data_dir() / SHAREGPT_FILE)
                    if w.prompt_len + w.output_len <= context]
            random.Random(seed).shuffle(pool)
            k = int(TRAIN_SHARE * len(pool))
            self.train, test = pool[:k], pool[k:]
            self.reqs = [test[i % len(test)] for i in range(n)]
            self.times = None
        self.context = context
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
    """The Redis length predictor driven by the simulation (an OnlinePredictor of
    bench/virtual.py): predicting at arrival, learning at finish; `warm`: first taught the
    workload's training requests (a server that has seen earlier traffic), else cold."""

    _redis = None

    def __init__(self, wl: Workload, model: str, warm: bool = True):
        import redis

        from pipellm.shared.length_predictor import LengthPredictor
        from pipellm.shared.redis_server import EmbeddedRedis

        if Learned._redis is None:
            Learned._redis = EmbeddedRedis().start()
            atexit.register(Learned._redis.stop)
        client = redis.Redis.from_url(Learned._redis.url)
        self.predictor = LengthPredictor(client, model, prefix=f"prio:{uuid.uuid4().hex}")
        self.max_tokens = wl.max_tokens  # no text in the trace: its prompt length still counts
        self.features = [length_features(text, [1] * p, m, model) for (p, _, text), m in
                         zip(wl.reqs, wl.max_tokens, strict=True)]
        if warm:
            self.predictor.update_many([(length_features(text, [1] * p, wl.context - p, model),
                                         o) for p, o, text in wl.train])

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
                  "wait_s_mean": sum(waits) / len(waits),
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
    for lengths in ("oracle", "learned", "learned_cold"):
        def lengths_of(lengths=lengths):
            return None if lengths == "oracle" else \
                Learned(wl, config.sim.model, warm=lengths == "learned")
        fcfs = run(config, items, "fcfs", lengths_of())
        pred = run(config, items, "predicted", lengths_of())
        out[lengths] = {"fcfs": _pick(fcfs), "predicted": _pick(pred),
                        "mean_e2e_cut": 1 - pred["e2e_s_mean"] / fcfs["e2e_s_mean"],
                        "no_wait_mean_cut": fcfs["wait_s_mean"] / fcfs["e2e_s_mean"],
                        "p50_e2e_cut": 1 - pred["e2e_s_p50"] / fcfs["e2e_s_p50"],
                        "throughput_ratio": pred["total_tok_s"] / fcfs["total_tok_s"]}
    o = out["oracle"]
    for lengths in ("learned", "learned_cold"):
        for cut in ("mean_e2e_cut", "p50_e2e_cut"):
            out[lengths][f"kept_{cut}"] = out[lengths][cut] / o[cut] if o[cut] else None
    return out


KEYS = ("completed", "duration_s", "total_tok_s", "output_tok_s", "ttft_ms_p50", "ttft_ms_p99",
        "ttft_ms_p99_interactive", "ttft_ms_p99_batch", "e2e_s_mean", "e2e_s_p50", "e2e_s_p99",
        "wait_s_mean", "wait_s_max", "preemptions")


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
    from pipellm.services.compute.sim.hardware import model

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
