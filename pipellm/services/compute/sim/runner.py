"""`SimRunner`: the ModelRunner interface (`capacity`, `execute(step)`) with no model behind it:
no weights, no KV tensors, no torch. A step costs what the roofline `CostModel` says, slept in
real time or added to a `VirtualClock`. Tokens are a deterministic hash of (request seed, output
index) that is never a stop id, so an output runs to max_tokens unless `eos_at` ends it (with
the request's lowest stop id) first; logprobs are 0.0.
"""

from __future__ import annotations

import logging
import time

from pipellm.services.compute.core.step import ScheduledStep, StepSample, Work
from pipellm.services.compute.inflight import Done
from pipellm.services.compute.sim.cost import CostModel, kv_dtype_bytes
from pipellm.shared.config import EngineConfig, KVPolicyName
from pipellm.shared.model_config import ModelConfig

log = logging.getLogger(__name__)
_MASK = 2**64 - 1


class VirtualClock:
    """Simulated seconds; steps advance it by their modelled time."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def token_id(seed: int, index: int, vocab: int) -> int:
    """splitmix64(seed, index) mod vocab: deterministic, uniform enough, cheap in Python."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) % vocab


def cost_model(config: EngineConfig) -> CostModel:
    # the kernels read pages through a block table
    paged = config.scheduler.kv_policy == KVPolicyName.PAGED
    return CostModel(config.sim.gpu, config.sim.model, kv_dtype_bytes(config.sim.kv_dtype),
                     config.sim.eff_bw, config.sim.eff_flops, config.sim.overhead_ms / 1e3,
                     config.sim.weight_dtype,
                     kv_read_factor=config.sim.paged_attn_slowdown if paged else 1.0)


class SimRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.model_config, self.max_model_len = model_config, max_model_len
        self.cost = cost_model(config)
        self.capacity = (config.kv_cache_tokens if config.kv_cache_tokens > 0
                         else self.cost.kv_capacity_tokens(config.gpu_memory_utilization))
        self.vocab = model_config.vocab_size
        self.never = frozenset(model_config.eos_token_ids) | (
            {model_config.bos_token_id} if model_config.bos_token_id is not None else set())
        if len(self.never) >= self.vocab:
            raise ValueError("the vocabulary has no token left that is not EOS/BOS")
        self.clock = VirtualClock() if config.sim.clock == "virtual" else None
        self.eos_at: dict[str, int] = {}  # request id -> output length that ends with EOS
        self.busy_s = 0.0  # modelled GPU time, all steps
        self.steps = 0
        self._last_end: float | None = None
        self.summary = {"device": f"simulated {self.cost.gpu.name}",
                        "dtype": f"{config.sim.weight_dtype} ({self.cost.model.name})",
                        "kv_gib": round(self.capacity * self.cost.kv_bytes_per_token / 2**30, 3)}
        log.info("simulated %s on %s: KV cache %d slots (%s KV, %d B/token), %s clock",
                 self.cost.model.name, self.cost.gpu.name, self.capacity, config.sim.kv_dtype,
                 self.cost.kv_bytes_per_token, config.sim.clock)

    def step_time(self, step: ScheduledStep) -> float:
        return self.cost.step_time(
            [c + 1 for item in step.items if item.kind is not Work.PREFILL
             for _, _, c in item.decode_rows()],
            [(item.tokens, item.seq.num_cached) for item in step.of(Work.PREFILL)],
            len(step.sampled), sum(n for _, _, n in step.moves))

    asynchronous = False  # a step's modelled time has passed when launch returns
    simulated = True
    scores_tokens = False  # its records carry no log-probabilities (beam search needs them)

    def launch(self, step: ScheduledStep, prev=None) -> Done:
        """Token ids for step.sampled (logprobs 0, none of the extras), after the modelled time
        has passed. They depend on no token's value: `prev`'s are not needed."""
        dt = self.step_time(step)
        self.busy_s += dt
        self.steps += 1
        if self.clock is not None:
            self.clock.advance(dt)
        else:
            self._sleep(dt)
        vocab, never, eos_at, out = self.vocab, self.never, self.eos_at, []
        for s in step.sampled:
            if eos_at and eos_at.get(s.request_id) == s.num_output + 1 and s.stop_ids:
                out.append(min(s.stop_ids))
                continue
            tok = token_id(s.seed, s.num_output, vocab)
            while tok in never or tok in s.stop_ids:
                tok = (tok + 1) % vocab
            out.append(tok)
        return Done(StepSample.of(step, out))

    def _sleep(self, dt: float) -> None:
        """Sleep the step's modelled time, less the host time the loop already spent since the
        last step (scheduling, sending outputs) up to the modelled overhead: the overhead is
        that host time, so a step lasts roofline + max(overhead, host time)."""
        now = time.perf_counter()
        spent = 0.0 if self._last_end is None else min(now - self._last_end,
                                                        self.cost.overhead_s)
        if dt - spent > 0:
            time.sleep(dt - spent)
        self._last_end = time.perf_counter()
