"""Printing and saving results: vLLM's text table and file naming, JSON with vLLM's keys."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from datetime import datetime
from pathlib import Path

from pipellm.loadgen.metrics import percentile_key

HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def now_stamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def table(result: dict, metrics: list[str], percentiles: list[float]) -> str:
    """The `vllm bench serve` result block for a run's result dict."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    if result.get("request_rate") not in (None, "inf"):
        row("Request rate configured (RPS):", result["request_rate"], ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", result["max_concurrent_requests"], ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for m in metrics:
        short, header = HEADERS[m]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{m}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{m}_ms"], ".2f")
        for p in percentiles:
            key = percentile_key(p)
            row(f"{key.upper()} {short} (ms):", result[f"{key}_{m}_ms"], ".2f")
    for name, c in (result.get("classes") or {}).items():
        lines.append("{s:{c}^{n}}".format(s=f" class {name} ", n=50, c="-"))
        row("Successful requests:", c["completed"])
        for m in ("ttft", "e2el"):
            short = HEADERS[m][0]
            row(f"Mean {short} (ms):", c[f"mean_{m}_ms"], ".2f")
            for key in [k.split("_")[0] for k in c if k.endswith(f"_{m}_ms")
                        and k.startswith("p")]:
                row(f"{key.upper()} {short} (ms):", c[f"{key}_{m}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def failures(errors: list[str], most: int = 3) -> str:
    """Why requests failed: the `most` commonest errors with their counts ("" if none did)."""
    counts = Counter(e for e in errors if e)
    if not counts:
        return ""
    lines = [f"{counts.total()} of {len(errors)} requests failed:"]
    lines += [f"  {n} x {error}" for error, n in counts.most_common(most)]
    if len(counts) > most:
        lines.append(f"  ... and {len(counts) - most} other errors")
    return "\n".join(lines)


def sweep_table(sweep: dict) -> str:
    """One line per probe (in rate order) and the answer."""
    keys = [f"{percentile_key(sweep['slo']['percentile'])}_{m}_ms" for m in ("ttft", "tpot")]
    lines = ["{s:{c}^{n}}".format(s=" QPS Sweep ", n=78, c="="),
             f"{'offered':>9} {'req/s':>8} {'out tok/s':>10} {keys[0]:>14} {keys[1]:>14}"
             f" {'failed':>7}  SLO"]
    for p in sorted(sweep["probes"], key=lambda p: p["request_rate"]):
        lines.append(f"{p['request_rate']:>9.3f} {p['request_throughput']:>8.2f}"
                     f" {p['output_throughput']:>10.1f} {p.get(keys[0], math.nan):>14.1f}"
                     f" {p.get(keys[1], math.nan):>14.1f} {p['failed']:>7}"
                     f"  {'met' if p['meets_slo'] else 'missed'}")
    slo = ", ".join(f"{k} <= {v:g}" for k, v in sweep["slo"].items() if k != "percentile")
    lines.append(f"qps_at_slo: {sweep['qps_at_slo']:.3f} req/s "
                 f"(p{sweep['slo']['percentile']:g} {slo})")
    lines.append("=" * 78)
    return "\n".join(lines)


def result_path(label: str, rate: float | str, max_concurrency: int | None, model: str,
                stamp: str, filename: str | None, result_dir: str | None) -> Path:
    """vLLM's name: {label}-{rate}qps[-concurrency{N}]-{model basename}-{date}.json, unless
    `filename` is given; inside `result_dir` when given (created)."""
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    name = filename or f"{label}-{rate}qps{conc}-{model.split('/')[-1]}-{stamp}.json"
    if result_dir:
        os.makedirs(result_dir, exist_ok=True)
        return Path(result_dir) / name
    return Path(name)


def save(result: dict, path: Path) -> Path:
    """Write `result` as JSON (non-finite floats become null, so any JSON parser reads it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(result)), encoding="utf-8")
    return path


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
