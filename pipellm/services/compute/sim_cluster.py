"""N simulated replicas behind one router, on one virtual timeline.

Each replica is an `LLMEngine` on the sim backend with its own `VirtualClock`. Time runs in
order: `add(t, ...)` once no replica has a step left to start before t, else `step()` runs the
replica whose clock is earliest, so a step's scheduling sees every request that arrived by its
start. A replica's `demand` is kept from each request's prompt + predicted median at arrival.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipellm.services.compute.engine import LLMEngine, StepResult, prefill_backlog
from pipellm.shared.config import BackendName, EngineConfig
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.routing import ReplicaLoad, RouteInfo, RoutingPolicy
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.settings import with_settings


def engine_demand(engine: LLMEngine) -> int:
    """Predicted KV tokens of the requests `engine` holds, as the engine counts them."""
    return engine.scheduler.demand()


@dataclass
class Replica:
    engine: LLMEngine
    demand: int = 0  # == engine_demand(engine) while no request outgrows its predicted median
    held: dict[str, int] = field(default_factory=dict)  # request id -> what it adds to demand
    routed: int = 0  # requests sent here

    @property
    def clock(self):
        return self.engine.runner.clock

    def load(self) -> ReplicaLoad:
        s = self.engine.scheduler
        return ReplicaLoad(demand=self.demand, running=len(s.running), waiting=len(s.waiting),
                           prefill=prefill_backlog(s), capacity=self.engine.kv.capacity,
                           step_tokens=self.engine.config.scheduler.max_batched_tokens)

    def add(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
            predicted: LengthDist | int | None, priority: int = 0) -> None:
        self.engine.add_request(prompt_ids, params, request_id, predicted, priority=priority)
        seq = self.engine.requests[request_id]
        self.held[request_id] = seq.num_prompt + seq.predicted_length.median
        self.demand += self.held[request_id]
        self.routed += 1

    def finished(self, request_id: str) -> None:
        self.demand -= self.held.pop(request_id)
        self.engine.runner.eos_at.pop(request_id, None)


class SimCluster:
    """`replicas` sim engines of `config` (each its own modelled GPU), routed by `policy`."""

    def __init__(self, config: EngineConfig, replicas: int, policy: RoutingPolicy):
        from pipellm.services.compute.backend import build_engine

        if replicas < 1:
            raise ValueError("need at least one replica")
        config = with_settings(config, backend=BackendName.SIM, sim_clock="virtual")
        self.replicas = [Replica(build_engine(config)) for _ in range(replicas)]
        self.policy = policy

    def loads(self) -> list[ReplicaLoad]:
        return [r.load() for r in self.replicas]

    def add(self, now: float, prompt_ids: list[int], params: SamplingParams, request_id: str,
            predicted: LengthDist | int | None = None, eos_at: int | None = None,
            priority: int = 0) -> int:
        """Route a request arriving at `now` and queue it at the chosen replica; its index.
        `predicted`: its predicted output length (None: --default-predicted-len); `eos_at`: its
        true output length, ended with EOS (None: it runs to max_tokens); `priority`: the
        request's (lower first), at whichever replica serves it. InvalidParams from the
        engine propagates (the router has recorded the prompt by then)."""
        if predicted is None:
            predicted = self.replicas[0].engine.config.default_predicted_len
        tokens = len(prompt_ids) + (predicted.median if isinstance(predicted, LengthDist)
                                    else int(predicted))
        i = self.policy.choose(RouteInfo(tuple(prompt_ids), tokens), self.loads())
        replica = self.replicas[i]
        if not replica.engine.has_work():  # idle: its timeline resumes at this arrival
            replica.clock.now = max(replica.clock.now, now)
        replica.add(prompt_ids, params, request_id, predicted, priority)
        if eos_at is not None and eos_at < params.max_tokens:
            replica.engine.runner.eos_at[request_id] = eos_at
        return i

    def has_work(self) -> bool:
        return any(r.engine.has_work() for r in self.replicas)

    def next_step(self) -> float:
        """When the earliest step left to run starts (inf: every replica is idle)."""
        return min((r.clock.now for r in self.replicas if r.engine.has_work()), default=math.inf)

    def step(self, next_arrival: float = math.inf) -> tuple[int, float, StepResult]:
        """Run one step of the replica whose step starts first: (its index, the step's start,
        its result); the step ends at that replica's clock. A replica that can schedule nothing
        waits for `next_arrival` (RuntimeError if none is coming)."""
        i = min((j for j, r in enumerate(self.replicas) if r.engine.has_work()),
                key=lambda j: self.replicas[j].clock.now)
        replica = self.replicas[i]
        before = replica.clock.now
        result = replica.engine.step()
        for e in result.outputs:
            if e.finish_reason is not None:
                replica.finished(e.request_id)
        if replica.clock.now == before and not result.outputs:
            if math.isinf(next_arrival):
                raise RuntimeError(f"replica {i} has work but cannot schedule any of it")
            replica.clock.now = max(replica.clock.now, next_arrival)
        return i, before, result

    def stats(self) -> dict:
        """Counters summed over the replicas, and the requests routed to each."""
        engines = [r.engine.stats() for r in self.replicas]
        return {"prefix_queries": sum(s.prefix_queries for s in engines),
                "prefix_hits": sum(s.prefix_hits for s in engines),
                "preemptions": sum(s.preemptions for s in engines),
                "busy_s": [r.engine.runner.busy_s for r in self.replicas],
                "routed": [r.routed for r in self.replicas]}
