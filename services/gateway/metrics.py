"""Prometheus metrics: latencies the gateway observes, engine gauges compute reports via Redis."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

# engine stats (compute -> Redis) exported as gauges and counters
_GAUGES = {"running": "requests in the running batch", "waiting": "requests waiting for KV",
           "capacity": "KV cache slots", "reserved": "KV slots reserved by running requests",
           "used": "KV slots holding tokens"}
_COUNTERS = {"moves": "KV segments moved to grow", "preemptions": "requests preempted",
             "grows_in_place": "KV segments grown in place"}
_PREFIX_COUNTERS = {"queries": "prompt tokens looked up in the prefix cache",
                    "hits": "prompt tokens whose KV the prefix cache gave",
                    "evictions": "prefix cache entries evicted"}


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pipellm_time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("pipellm_inter_token_latency_seconds", "time between tokens",
                             buckets=_ITL, registry=r)
        self.e2e = Histogram("pipellm_e2e_request_latency_seconds", "request latency",
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("pipellm_request_queue_time_seconds",
                               "arrival to admission into the running batch",
                               buckets=_LATENCY, registry=r)
        self.requests = Counter("pipellm_requests", "finished requests by outcome",
                                ["outcome"], registry=r)
        self.tokens = Counter("pipellm_generation_tokens", "generated tokens", registry=r)
        self.engine: dict[str, str] = {}  # latest pipellm:stats hash
        r.register(_EngineCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        stats = self.metrics.engine
        for name, doc in _GAUGES.items():
            g = GaugeMetricFamily(f"pipellm_kv_{name}" if name in ("capacity", "reserved", "used")
                                  else f"pipellm_num_requests_{name}", doc)
            g.add_metric([], float(stats.get(name, 0) or 0))
            yield g
        cap = float(stats.get("capacity", 0) or 0)
        usage = GaugeMetricFamily("pipellm_kv_usage_ratio", "reserved / capacity of the KV cache")
        usage.add_metric([], float(stats.get("reserved", 0) or 0) / cap if cap else 0.0)
        yield usage
        for name, doc in _COUNTERS.items():
            yield _counter(f"pipellm_kv_{name}", doc, stats.get(name))
        yield from _prefix_cache(stats)
        yield from _speculative(stats)


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], float(value or 0))
    return c


def _prefix_cache(stats: dict[str, str]):
    """The prefix cache's counters (tokens, as vLLM's), its hit rate and the tokens it holds."""
    for name, doc in _PREFIX_COUNTERS.items():
        yield _counter(f"pipellm_prefix_cache_{name}", doc, stats.get(f"prefix_{name}"))
    queries = float(stats.get("prefix_queries", 0) or 0)
    rate = GaugeMetricFamily("pipellm_prefix_cache_hit_rate", "prefix cache hits / queries, "
                             "in prompt tokens, since start")
    rate.add_metric([], float(stats.get("prefix_hits", 0) or 0) / queries if queries else 0.0)
    yield rate
    cached = GaugeMetricFamily("pipellm_prefix_cache_cached_tokens",
                               "KV slots the prefix cache holds (free for admission)")
    cached.add_metric([], float(stats.get("prefix_cached", 0) or 0))
    yield cached


def _speculative(stats: dict[str, str]):
    """Speculative decoding under vLLM's names: drafts verified, drafts accepted (counters)
    and their ratio since start."""
    drafts = float(stats.get("spec_draft_tokens", 0) or 0)
    yield _counter("vllm:spec_decode_num_draft_tokens", "speculative draft tokens verified",
                   drafts)
    yield _counter("vllm:spec_decode_num_accepted_tokens", "speculative draft tokens accepted",
                   stats.get("spec_accepted_tokens"))
    rate = GaugeMetricFamily("vllm:spec_decode_draft_acceptance_rate",
                             "accepted / verified draft tokens since start")
    rate.add_metric([], float(stats.get("spec_accepted_tokens", 0) or 0) / drafts
                    if drafts else 0.0)
    yield rate
