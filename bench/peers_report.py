"""The report of bench/vs_peers.py: medians per (server, workload), and each pipellm row's ratios
against its peers on the targets of issue 45, greedy and sampled, each met or missed."""

from __future__ import annotations

import math
import statistics

METRICS = {"output_throughput": "output tok/s", "mean_ttft_ms": "mean TTFT ms",
           "mean_tpot_ms": "mean TPOT ms"}
SAMPLED = "-s"  # the suffix of a sampled workload's name: sg-s is sg, sampled
# issue 45: (peer, workload, metric, ">=" or "<=", bound) on the ratio pipellm / peer, greedy and
# sampled alike. Peers: "vllm" the faster vLLM row (it picks its ISA itself, so the same row for
# both of pipellm's levels), "llamacpp" the llama.cpp row of pipellm's ISA level, "greedy" the
# same pipellm row's greedy run (sampled only)
TARGETS = [("vllm", "sg", "output_throughput", ">=", 1.2),
           ("vllm", "r2", "mean_tpot_ms", "<=", 0.8),
           ("llamacpp", "sg", "output_throughput", ">=", 2.0),
           ("llamacpp", "b1", "mean_tpot_ms", "<=", 1.0),
           ("llamacpp", "b1", "mean_ttft_ms", "<=", 1.0),
           ("greedy", "sg", "output_throughput", ">=", 0.95)]


def summarize(rows: list[dict]) -> dict:
    """{server: {workload: medians of METRICS over the runs that produced a result, runs ok,
    runs, failed requests}}, in the order the rows came."""
    out: dict = {}
    for server in dict.fromkeys(r["server"] for r in rows):
        out[server] = {}
        for wl in dict.fromkeys(r["workload"] for r in rows if r["server"] == server):
            runs = [r for r in rows if r["server"] == server and r["workload"] == wl]
            ok = [r for r in runs if r["ok"]]
            cell = {m: round(statistics.median(r[m] for r in ok), 3) if ok else None
                    for m in METRICS}
            out[server][wl] = dict(cell, runs_ok=len(ok), runs=len(runs),
                                   failed_requests=sum(r.get("failed", 0) for r in ok))
    return out


def _get(summary: dict, server: str, wl: str, metric: str) -> float | None:
    return summary.get(server, {}).get(wl, {}).get(metric)


def faster_vllm(summary: dict, suffix: str = "") -> str | None:
    """The vLLM row with the most sg output tok/s (then the lowest r2 TPOT) in the sampling
    mode of `suffix`; None if no vLLM row ran."""
    rows = [s for s in summary if s.startswith("vllm")]
    score = lambda s: (_get(summary, s, "sg" + suffix, "output_throughput") or 0.0,
                       -(_get(summary, s, "r2" + suffix, "mean_tpot_ms") or math.inf))
    return max(rows, key=score, default=None)


def check_targets(summary: dict, mine: dict[str, str]) -> list[dict]:
    """Every pipellm row of `mine` ({pipellm row: its llama.cpp row}) that ran, against every
    TARGET whose peer ran, in each sampling mode it ran: the ratio and pass (None: a side has
    no figure)."""
    out = []
    for row in (s for s in summary if s in mine):
        for sfx, mode in (("", "greedy"), (SAMPLED, "sampled")):
            if not any(w.endswith(SAMPLED) == bool(sfx) for w in summary[row]):
                continue
            peers = {"vllm": faster_vllm(summary, sfx), "llamacpp": mine[row]}
            for peer, wl, metric, op, bound in TARGETS:
                if peer == "greedy":
                    if not sfx:
                        continue
                    versus, b = f"{row} greedy", _get(summary, row, wl, metric)
                else:
                    if peers[peer] not in summary:
                        continue
                    versus, b = peers[peer], _get(summary, peers[peer], wl + sfx, metric)
                a = _get(summary, row, wl + sfx, metric)
                ratio = round(a / b, 3) if a is not None and b else None
                ok = None if ratio is None else ratio >= bound if op == ">=" else ratio <= bound
                out.append(dict(pipellm=row, sampling=mode, peer=versus, workload=wl + sfx,
                                metric=metric, target=f"{op} {bound}", ratio=ratio, passed=ok))
    return out


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(summary: dict, checks: list[dict], commands: dict[str, str]) -> None:
    """The table of medians, the targets and the command line of each server."""
    print(f"{'server':<15} {'wl':<4} " + " ".join(f"{v:>13}" for v in METRICS.values())
          + f" {'runs ok':>8} {'failed req':>10}")
    for server, cells in summary.items():
        for wl, c in cells.items():
            print(f"{server:<15} {wl:<4} " + " ".join(f"{_fmt(c[m]):>13}" for m in METRICS)
                  + f" {c['runs_ok']:>4}/{c['runs']:<3} {c['failed_requests']:>10}")
    print("\ntargets of issue 45 (ratio = pipellm / peer):")
    for c in checks:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[c["passed"]]
        print(f"  {c['pipellm']:<13} {c['sampling']:<7} vs {c['peer']:<20} {c['workload']:<4} "
              f"{METRICS[c['metric']]:<13} {_fmt(c['ratio'], '.2f'):>6}  target "
              f"{c['target']:<7} {verdict}")
    met = sum(c["passed"] is True for c in checks)
    missed = sum(c["passed"] is False for c in checks)
    print(f"  {met} met, {missed} missed, {len(checks) - met - missed} n/a of {len(checks)}")
    for tag, cmd in commands.items():
        print(f"command, {tag}: {cmd}")
