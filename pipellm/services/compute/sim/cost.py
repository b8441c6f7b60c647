"""Roofline cost model of one merged engine step on one GPU.

    step time = max(bytes / (bandwidth * eff_bw), compute time) + overhead
    compute time = linear FLOPs / (weight-dtype peak * eff_flops)
                   + (LM-head + attention FLOPs) / (bf16 peak * eff_flops)

Bytes are the weights read once per step (the LM head only when a row samples; of a MoE layer,
the experts its tokens route to), the KV read and written, and KV moves; FLOPs the matmuls of
the step's tokens, the LM head of its sampled rows and causal attention. What each term counts,
and why: docs/architecture.md, "The simulator's cost model". `fit_decode` fits eff_bw and
overhead_s to measured decode step times.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipellm.services.compute.sim.hardware import GiB, GpuSpec, ModelSpec, gpu, model
from pipellm.shared.config import SimConfig

# int8: one byte and a 2-byte scale per 8 values (pipellm/kernels/kv_quant.KV_GROUP; a test checks
# it)
KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "int8": 1.25, "fp8": 1}
WEIGHT_DTYPE_BYTES = {"bf16": 2.0, "fp16": 2.0, "int8": 1.0, "fp8": 1.0, "int4": 0.5 + 4 / 128}
_SIM = SimConfig()  # the defaults of --sim-eff-bw, --sim-eff-flops, --sim-overhead-ms
DEFAULT_EFF_BW, DEFAULT_EFF_FLOPS = _SIM.eff_bw, _SIM.eff_flops
DEFAULT_OVERHEAD_S = _SIM.overhead_ms / 1e3
DEFAULT_RESERVE_BYTES = 2 * GiB  # activations, logits, CUDA context (the real runner's headroom)


def kv_dtype_bytes(name: str) -> float:
    try:
        return KV_DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r}; choices: {', '.join(KV_DTYPE_BYTES)}"
                         ) from None


@dataclass(frozen=True)
class StepCost:
    weight_bytes: float
    kv_bytes: float  # read + written (+ moved)
    flops: float
    mem_s: float  # bytes / effective bandwidth
    compute_s: float  # FLOPs / effective peak
    overhead_s: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def time_s(self) -> float:
        return max(self.mem_s, self.compute_s) + self.overhead_s

    @property
    def bound(self) -> str:
        return "memory" if self.mem_s >= self.compute_s else "compute"


class CostModel:
    """Step times of `model` on `gpu` (specs or names). See the module docstring."""

    def __init__(self, gpu_spec: GpuSpec | str, model_spec: ModelSpec | str,
                 kv_dtype_bytes: float = 2, eff_bw: float = DEFAULT_EFF_BW,
                 eff_flops: float = DEFAULT_EFF_FLOPS, overhead_s: float = DEFAULT_OVERHEAD_S,
                 weight_dtype: str = "bf16", kv_read_factor: float = 1.0):
        self.gpu = gpu(gpu_spec) if isinstance(gpu_spec, str) else gpu_spec
        self.model = model(model_spec) if isinstance(model_spec, str) else model_spec
        if not (0 < eff_bw <= 1 and 0 < eff_flops <= 1):
            raise ValueError("efficiency factors must be in (0, 1]")
        if overhead_s < 0:
            raise ValueError("overhead must be >= 0")
        if weight_dtype not in WEIGHT_DTYPE_BYTES:
            raise ValueError(f"unknown weight dtype {weight_dtype!r}; choices: "
                             f"{', '.join(WEIGHT_DTYPE_BYTES)}")
        if kv_read_factor <= 0:
            raise ValueError("kv_read_factor must be > 0")
        self.kv_dtype_bytes, self.weight_dtype = kv_dtype_bytes, weight_dtype
        self.kv_read_factor = kv_read_factor
        self.eff_bw, self.eff_flops, self.overhead_s = eff_bw, eff_flops, overhead_s
        m, wb = self.model, WEIGHT_DTYPE_BYTES[weight_dtype]
        self.kv_bytes_per_token = m.kv_elems_per_token * kv_dtype_bytes
        # resident decoder layers (every expert); a step reads all of them only if dense
        self.body_bytes = m.linear_params * wb + m.small_params * 2 + m.router_params * 2
        self.expert_bytes = m.expert_params * wb  # one expert of one sparse layer
        # read by every step: all but the experts (= body_bytes if dense)
        self.dense_bytes = self.body_bytes - m.sparse_layers * m.num_experts * self.expert_bytes
        self.head_bytes = m.lm_head_params * 2  # read by steps that sample
        self.resident_weight_bytes = (self.body_bytes + m.embed_params * 2
                                      + (0 if m.tie_embeddings else self.head_bytes))
        self._bw = self.gpu.bandwidth * eff_bw
        self._linear_flops = self.gpu.peak_flops(weight_dtype) * eff_flops
        self._bf16_flops = self.gpu.bf16_flops * eff_flops
        self._pair_flops = 4 * m.layers * m.heads * m.head_dim  # per (query, key) pair

    # -- one step -------------------------------------------------------------------------
    def cost(self, decode_ctx: Sequence[int] = (), prefills: Iterable[tuple[int, int]] = (),
             num_sampled: int | None = None, moved_tokens: int = 0) -> StepCost:
        """Cost of a step with decode tokens at contexts `decode_ctx` (tokens attended,
        itself included) and prefill chunks `(q_len, cached ctx before the chunk)`; by default
        every decode and every chunk samples."""
        n_dec, dec_sum = len(decode_ctx), sum(decode_ctx)
        n_pre = pre_tokens = pre_read = pre_pairs = 0
        for q, ctx in prefills:
            n_pre += 1
            pre_tokens += q
            pre_read += ctx + q
            pre_pairs += q * ctx + q * (q + 1) // 2
        sampled = n_dec + n_pre if num_sampled is None else num_sampled
        return self._cost(n_dec + pre_tokens, sampled, dec_sum + pre_read, dec_sum + pre_pairs,
                          moved_tokens)

    def step_time(self, decode_ctx: Sequence[int] = (),
                  prefills: Iterable[tuple[int, int]] = (), num_sampled: int | None = None,
                  moved_tokens: int = 0) -> float:
        """Seconds for one step (see `cost`)."""
        return self.cost(decode_ctx, prefills, num_sampled, moved_tokens).time_s

    def touched_experts(self, tokens: int) -> float:
        """Expected distinct experts per sparse layer that `tokens` tokens route to, each
        choosing k of E uniformly: E x (1 - (1 - k/E)^T). 0 for a dense model."""
        e, k = self.model.num_experts, self.model.experts_per_tok
        return e * (1 - (1 - k / e) ** tokens) if e and tokens else 0.0

    def layer_weight_bytes(self, tokens: int) -> float:
        """Decoder-layer weights a step of `tokens` tokens reads: the dense ones, and the
        experts touched (an upper bound: real routing is skewed)."""
        if not self.model.num_experts:
            return self.body_bytes
        touched = self.model.sparse_layers * self.touched_experts(tokens)
        return self.dense_bytes + touched * self.expert_bytes

    def _cost(self, tokens: int, sampled: int, kv_read: int, pairs: int,
              moved: int) -> StepCost:
        m = self.model
        if tokens == 0 and moved == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        weights = (self.layer_weight_bytes(tokens) + (self.head_bytes if sampled else 0)
                   + tokens * m.hidden * 2) if tokens else 0.0
        kv = (kv_read * self.kv_read_factor + tokens + 2 * moved) * self.kv_bytes_per_token
        linear = 2 * m.active_linear_params * tokens
        other = (2 * (m.lm_head_params * sampled + m.router_params * tokens)
                 + self._pair_flops * pairs)
        compute_s = linear / self._linear_flops + other / self._bf16_flops
        return StepCost(weights, kv, linear + other, (weights + kv) / self._bw, compute_s,
                        self.overhead_s)

    def decode(self, batch: int, ctx: int) -> StepCost:
        """A pure decode step: `batch` sequences, each attending to `ctx` tokens."""
        return self._cost(batch, batch, batch * ctx, batch * ctx, 0)

    # -- memory ---------------------------------------------------------------------------
    def kv_capacity_tokens(self, mem_util: float = 0.9,
                           reserve_bytes: float = DEFAULT_RESERVE_BYTES) -> int:
        """KV slots that fit: (memory x mem_util - resident weights - reserve) / KV per token,
        as the real runner sizes its cache on CUDA. Raises ValueError if nothing fits."""
        budget = self.gpu.memory_bytes * mem_util - self.resident_weight_bytes - reserve_bytes
        tokens = int(budget // self.kv_bytes_per_token)
        if tokens < 1:
            raise ValueError(
                f"{self.model.name} ({self.weight_dtype} weights, "
                f"{self.resident_weight_bytes / 1e9:.1f} GB) leaves no room for a KV cache on "
                f"{self.gpu.name} ({self.gpu.memory_bytes / GiB:.0f} GiB x {mem_util})")
        return tokens


def fit_decode(cost: CostModel, samples: Iterable[tuple[int, int, float]]) -> dict[str, float]:
    """Calibrate from measured decode steps `(batch, ctx, seconds)`: least-squares fit of
    seconds = bytes / (bandwidth x eff_bw) + overhead_s over memory-bound steps. Returns
    {"eff_bw", "overhead_s", "max_rel_err"}; feed them to --sim-eff-bw / --sim-overhead-ms."""
    pts = [(cost.decode(b, c).bytes, t) for b, c, t in samples]
    if len(pts) < 2:
        raise ValueError("need at least two measurements")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        raise ValueError("measurements need different byte counts (batches or contexts)")
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    overhead = max(my - slope * mx, 0.0)
    eff = 1 / (slope * cost.gpu.bandwidth)
    err = max(abs(x * slope + overhead - y) / y for x, y in pts)
    return {"eff_bw": eff, "overhead_s": overhead, "max_rel_err": err}
