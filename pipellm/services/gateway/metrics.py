"""Prometheus metrics: latencies the gateway observes, engine gauges compute reports via Redis.

Every figure is exported under pipellm's name and, where vLLM has one, under vLLM's (with its
`model_name` label): routers and the Kubernetes inference gateway (its model-server protocol:
`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
`vllm:cache_config_info`) read those. With several compute processes (--data-parallel-size)
the engine figures are summed over them, and vLLM's gauges also come per engine (`engine`
label, as vLLM's data parallelism exports them).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# the token granularity routers' prefix scorers should hash prompts in: pipellm's prefix cache
# matches any number of tokens, so any block size is exact; 16 is vLLM's default
BLOCK_SIZE = 16
PRIORITY_SERIES = 32  # distinct priorities with their own series (ByPriority); then "other"

# engine stats (compute -> Redis) exported as gauges and counters
_GAUGES = {"running": "requests in the running batch", "waiting": "requests waiting for KV",
           "capacity": "KV cache slots", "reserved": "KV slots reserved by running requests",
           "used": "KV slots holding tokens"}
_COUNTERS = {"moves": "KV segments moved to grow", "preemptions": "requests preempted",
             "grows_in_place": "KV segments grown in place"}
_PREFIX_COUNTERS = {"queries": "prompt tokens looked up in the prefix cache",
                    "hits": "prompt tokens whose KV the prefix cache gave",
                    "evictions": "prefix cache entries evicted"}
_PER_ENGINE = {"requests": "requests a compute process took", "tokens": "output tokens a "
               "compute process generated", "demand": "predicted KV tokens of the requests a "
               "compute process holds (what --data-parallel-routing balances)"}
_SUMMED = (*_GAUGES, *_COUNTERS, *(f"prefix_{n}" for n in _PREFIX_COUNTERS), "prefix_cached",
           "spec_draft_tokens", "spec_accepted_tokens", *_PER_ENGINE)


class _Twin:
    """One observation under two names: pipellm's metric and vLLM's."""

    def __init__(self, *metrics):
        self.metrics = metrics

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)

    def inc(self, amount: float = 1) -> None:
        for m in self.metrics:
            m.inc(amount)


class ByPriority:
    """A latency histogram per request priority (--scheduling-policy priority or predicted:
    what the order buys each class), labelled `priority`. The first PRIORITY_SERIES distinct
    priorities get their own series, later ones share "other" (bounded cardinality)."""

    def __init__(self, name: str, doc: str, buckets, registry: CollectorRegistry):
        self.histogram = Histogram(name, doc, ["priority"], buckets=buckets, registry=registry)
        self.seen: set[int] = set()

    def observe(self, priority: int, value: float) -> None:
        self.histogram.labels(self.label(priority)).observe(value)

    def label(self, priority: int) -> str:
        if priority not in self.seen:
            if len(self.seen) >= PRIORITY_SERIES:
                return "other"
            self.seen.add(priority)
        return str(priority)


class Metrics:
    def __init__(self, model_name: str = ""):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets) -> _Twin:
            return _Twin(Histogram(f"pipellm_{name}", doc, buckets=buckets, registry=r),
                         Histogram(f"vllm:{name}", doc, ["model_name"], buckets=buckets,
                                   registry=r).labels(model_name))

        self.ttft = histogram("time_to_first_token_seconds", "time to first token", _LATENCY)
        self.itl = histogram("inter_token_latency_seconds", "time between tokens", _ITL)
        self.e2e = histogram("e2e_request_latency_seconds", "request latency", _LATENCY)
        self.queue = histogram("request_queue_time_seconds",
                               "arrival to admission into the running batch", _LATENCY)
        self.ttft_by_priority = ByPriority("pipellm_time_to_first_token_by_priority_seconds",
                                           "time to first token, per request priority",
                                           _LATENCY, r)
        self.queue_by_priority = ByPriority(
            "pipellm_request_queue_time_by_priority_seconds",
            "arrival to admission into the running batch, per request priority", _LATENCY, r)
        self.requests = Counter("pipellm_requests", "finished requests by outcome",
                                ["outcome"], registry=r)
        self.tokens = _Twin(
            Counter("pipellm_generation_tokens", "generated tokens", registry=r),
            Counter("vllm:generation_tokens", "generated tokens", ["model_name"],
                    registry=r).labels(model_name))
        self.engines: list[dict[str, str]] = []  # the pipellm:stats hash of each compute
        r.register(_EngineCollector(self))

    @property
    def engine(self) -> dict[str, str]:
        """The engines' stats: counts summed over them, the rest as the first one has it."""
        return merge_stats(self.engines)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def merge_stats(engines: list[dict[str, str]]) -> dict[str, str]:
    out = dict(engines[0]) if engines else {}
    for key in _SUMMED:
        out[key] = str(sum(_num(e.get(key)) for e in engines))
    return out


def _num(value) -> float:
    try:
        return float(value or 0)
    except ValueError:
        return 0.0


class _EngineCollector:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        stats = self.metrics.engine
        for name, doc in _GAUGES.items():
            g = GaugeMetricFamily(f"pipellm_kv_{name}" if name in ("capacity", "reserved", "used")
                                  else f"pipellm_num_requests_{name}", doc)
            g.add_metric([], _num(stats.get(name)))
            yield g
        usage = GaugeMetricFamily("pipellm_kv_usage_ratio", "reserved / capacity of the KV cache")
        usage.add_metric([], _usage(stats))
        yield usage
        for name, doc in _COUNTERS.items():
            yield _counter(f"pipellm_kv_{name}", doc, stats.get(name))
        yield from _prefix_cache(stats)
        yield from _vllm(self.metrics.engines, stats, self.metrics.model_name)
        yield from _per_engine(self.metrics.engines)
        yield from _speculative(stats)


def _usage(stats: dict[str, str]) -> float:
    cap = _num(stats.get("capacity"))
    return _num(stats.get("reserved")) / cap if cap else 0.0


def _counter(name: str, doc: str, value, labels: dict[str, str] | None = None):
    c = CounterMetricFamily(name, doc, labels=list(labels or {}))
    c.add_metric(list((labels or {}).values()), _num(value))
    return c


def _vllm(engines: list[dict[str, str]], stats: dict[str, str], model: str):
    """vLLM's engine gauges (totals and per engine), cache config and counters."""
    per_engine = [("vllm:num_requests_running", "requests in the running batch",
                   lambda s: _num(s.get("running"))),
                  ("vllm:num_requests_waiting", "requests waiting to be scheduled",
                   lambda s: _num(s.get("waiting"))),
                  ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full): reserved slots",
                   _usage)]
    for name, doc, value in per_engine:
        g = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
        for e in engines:
            g.add_metric([model, e.get("rank", "0")], value(e))
        yield g
    info = GaugeMetricFamily("vllm:cache_config_info", "the KV cache's configuration (value 1)",
                             labels=["block_size", "num_gpu_blocks", "cache_dtype",
                                     "enable_prefix_caching"])
    info.add_metric([str(BLOCK_SIZE), str(int(_num(stats.get("capacity"))) // BLOCK_SIZE),
                     stats.get("kv_dtype", "auto"), stats.get("enable_prefix_caching", "")],
                    1.0)
    yield info
    labels = {"model_name": model}
    yield _counter("vllm:num_preemptions", "requests preempted", stats.get("preemptions"),
                   labels)
    yield _counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                   stats.get("prefix_queries"), labels)
    yield _counter("vllm:prefix_cache_hits", "prompt tokens whose KV the prefix cache gave",
                   stats.get("prefix_hits"), labels)
    yield from _lora_info(engines)


def _lora_info(engines: list[dict[str, str]]):
    """vLLM's vllm:lora_requests_info (with --enable-lora): the adapters of the running and of
    the waiting requests over all engines, as labels; the value is the time it was taken."""
    if not any("max_lora" in e for e in engines):
        return
    info = GaugeMetricFamily("vllm:lora_requests_info", "running and waiting LoRA adapters",
                             labels=["max_lora", "running_lora_adapters",
                                     "waiting_lora_adapters"])

    def union(key: str) -> str:
        return ",".join(sorted({n for e in engines for n in e.get(key, "").split(",") if n}))

    max_lora = max(int(_num(e.get("max_lora"))) for e in engines)
    info.add_metric([str(max_lora), union("lora_running"),
                     union("lora_waiting")], time.time())
    yield info


def _per_engine(engines: list[dict[str, str]]):
    """Each compute process's requests and tokens (counters) and predicted demand."""
    for name, doc in _PER_ENGINE.items():
        family = GaugeMetricFamily if name == "demand" else CounterMetricFamily
        m = family(f"pipellm_engine_{name}", doc, labels=["engine"])
        for e in engines:
            m.add_metric([e.get("rank", "0")], _num(e.get(name)))
        yield m


def _prefix_cache(stats: dict[str, str]):
    """The prefix cache's counters (tokens, as vLLM's), its hit rate and the tokens it holds."""
    for name, doc in _PREFIX_COUNTERS.items():
        yield _counter(f"pipellm_prefix_cache_{name}", doc, stats.get(f"prefix_{name}"))
    queries = _num(stats.get("prefix_queries"))
    rate = GaugeMetricFamily("pipellm_prefix_cache_hit_rate", "prefix cache hits / queries, "
                             "in prompt tokens, since start")
    rate.add_metric([], _num(stats.get("prefix_hits")) / queries if queries else 0.0)
    yield rate
    cached = GaugeMetricFamily("pipellm_prefix_cache_cached_tokens",
                               "KV slots the prefix cache holds (free for admission)")
    cached.add_metric([], _num(stats.get("prefix_cached")))
    yield cached


def _speculative(stats: dict[str, str]):
    """Speculative decoding under vLLM's names: drafts verified, drafts accepted (counters)
    and their ratio since start."""
    drafts = _num(stats.get("spec_draft_tokens"))
    yield _counter("vllm:spec_decode_num_draft_tokens", "speculative draft tokens verified",
                   drafts)
    yield _counter("vllm:spec_decode_num_accepted_tokens", "speculative draft tokens accepted",
                   stats.get("spec_accepted_tokens"))
    rate = GaugeMetricFamily("vllm:spec_decode_draft_acceptance_rate",
                             "accepted / verified draft tokens since start")
    rate.add_metric([], _num(stats.get("spec_accepted_tokens")) / drafts if drafts else 0.0)
    yield rate
