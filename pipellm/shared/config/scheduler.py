"""The scheduler's settings."""

from __future__ import annotations

from dataclasses import dataclass

from pipellm.shared.config.choices import (
    SCHEDULING,
    Admission,
    Batching,
    KVPolicyName,
    SchedulingPolicyName,
    parse_choice,
)
from pipellm.shared.settings import setting
from pipellm.shared.speculative import SpeculativeConfig


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's settings (pipellm/services/compute/scheduling/scheduler.py says what they
    mean). `EngineConfig.scheduler`, flat: the flags keep their names (`--max-running`)."""

    max_batched_tokens: int = setting(512, "tokens per merged prefill+decode step; by device: "
                                      "512 on a CPU, on a GPU vLLM's (8192 with 70 GiB or "
                                      "more, else 2048)", group=SCHEDULING,
                                      alias="max-num-batched-tokens", by_device=True)
    max_running: int = setting(256, "requests in the running batch; by device: 256, or 1024 "
                               "on a GPU with 70 GiB or more (vLLM's)", group=SCHEDULING,
                               alias="max-num-seqs", by_device=True)
    kv_policy: KVPolicyName = setting(KVPolicyName.PREDICTED, "KV segment per request sized "
                                      "by: predicted (its predicted output length), max "
                                      "(max_tokens) or paged (sim only)", group=SCHEDULING)
    kv_min_grow: int = setting(16, "minimum growth of a KV segment that ran out",
                               group=SCHEDULING)
    kv_reserve_quantile: float = setting(0.5, "predicted: a new segment holds this quantile of "
                                         "the output length", group=SCHEDULING)
    kv_grow_quantile: float = setting(0.9, "predicted: an outgrown segment regrows to this "
                                      "quantile, given the output so far", group=SCHEDULING)
    kv_peak_quantile: float = setting(0.9, "predicted: admission keeps the future KV peak at "
                                      "this quantile in memory", group=SCHEDULING)
    kv_reserve_horizon: int = setting(64, "predicted: reserve at most this many output slots "
                                      "ahead; 0: the whole quantile", group=SCHEDULING)
    kv_admission: Admission = setting(Admission.AUTO, "peak (the future KV peak, each request "
                                      "at its --kv-peak-quantile, must fit), aggregate (that "
                                      "quantile of the total future KV demand must fit), fit "
                                      "(the reservation must) or auto (aggregate with "
                                      "--kv-policy predicted)", group=SCHEDULING)
    enable_prefix_caching: bool = setting(False, "keep finished requests' KV cached (evicted "
                                          "least recently used when memory is needed); a "
                                          "prompt starting with a cached prefix copies its KV "
                                          "instead of recomputing it", group=SCHEDULING)
    batching: Batching = setting(Batching.MERGED, "merged (dynamic, merged steps) or static "
                                 "(a baseline)", group=SCHEDULING)
    scheduling_policy: SchedulingPolicyName = setting(
        SchedulingPolicyName.FCFS, "fcfs (arrival order), priority (a request's priority, lower "
        "first, then arrival; vLLM's) or predicted (priority, then the shortest predicted "
        "remaining work, aged so that no request waits past --max-queue-delay-ms); under "
        "priority and predicted a more urgent waiting request preempts the least urgent "
        "running one when KV or --max-running binds", group=SCHEDULING)
    max_queue_delay_ms: float = setting(
        30000.0, "predicted: a waiting request's aging bound; once it has waited this long it "
        "goes before every request younger than it (below the queueing delay of a load, the "
        "policy is FCFS there)", group=SCHEDULING)
    max_queue_delay_factor: float = setting(
        0.0, "predicted: a waiting request's aging bound is also at most this multiple of its "
        "own predicted service time (its prefill chunks plus its predicted output tokens, one "
        "step each, at the measured step time): overdue requests go first, earliest deadline "
        "first; 0: --max-queue-delay-ms alone", group=SCHEDULING)
    speculative_config: str | None = setting(
        None, "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}' "
        "(drafts by prompt lookup, verified in one step; turns the overlap schedule off), or "
        "a draft model: '{\"model\": PATH, \"num_speculative_tokens\": 4}'",
        group=SCHEDULING)

    def __post_init__(self):
        # the one place the choices are checked; a value is the enum or its text, equal to
        # each other (str-valued enums): compare with ==, never `is`
        for name, choices in (("kv_policy", KVPolicyName), ("kv_admission", Admission),
                              ("batching", Batching),
                              ("scheduling_policy", SchedulingPolicyName)):
            parse_choice(name, choices, getattr(self, name))
        if self.enable_prefix_caching and self.kv_policy == KVPolicyName.PAGED:
            raise ValueError(f"--enable-prefix-caching needs contiguous segments; the "
                             f"{self.kv_policy} KV policy has none")
        if not 1 <= self.max_running <= self.max_batched_tokens:
            raise ValueError("need 1 <= max_running <= max_batched_tokens")
        if not self.max_queue_delay_ms > 0:
            raise ValueError("--max-queue-delay-ms must be > 0")
        if not self.max_queue_delay_factor >= 0:
            raise ValueError("--max-queue-delay-factor must be >= 0")
        for q in (self.kv_reserve_quantile, self.kv_grow_quantile, self.kv_peak_quantile):
            if not 0 < q <= 1:
                raise ValueError("quantiles must be in (0, 1]")
        self.speculative  # noqa: B018  (a malformed --speculative-config fails at start-up)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """--speculative-config, parsed (None: no speculation)."""
        return SpeculativeConfig.parse(self.speculative_config)


def step_budget(device: str, memory_gib: float = 0.0, name: str = "") -> dict[str, int]:
    """The step budget a command line that sets neither --max-batched-tokens nor
    --max-running gets on `device` ("cpu" or "cuda"; a GPU's memory and name): on a CPU the
    fields' defaults; on a GPU vLLM's serving defaults (an A100 takes the smaller pair, as
    vLLM's measurements found more to be slower there)."""
    if device != "cuda":
        return {"max_batched_tokens": SchedulerConfig.max_batched_tokens,
                "max_running": SchedulerConfig.max_running}
    if memory_gib >= 70 and "a100" not in name.lower():
        return {"max_batched_tokens": 8192, "max_running": 1024}
    return {"max_batched_tokens": 2048, "max_running": 256}
