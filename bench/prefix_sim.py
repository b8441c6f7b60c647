"""Prefix caching in the simulator: QPS at the SLO with and without `--enable-prefix-caching`.

The engine itself (scheduler, allocator, prefix cache) runs against a modelled GPU
(pipellm/services/compute/sim, the virtual clock of bench/virtual.py), as in bench/ablation.py,
whose SLO (p99 TTFT <= 3 s, p99 TPOT <= 50 ms) and rate search it uses. Workloads, with prompt token
ids so that prefixes can match (each distinct text piece a run of seeded random ids):

    multiturn      ShareGPT lengths as 4-turn conversations: turn k's prompt is turn k-1's
                   prompt, that turn's answer and a new question
                   (pipellm/loadgen/prefix_datasets.py's shape), turn by turn across the
                   conversations
    shared-prefix  a 1,024-token system prompt before every ShareGPT question
    azure          the Azure 2023 conversation trace, its own arrival times scaled. It has no
                   text and no session ids, so what its requests share is unknown: each prompt
                   is unique here, the control that shows what the cache costs when nothing hits

Predicted lengths are the true ones (oracle) in every row, so the rows differ only by the cache.

    python -m bench.prefix_sim [--quick] [--models llama-3-8b,llama-2-7b] [--requests 1000]

The last line printed is JSON with each row's QPS at the SLO and the ratios with / without.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.ablation import Variant, qps_at_slo  # noqa: E402
from bench.common import log, machine  # noqa: E402
from bench.virtual import azure_trace, sharegpt_lengths, simulate, with_arrivals  # noqa: E402
from pipellm.loadgen.datasets import AZURE_FILE, default_data_dir  # noqa: E402
from pipellm.services.compute.sim.hardware import model as model_spec  # noqa: E402
from pipellm.shared.config import EngineConfig  # noqa: E402
from pipellm.shared.settings import with_settings  # noqa: E402

WORKLOADS = ("multiturn", "shared-prefix", "azure")
TURNS, SYSTEM_TOKENS, VOCAB = 4, 1024, 32000


class PrefixWorkload:
    """Items with prompt ids; `at(qps, predict)` as bench/ablation.py's Workload."""

    def __init__(self, name: str, n: int, context: int, seed: int):
        self.name, self.seed = name, seed
        rng = random.Random(seed)
        piece = lambda k: tuple(rng.randrange(3, VOCAB) for _ in range(k))  # noqa: E731
        if name == "azure":
            trace = [w for w in azure_trace(default_data_dir() / AZURE_FILE, 2 * n)
                     if w[1] + w[2] <= context][:n]
            self.native_qps = (len(trace) - 1) / (trace[-1][0] - trace[0][0])
            self.times = [t - trace[0][0] for t, _, _ in trace]
            self.items = [(piece(p), o) for _, p, o in trace]
            return
        self.times = None
        pairs = sharegpt_lengths(n, seed, max_len=context // (2 * TURNS))
        if name == "shared-prefix":
            system = piece(SYSTEM_TOKENS)
            self.items = [(system + piece(p), o) for p, o in pairs]
            return
        turns: list[list[tuple]] = [[] for _ in range(TURNS)]
        for c in range(-(-n // TURNS)):
            prompt = ()
            for k in range(TURNS):
                p, o = pairs[(c * TURNS + k) % len(pairs)]
                prompt += piece(p)
                turns[k].append((prompt, o))
                prompt += piece(o)  # the answer, as the next turn's prompt carries it
        self.items = [w for turn in turns for w in turn][:n]

    def at(self, qps: float, predict: str) -> list[tuple]:
        if self.times is not None:
            scale = qps / self.native_qps
            timed = [t / scale for t in self.times]
        else:
            timed = [t for t, _, _ in with_arrivals([(1, 1)] * len(self.items), qps,
                                                     self.seed)]
        return [(t, len(ids), o, o, o, ids)
                for t, (ids, o) in zip(timed, self.items, strict=True)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3-8b,llama-2-7b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--bisect", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="120 requests, 2 bisections")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.bisect = min(args.requests, 120), min(args.bisect, 2)
    return args


def measure(args, model: str) -> list[dict]:
    """Each workload's QPS at the SLO on `model`, without and with the cache."""
    base = with_settings(EngineConfig(), backend="sim", sim_clock="virtual", sim_gpu=args.gpu,
                         sim_model=model)
    rows = []
    for name in args.workloads.split(","):
        wl = PrefixWorkload(name, args.requests, model_spec(model).context, args.seed)
        for caching in (False, True):
            t0 = time.perf_counter()
            v = Variant(f"prefix caching {'on' if caching else 'off'}", {}, "oracle")
            at = qps_at_slo(with_settings(base, enable_prefix_caching=caching), wl, v,
                            args.bisect) or {}
            rows.append(dict(model=model, workload=name, caching=caching,
                             qps_at_slo=at.get("qps"), ttft_ms_p50=at.get("ttft_ms_p50"),
                             output_tok_s=at.get("output_tok_s")))
            log(f"{model} {name} cache {'on' if caching else 'off'}: {at.get('qps')} req/s "
                f"at SLO ({time.perf_counter() - t0:.0f} s)")
        stats: dict = {}  # the cached run's counters at its QPS at the SLO
        simulate(with_settings(base, enable_prefix_caching=True),
                 wl.at(rows[-1]["qps_at_slo"] or 1.0, "oracle"), wl.seed, stats)
        rows[-1]["prefix_hit_rate"] = round(stats["prefix_hits"] / stats["prefix_queries"], 4)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"machine: {machine()}; simulated {args.gpu}, {args.requests} requests; SLO p99 "
          f"TTFT 3 s, p99 TPOT 50 ms; oracle lengths in every row")
    rows = [r for model in args.models.split(",") for r in measure(args, model)]
    print(f"\n{'model':<11} {'workload':<14} {'cache':<6} {'QPS at SLO':>11} {'p50 TTFT ms':>12}"
          f" {'hit rate':>9}")
    for r in rows:
        qps = "-" if r["qps_at_slo"] is None else f"{r['qps_at_slo']:.2f}"
        ttft = "-" if r["ttft_ms_p50"] is None else f"{r['ttft_ms_p50']:.0f}"
        hit = f"{r['prefix_hit_rate']:.1%}" if "prefix_hit_rate" in r else ""
        print(f"{r['model']:<11} {r['workload']:<14} {'on' if r['caching'] else 'off':<6} "
              f"{qps:>11} {ttft:>12} {hit:>9}")
    ratios: dict = {}
    for r in rows:
        if r["caching"]:
            off = next(o for o in rows if o["model"] == r["model"] and
                       o["workload"] == r["workload"] and not o["caching"])["qps_at_slo"]
            ratio = round(r["qps_at_slo"] / off, 3) if r["qps_at_slo"] and off else None
            ratios.setdefault(r["model"], {})[r["workload"]] = ratio
            print(f"{r['model']} {r['workload']}: QPS at SLO with / without the cache: {ratio}")
    print(json.dumps(dict(rows=rows, qps_ratio=ratios, gpu=args.gpu, requests=args.requests,
                          machine=machine())))


if __name__ == "__main__":
    main()
