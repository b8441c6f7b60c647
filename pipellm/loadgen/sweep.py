"""Find the highest offered request rate (QPS) whose run meets a latency SLO.

Search: probe `start_rate`, double while probes pass, then bisect between the best passing and
the lowest failing rate until they are within `tolerance` (relative) or `max_probes` runs are
spent. (If the first probe fails, the search bisects down from it.) A probe passes when it
had no failed request and the `percentile`-th percentile of every SLO metric is within its
limit. `qps_at_slo` is the highest passing rate, 0 if none passed. Each probe is a full run of
the workload at that rate (Poisson/gamma arrivals), so a probe's cost is num_prompts / rate s.

A probe only sees overload once the queue it builds outlasts the TTFT SLO: offered r > served
mu for n / r seconds leaves the last request waiting about (n / mu)(1 - mu / r). Probes whose
arrivals span less than `SHORT_RUN_FACTOR` x the TTFT SLO can pass above the server's capacity;
`short_run_note` says so (more prompts fix it; the achieved req/s column shows saturation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pipellm.loadgen.metrics import percentile_key

DEFAULT_SLOS = {"ttft": 3000.0, "tpot": 50.0}
SHORT_RUN_FACTOR = 4.0


@dataclass(frozen=True)
class SweepConfig:
    slos: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_SLOS))  # ms
    percentile: float = 99.0
    start_rate: float = 1.0
    max_probes: int = 6
    tolerance: float = 0.05


def slo_keys(cfg: SweepConfig) -> dict[str, str]:
    """SLO metric -> the result key it is checked on, e.g. "ttft" -> "p99_ttft_ms"."""
    return {m: f"{percentile_key(cfg.percentile)}_{m}_ms" for m in cfg.slos}


def meets(result: dict, cfg: SweepConfig) -> bool:
    """Whether a run's summary meets the SLOs (and nothing failed)."""
    if result["failed"] or not result["completed"]:
        return False
    return all(result[key] <= cfg.slos[m] for m, key in slo_keys(cfg).items())


def search(probe: Callable[[float], dict], cfg: SweepConfig) -> dict:
    """Run `probe(rate) -> summary` at the rates the search picks; see the module docstring.

    Returns {"qps_at_slo", "slo", "probes": [summary without per-request arrays, plus
    "request_rate" and "meets_slo"], in probe order}.
    """
    if cfg.start_rate <= 0 or cfg.max_probes < 1:
        raise ValueError("start rate must be positive and max_probes >= 1")
    lo, hi = 0.0, None
    rate = cfg.start_rate
    probes = []
    for _ in range(cfg.max_probes):
        result = probe(rate)
        ok = meets(result, cfg)
        brief = {k: v for k, v in result.items() if not isinstance(v, list)}
        probes.append({**brief, "request_rate": rate, "meets_slo": ok})
        if ok:
            lo = max(lo, rate)
        else:
            hi = rate if hi is None else min(hi, rate)
        if hi is None:
            rate *= 2
        elif hi - lo <= cfg.tolerance * hi:
            break
        else:
            rate = (lo + hi) / 2
    return {"qps_at_slo": lo, "slo": {"percentile": cfg.percentile, **{
        f"{m}_ms": v for m, v in cfg.slos.items()}}, "probes": probes}


def short_run_note(found: dict, num_prompts: int) -> str | None:
    """A warning when the best passing probe was too short for overload to show (see above)."""
    best, ttft_ms = found["qps_at_slo"], found["slo"].get("ttft_ms")
    if not best or ttft_ms is None:
        return None
    span = num_prompts / best
    if span >= SHORT_RUN_FACTOR * ttft_ms / 1000:
        return None
    return (f"note: at {best:g} req/s the {num_prompts} prompts arrive within {span:.1f} s, "
            f"under {SHORT_RUN_FACTOR:g}x the TTFT SLO: overload may not show in TTFT yet; "
            f"use more --num-prompts (compare offered and achieved req/s above)")
