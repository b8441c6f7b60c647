"""The report of bench/vs_peers.py: medians per (server, workload), and pipellm's ratios against
its peers on the targets of issue 33, each with pass or fail."""

from __future__ import annotations

import statistics

METRICS = {"output_throughput": "output tok/s", "mean_ttft_ms": "mean TTFT ms",
           "mean_tpot_ms": "mean TPOT ms"}
# issue 33: (peer, workload, metric, ">=" or "<=", bound) on the ratio pipellm / peer
TARGETS = [("vllm-bf16", "sg", "output_throughput", ">=", 1.2),
           ("vllm-bf16", "r2", "mean_tpot_ms", "<=", 0.8),
           ("vllm-bf16", "b1", "mean_ttft_ms", "<=", 1.0),
           ("vllm-bf16", "b1", "mean_tpot_ms", "<=", 1.0),
           ("llamacpp", "b1", "mean_tpot_ms", "<=", 1.0),
           ("llamacpp", "b1", "mean_ttft_ms", "<=", 1.5),
           ("llamacpp", "sg", "output_throughput", ">=", 2.0)]


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


def check_targets(summary: dict, mine_names) -> list[dict]:
    """Every row named in `mine_names` (pipellm's) against every TARGET whose peer ran: the
    ratio and pass (None: a side has no figure)."""
    out = []
    for mine in (s for s in summary if s in mine_names):
        for peer, wl, metric, op, bound in TARGETS:
            if peer not in summary:
                continue
            a, b = (summary[s].get(wl, {}).get(metric) for s in (mine, peer))
            ratio = round(a / b, 3) if a is not None and b else None
            ok = None if ratio is None else ratio >= bound if op == ">=" else ratio <= bound
            out.append(dict(pipellm=mine, peer=peer, workload=wl, metric=metric,
                            target=f"{op} {bound}", ratio=ratio, passed=ok))
    return out


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(summary: dict, checks: list[dict], commands: dict[str, str]) -> None:
    """The table of medians, the targets and the command line of each server."""
    print(f"{'server':<15} {'wl':<3} " + " ".join(f"{v:>13}" for v in METRICS.values())
          + f" {'runs ok':>8} {'failed req':>10}")
    for server, cells in summary.items():
        for wl, c in cells.items():
            print(f"{server:<15} {wl:<3} " + " ".join(f"{_fmt(c[m]):>13}" for m in METRICS)
                  + f" {c['runs_ok']:>4}/{c['runs']:<3} {c['failed_requests']:>10}")
    print("\ntargets (ratio = pipellm / peer):")
    for c in checks:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[c["passed"]]
        print(f"  {c['pipellm']:<13} vs {c['peer']:<10} {c['workload']:<3} "
              f"{METRICS[c['metric']]:<13} {_fmt(c['ratio'], '.2f'):>6}  target "
              f"{c['target']:<7} {verdict}")
    for tag, cmd in commands.items():
        print(f"command, {tag}: {cmd}")
