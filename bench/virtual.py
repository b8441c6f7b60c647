"""Whole workloads through the real engine (scheduler + KV allocator) on a virtual clock.

`simulate(config, workload, seed)` runs `LLMEngine` with the sim backend and a `VirtualClock`:
a request is added once the clock reaches its arrival (an idle engine jumps the clock to the
next arrival), every step advances the clock by its modelled time, and each request's arrival,
first-token time, per-token times, finish time and preemptions are recorded. No sleeping and
no model, so thousands of requests take seconds; the result is a pure function of the config,
the workload and the seed.

    python -m bench.virtual --sim-gpu h100 --sim-model llama-3-8b \\
        --workload sharegpt --requests 2000 --qps 4,8,16,inf [--predict oracle] [--json]

Workload items are `(arrival_s, prompt_len, output_len[, predicted_len[, max_tokens]])`:
`output_len` is the request's true output length, `predicted_len` what the length predictor
would say (None: --default-predicted-len; the `predicted` KV policy reserves for it),
`max_tokens` what the request asks for (None: `simulate`'s `max_tokens`, else `output_len`).
When max_tokens > output_len the simulated model ends the output with EOS after output_len
tokens (`SimRunner.eos_at`); otherwise it runs to max_tokens. The `max` KV policy reserves
prompt + max_tokens, so compare the policies with a max_tokens above the true lengths.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Protocol

from pipellm.shared.config import EngineConfig
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.sampling import InvalidParams, SamplingParams
from pipellm.shared.settings import add_config_args, config_from_args, with_settings

# (arrival_s, prompt_len, output_len[, predicted_len[, max_tokens[, prompt token ids[,
# priority]]]]); without ids a prompt is prompt_len copies of token 1 (no two prompts differ:
# prefix caching needs the ids)
WorkItem = tuple


@dataclass
class RequestRecord:
    index: int  # position in the workload
    arrival: float
    prompt_len: int
    output_len: int  # the true output length (EOS after it when max_tokens is larger)
    max_tokens: int = 0
    admitted: float | None = None  # first admission (start of the step that took it)
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    finish_reason: str | None = None  # "length", or "rejected" (did not fit the engine)
    admissions: int = 0

    @property
    def generated(self) -> int:
        return len(self.token_times)

    @property
    def preemptions(self) -> int:
        return max(self.admissions - 1, 0)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finish is None or self.generated < 2:
            return None
        return (self.finish - self.first_token) / (self.generated - 1)


class OnlinePredictor(Protocol):
    """A length predictor driven by the simulation: asked when a request arrives, taught its
    true output length when it finishes (in virtual-time order)."""

    def predict(self, index: int) -> LengthDist | int | None: ...

    def learn(self, index: int, output_len: int) -> None: ...

    def refine(self, index: int, generated: int) -> LengthDist | None:
        """A new prediction once the request's token after `generated` ones is out (the
        engine's hidden-state checkpoints), or None to keep the one it has."""


def simulate(config: EngineConfig, workload: Sequence[WorkItem], seed: int = 0,
             engine_stats: dict | None = None, max_tokens: int | None = None,
             predictor: OnlinePredictor | None = None) -> list[RequestRecord]:
    """Run `workload` through the engine on the virtual clock; records in workload order.
    `max_tokens`: what every request asks for unless its item says (None: its output_len).
    `engine_stats`, if given, is filled with the engine's counters and the modelled busy time.
    `predictor`, if given, replaces the items' predicted lengths."""
    from pipellm.services.compute.backend import build_engine

    config = with_settings(config, backend="sim", sim_clock="virtual")
    engine = build_engine(config)
    clock = engine.runner.clock
    rng = random.Random(seed)
    records = [RequestRecord(i, float(w[0]), int(w[1]), int(w[2]))
               for i, w in enumerate(workload)]
    order = sorted(range(len(workload)), key=lambda i: records[i].arrival)
    live: dict[str, RequestRecord] = {}
    nxt = 0
    while nxt < len(order) or engine.has_work():
        while nxt < len(order) and records[order[nxt]].arrival <= clock.now:
            item = workload[order[nxt]]
            if predictor is not None:
                item = (*item[:3], predictor.predict(order[nxt]), *item[4:])
            _add(engine, records[order[nxt]], item, rng, live, max_tokens)
            nxt += 1
        if not engine.has_work():
            if nxt < len(order):
                clock.now = max(clock.now, records[order[nxt]].arrival)
            continue
        before = clock.now
        result = engine.step()
        now = clock.now
        for rid in result.admitted:
            rec = live[rid]
            rec.admissions += 1
            if rec.admitted is None:
                rec.admitted = before
        for e in result.outputs:
            rec = live[e.request_id]
            if rec.first_token is None:
                rec.first_token = now
            rec.token_times.append(now)
            if e.finish_reason is not None:
                rec.finish, rec.finish_reason = now, e.finish_reason
                del live[e.request_id]
                if predictor is not None:
                    predictor.learn(rec.index, rec.generated)
                engine.runner.eos_at.pop(e.request_id, None)
            elif predictor is not None and \
                    (dist := predictor.refine(rec.index, rec.generated - 1)) is not None:
                seq = engine.requests[e.request_id]
                seq.predicted_length, seq.peak_total = dist, 0
        if now == before and not result.outputs:  # nothing could run: wait for an arrival
            if nxt == len(order):
                raise RuntimeError("the engine has work but cannot schedule any of it")
            clock.now = max(clock.now, records[order[nxt]].arrival)
    if engine_stats is not None:
        engine_stats.update(vars(engine.stats()), steps=engine.runner.steps,
                            busy_s=engine.runner.busy_s, capacity=engine.runner.capacity)
    return records


def _add(engine, rec: RequestRecord, item: WorkItem, rng: random.Random,
         live: dict[str, RequestRecord], max_tokens: int | None) -> None:
    predicted = item[3] if len(item) > 3 else None
    asked = item[4] if len(item) > 4 and item[4] else max_tokens or rec.output_len
    rec.max_tokens = int(asked)
    rid = str(rec.index)
    try:
        params = SamplingParams(max_tokens=rec.max_tokens, seed=rng.getrandbits(63))
        ids = list(item[5]) if len(item) > 5 and item[5] else [1] * rec.prompt_len
        engine.add_request(ids, params, rid,
                           predicted if isinstance(predicted, LengthDist | None) else
                           int(predicted), priority=item[6] if len(item) > 6 else 0)
    except InvalidParams:
        rec.finish, rec.finish_reason = rec.arrival, "rejected"
        return
    if rec.max_tokens > rec.output_len:
        engine.runner.eos_at[rid] = rec.output_len
    live[rid] = rec


# -- summaries -----------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Throughput and latency of a simulation (times in seconds; TTFT/TPOT in ms)."""
    done = [r for r in records if r.finish_reason not in (None, "rejected")]
    out: dict[str, float] = {"requests": len(records), "completed": len(done),
                             "rejected": sum(r.finish_reason == "rejected" for r in records)}
    if not done:
        return out
    start = min(r.arrival for r in records)
    duration = max(r.finish for r in done) - start
    out_tokens = sum(r.generated for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    ttft = [r.ttft * 1e3 for r in done]
    tpot = [r.tpot * 1e3 for r in done if r.tpot is not None]
    itl = [(b - a) * 1e3 for r in done for a, b in pairwise(r.token_times)]
    out |= {
        "duration_s": duration, "output_tokens": out_tokens, "input_tokens": in_tokens,
        "output_tok_s": out_tokens / duration, "total_tok_s": (out_tokens + in_tokens) / duration,
        "req_s": len(done) / duration,
        "ttft_ms_mean": sum(ttft) / len(ttft), "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_mean": sum(tpot) / len(tpot) if tpot else math.nan,
        "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
        "itl_ms_p99": percentile(itl, 99),
        "max_concurrent": max_concurrent(done),
        "preempted_requests": sum(r.preemptions > 0 for r in done),
        "preemptions": sum(r.preemptions for r in done),
    }
    return out


def max_concurrent(records: Sequence[RequestRecord]) -> int:
    """Most requests holding KV at once (between first admission and finish)."""
    events = sorted([(r.admitted, 1) for r in records if r.admitted is not None]
                    + [(r.finish, -1) for r in records if r.admitted is not None])
    best = cur = 0
    for _, d in events:  # at equal times finishes (-1) come first
        cur += d
        best = max(best, cur)
    return best


# -- workloads -----------------------------------------------------------------------------
def with_arrivals(lengths: Sequence[tuple[int, int]], qps: float, seed: int = 0,
                  ) -> list[WorkItem]:
    """(prompt_len, output_len) pairs arriving as a Poisson process of rate `qps`
    (inf or <= 0: all at time 0, an offline batch)."""
    rng = random.Random(seed)
    t, items = 0.0, []
    for p, o in lengths:
        if 0 < qps < math.inf:
            t += rng.expovariate(qps)
        items.append((t, p, o))
    return items


def sharegpt_lengths(n: int, seed: int = 0, path: str | Path | None = None,
                     max_len: int | None = None) -> list[tuple[int, int]]:
    """n (prompt_len, output_len) pairs drawn (shuffled, cycling) from the ShareGPT samples,
    lengths estimated at 4 characters per token; synthetic lognormal lengths (means 256) when
    the file is missing. Pairs with prompt + output over `max_len` are skipped, as
    benchmark_serving does."""
    from pipellm.loadgen.datasets import SHAREGPT_FILE, default_data_dir, load_sharegpt, synthetic

    path = Path(path) if path else default_data_dir() / SHAREGPT_FILE
    if path.is_file():
        pool = [(w.prompt_len, w.output_len) for w in load_sharegpt(path)]
    else:
        pool = [(w.prompt_len, w.output_len) for w in synthetic(1024, seed)]
    if max_len:
        pool = [(p, o) for p, o in pool if p + o <= max_len]
    random.Random(seed).shuffle(pool)
    return [pool[i % len(pool)] for i in range(n)]


def azure_trace(path: str | Path, limit: int | None = None, time_scale: float = 1.0,
                ) -> list[WorkItem]:
    """The Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens): arrivals relative to
    the first request, divided by `time_scale` (2: twice the rate)."""
    items: list[WorkItem] = []
    t0 = None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if limit is not None and len(items) >= limit:
                break
            ts = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
            t0 = ts if t0 is None else t0
            items.append(((ts - t0) / time_scale, max(int(row["ContextTokens"]), 1),
                          max(int(row["GeneratedTokens"]), 1)))
    return items


# -- command line --------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.virtual",
                                description=__doc__.split("\n\n")[0])
    add_config_args(p, EngineConfig)
    p.add_argument("--workload", choices=("sharegpt", "synthetic", "azure"), default="sharegpt")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--qps", default="inf", help="comma-separated request rates (inf: offline)")
    p.add_argument("--azure-scale", type=float, default=1.0, help="azure: time axis divisor")
    p.add_argument("--predict", choices=("default", "oracle"), default="default",
                   help="predicted lengths: --default-predicted-len, or the true output length")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="what every request asks for (0: its true output length); larger: "
                        "outputs end with EOS at their true length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="only the JSON line")
    args = p.parse_args(argv)
    config = config_from_args(EngineConfig, args, backend="sim", sim_clock="virtual")
    from pipellm.services.compute.sim.hardware import model

    ctx = model(config.sim.model).context
    rows = []
    for qps_text in args.qps.split(","):
        qps = float(qps_text)
        if args.workload == "azure":
            from pipellm.loadgen.datasets import default_data_dir

            wl = azure_trace(default_data_dir() / "azure_llm_trace_conv_2023.csv", args.requests,
                             args.azure_scale)
        else:
            if args.workload == "sharegpt":
                lengths = sharegpt_lengths(args.requests, args.seed, max_len=ctx)
            else:
                from pipellm.loadgen.datasets import synthetic

                lengths = [(w.prompt_len, w.output_len)
                           for w in synthetic(args.requests, args.seed)]
            wl = with_arrivals(lengths, qps, args.seed)
        if args.predict == "oracle":
            wl = [(*w[:3], w[2]) for w in wl]
        stats: dict = {}
        t0 = time.perf_counter()
        summary = summarize(simulate(config, wl, args.seed, stats, args.max_tokens or None))
        summary |= {"qps": f"trace/{args.azure_scale:g}" if args.workload == "azure"
                    else qps if math.isfinite(qps) else "inf",
                    "steps": stats["steps"], "moves": stats["moves"],
                    "kv_capacity": stats["capacity"], "gpu_busy_s": stats["busy_s"],
                    "wall_s": time.perf_counter() - t0}
        rows.append(summary)
        if not args.json:
            print(_line(summary), flush=True)
    print(json.dumps({"gpu": config.sim.gpu, "model": config.sim.model,
                      "kv_policy": config.scheduler.kv_policy, "workload": args.workload,
                      "predict": args.predict, "results": [_rounded(r) for r in rows]}))
    return 0


def _line(s: dict) -> str:
    if "duration_s" not in s:
        return f"qps {s['qps']}: nothing completed ({s['rejected']} rejected)"
    return (f"qps {s['qps']}: {s['completed']} done in {s['duration_s']:.1f} s | "
            f"{s['output_tok_s']:.0f} out tok/s, {s['req_s']:.2f} req/s | TTFT mean "
            f"{s['ttft_ms_mean']:.0f} p50 {s['ttft_ms_p50']:.0f} p99 {s['ttft_ms_p99']:.0f} ms | "
            f"TPOT mean {s['tpot_ms_mean']:.1f} p99 {s['tpot_ms_p99']:.1f} ms | max concurrent "
            f"{s['max_concurrent']}, preemptions {s['preemptions']}, moves {s['moves']} | "
            f"{s['steps']} steps, wall "
            f"{s['wall_s']:.1f} s")


def _rounded(d: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


if __name__ == "__main__":
    sys.exit(main())
