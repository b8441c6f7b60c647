"""Per-request records -> the summary `vllm bench serve` reports, with its names and definitions.

Definitions (times in seconds in records, milliseconds in the summary):

* TTFT: from sending the request to the first streamed chunk that carries a choice.
* E2EL: from sending the request to the end of the stream.
* ITL: every gap between consecutive choice-carrying chunks (all requests pooled).
* TPOT: per request (e2el - ttft) / (output_tokens - 1); undefined for 1-token outputs, which
  are left out of the TPOT statistics (and count as TPOT 0 for goodput, as in vLLM).
* Throughputs divide by the run's duration; only successful requests count.
* Peak output throughput (`max_output_tokens_per_s`): the most output tokens in one 1-s window,
  windows counted from the first request's start; each chunk's tokens fall in its arrival
  window (a chunk holds output_tokens / chunks tokens: 1 for servers that stream token by token,
  which is vLLM's count).
* Goodput: successful requests per second whose TTFT, TPOT and E2EL all meet the given SLOs.
* mean/median/std/pNN of a metric with no values (e.g. no successes) are 0, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    prompt_len: int  # the server's usage.prompt_tokens, else the workload's estimate
    expected_output_len: int  # max_tokens sent
    success: bool = False
    error: str = ""
    start_time: float = 0.0  # when it was sent (seconds, same clock for every record)
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between chunks after the first
    latency: float = 0.0  # e2el
    output_tokens: int = 0
    queue_time: float = 0.0  # waited for a concurrency slot before it was sent
    generated_text: str = ""
    request_class: str = ""  # its class in a priority mix; "" outside one

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_slos(pairs: list[str] | None) -> dict[str, float]:
    """["ttft:3000", "tpot:50"] -> {"ttft": 3000.0, "tpot": 50.0} (milliseconds).
    Raises ValueError for another metric name, a negative value or a malformed pair."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = None
        if not sep or ms is None:
            raise ValueError(f"SLO {pair!r} is not KEY:MILLISECONDS")
        if name not in SLO_METRICS:
            raise ValueError(f"SLO metric {name!r} is not one of {', '.join(SLO_METRICS)}")
        if ms < 0:
            raise ValueError(f"SLO {pair!r} is negative")
        slos[name] = ms
    return slos


def metric_values(records: list[RequestRecord], name: str) -> list[float]:
    """A metric's values in seconds over the successful requests (ITL: all gaps pooled)."""
    ok = [r for r in records if r.success]
    if name == "ttft":
        return [r.ttft for r in ok]
    if name == "e2el":
        return [r.latency for r in ok]
    if name == "itl":
        return [gap for r in ok for gap in r.itl]
    if name == "tpot":
        return [r.tpot for r in ok if r.tpot is not None]
    raise ValueError(f"unknown metric {name!r}")


def percentile_key(p: float) -> str:
    """99 -> "p99", 99.9 -> "p99.9" (vLLM's key spelling)."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def stats_ms(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """{"mean", "median", "std", "p99", ...} of `values` (seconds), in ms; zeros when empty."""
    arr = np.asarray(values if values else [0.0], dtype=float) * 1000.0
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(arr, p))
    return out


def good_requests(records: list[RequestRecord], slos: dict[str, float]) -> int:
    """Successful requests meeting every SLO (ms); TPOT of a 1-token output counts as 0."""
    good = 0
    for r in records:
        if not r.success:
            continue
        seen = {"ttft": r.ttft, "e2el": r.latency, "tpot": r.tpot or 0.0}
        if all(seen[name] * 1000.0 <= limit for name, limit in slos.items()):
            good += 1
    return good


def peak_output_per_s(records: list[RequestRecord]) -> float:
    """Most output tokens in a 1-s window (see the module docstring)."""
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0
    t0 = min(r.start_time for r in ok)
    end = max(r.start_time + r.latency for r in ok)
    buckets = np.zeros(int(np.ceil(end - t0)) + 1)
    for r in ok:
        times = np.cumsum([r.start_time + r.ttft, *r.itl]) - t0
        weight = r.output_tokens / len(times) if r.output_tokens else 1.0
        np.add.at(buckets, np.clip(times.astype(int), 0, len(buckets) - 1), weight)
    return float(buckets.max())


def peak_concurrency(records: list[RequestRecord]) -> int:
    """Most successful requests in flight at once (half-open [start, end) intervals)."""
    events = sorted([(r.start_time, 1) for r in records if r.success]
                    + [(r.start_time + r.latency, -1) for r in records if r.success])
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def summarize(records: list[RequestRecord], duration: float,
              percentiles: list[float] | tuple[float, ...] = (99.0,),
              metrics: list[str] | tuple[str, ...] = METRICS,
              slos: dict[str, float] | None = None) -> dict:
    """The summary of a run that took `duration` seconds, under vLLM's result keys."""
    if duration <= 0:
        raise ValueError("duration must be positive")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict = {
        "duration": duration, "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good_requests(records, slos) / duration if slos else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": peak_output_per_s(records),
        "max_concurrent_requests": peak_concurrency(records),
    }
    for name in metrics:
        for stat, value in stats_ms(metric_values(records, name), list(percentiles)).items():
            out[f"{stat}_{name}_ms"] = value
    return out


def class_summary(records: list[RequestRecord],
                  percentiles: list[float] | tuple[float, ...] = (50.0, 99.0)) -> dict:
    """Per request class of a priority mix ({} when no record has one): completed, failed,
    and TTFT and E2EL mean/median/std/pNN in ms over its successful requests."""
    out: dict = {}
    for name in sorted({r.request_class for r in records if r.request_class}):
        mine = [r for r in records if r.request_class == name]
        row: dict = {"completed": sum(r.success for r in mine),
                     "failed": sum(not r.success for r in mine)}
        for metric in ("ttft", "e2el"):
            for stat, value in stats_ms(metric_values(mine, metric), list(percentiles)).items():
                row[f"{stat}_{metric}_ms"] = value
        out[name] = row
    return out


def per_request(records: list[RequestRecord]) -> dict[str, list]:
    """vLLM's per-request arrays (seconds; output_lens 0 for failures), plus queue_times."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [list(r.itl) for r in records],
        "latencies": [r.latency for r in records],
        "start_times": [r.start_time for r in records],
        "queue_times": [r.queue_time for r in records],
        "errors": [r.error for r in records],
    } | ({"request_classes": [r.request_class for r in records]}
         if any(r.request_class for r in records) else {})
