"""PNG plots of results: latency CDFs of a run; throughput and latency vs offered QPS of a sweep.

matplotlib is optional: it is imported only here, on use; without it the plot functions say so
on stderr and return None.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib)",
              file=sys.stderr)
        return None
    return plt


def latency_samples_ms(result: dict) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT, E2EL and all ITLs (ms) of a saved result's arrays."""
    ok = [i for i, n in enumerate(result["output_lens"]) if n > 0 and not result["errors"][i]]
    ttft = [result["ttfts"][i] * 1e3 for i in ok]
    e2el = [result["latencies"][i] * 1e3 for i in ok]
    tpot = [(result["latencies"][i] - result["ttfts"][i]) * 1e3 / (result["output_lens"][i] - 1)
            for i in ok if result["output_lens"][i] > 1]
    itl = [g * 1e3 for i in ok for g in result["itls"][i]]
    return {"TTFT": ttft, "TPOT": tpot, "ITL": itl, "E2EL": e2el}


def plot_latency_cdfs(result: dict, path: str | Path) -> Path | None:
    """A 2x2 figure of the CDFs of TTFT, TPOT, ITL and E2EL."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, latency_samples_ms(result).items(), strict=True):
        if values:
            xs = np.sort(values)
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
        ax.set_title(f"{name} CDF ({len(values)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result.get('model_id', '')}  {result.get('mode', '')}  "
                 f"rate={result.get('request_rate', '')} req/s")
    fig.tight_layout()
    return _save(plt, fig, path)


def plot_sweep(sweep: dict, path: str | Path) -> Path | None:
    """Achieved throughput and tail latency against the offered request rate."""
    plt = _pyplot()
    if plt is None:
        return None
    probes = sorted(sweep["probes"], key=lambda p: p["request_rate"])
    rates = [p["request_rate"] for p in probes]
    pct = sweep["slo"]["percentile"]
    pkey = f"p{int(pct)}" if int(pct) == pct else f"p{pct}"
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.plot(rates, [p["request_throughput"] for p in probes], "o-", label="requests/s")
    a.plot(rates, rates, ":", color="grey", label="offered")
    a.set_xlabel("offered QPS")
    a.set_ylabel("requests/s")
    a2 = a.twinx()
    a2.plot(rates, [p["output_throughput"] for p in probes], "s--", color="C1",
            label="output tok/s")
    a2.set_ylabel("output tokens/s")
    a.legend(loc="upper left")
    a2.legend(loc="lower right")
    for i, metric in enumerate(("ttft", "tpot")):
        key = f"{pkey}_{metric}_ms"
        if all(key in p for p in probes):
            b.plot(rates, [p[key] for p in probes], "o-", color=f"C{i}", label=key)
        limit = sweep["slo"].get(f"{metric}_ms")
        if limit is not None:
            b.axhline(limit, color=f"C{i}", ls=":", label=f"SLO {metric} {limit:g} ms")
    best = sweep["qps_at_slo"]
    b.axvline(best, color="k", ls="--", label=f"qps_at_slo {best:.3g}")
    b.set_yscale("log")
    b.set_xlabel("offered QPS")
    b.set_ylabel("ms")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(plt, fig, path)


def _save(plt, fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
