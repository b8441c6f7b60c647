"""The scheduler's settings, checked once at start-up (see scheduler.py for what they mean)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.compute.kv.allocator import KVAllocator
from services.compute.scheduling.admission import AggregatePeak, FuturePeak
from services.compute.scheduling.kv_policy import KVPolicy, make_policy

BATCHING = ("merged", "static")
PEAK_CHECKS = {"peak": FuturePeak, "aggregate": AggregatePeak}
AUTO_PEAK = "aggregate"  # what auto admission means under a policy that plans the future peak
ADMISSION = ("auto", "peak", "aggregate", "fit")


@dataclass(frozen=True)
class SchedulerConfig:
    max_batched_tokens: int = 512  # tokens per step (decodes + prefill chunks)
    max_running: int = 256
    kv_policy: str = "predicted"  # see scheduler.py and kv_policy.py
    kv_min_grow: int = 16  # a segment that runs out grows by at least this many slots
    batching: str = "merged"
    reserve_quantile: float = 0.5
    grow_quantile: float = 0.9
    peak_quantile: float = 0.9
    reserve_horizon: int = 64  # predicted: reserve at most this many output slots ahead (0: all)
    admission: str = "auto"  # peak | aggregate | fit | auto (AUTO_PEAK for predicted, else fit)
    prefix_caching: bool = False
    policy: KVPolicy = field(init=False, repr=False, compare=False)  # built from the above

    def __post_init__(self):
        object.__setattr__(self, "policy", make_policy(
            self.kv_policy, reserve_quantile=self.reserve_quantile,
            grow_quantile=self.grow_quantile, horizon=self.reserve_horizon,
            min_grow=self.kv_min_grow))
        if self.admission not in ADMISSION:
            raise ValueError(f"--kv-admission must be one of {ADMISSION}, not {self.admission!r}")
        if self.prefix_caching and not isinstance(self.policy.allocator(1), KVAllocator):
            raise ValueError(f"--enable-prefix-caching needs contiguous segments; the "
                             f"{self.kv_policy} KV policy has none")
        if self.batching not in BATCHING:
            raise ValueError(f"--batching must be one of {BATCHING}, not {self.batching!r}")
        if not 1 <= self.max_running <= self.max_batched_tokens:
            raise ValueError("need 1 <= max_running <= max_batched_tokens")
        for q in (self.reserve_quantile, self.grow_quantile, self.peak_quantile):
            if not 0 < q <= 1:
                raise ValueError("quantiles must be in (0, 1]")

    @classmethod
    def of(cls, config) -> SchedulerConfig:
        """The scheduler's part of an EngineConfig (ValueError if inconsistent)."""
        return cls(config.max_batched_tokens, config.max_running, config.kv_policy,
                   config.kv_min_grow, config.batching, config.kv_reserve_quantile,
                   config.kv_grow_quantile, config.kv_peak_quantile, config.kv_reserve_horizon,
                   config.kv_admission, config.enable_prefix_caching)

    @property
    def peak_check(self) -> type[FuturePeak] | type[AggregatePeak] | None:
        """The future-peak estimator admission consults (None: admit whatever fits now)."""
        admission = self.admission
        if admission == "auto":
            admission = AUTO_PEAK if self.policy.peak_admission else "fit"
        return PEAK_CHECKS.get(admission)
