"""The simulator's settings (`--backend sim`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipellm.shared.config.choices import SIMULATOR
from pipellm.shared.settings import setting


@dataclass(frozen=True)
class SimConfig:
    """The modelled GPU of `--backend sim` (pipellm/services/compute/sim): flags `--sim-<field>`."""

    gpu: str = setting("h100", "GPU to model: h100, h200, a100, l40s, ... "
                       "(pipellm/services/compute/sim/hardware.py)", group=SIMULATOR)
    model: str = setting("llama-3-8b", "model to model: llama-2-7b, llama-2-13b, llama-3-8b, "
                         "mistral-7b, ...", group=SIMULATOR)
    kv_dtype: str = setting("bf16", "KV cache element: bf16, int8 or fp8 (2 / 1 / 1 bytes)",
                            group=SIMULATOR)
    weight_dtype: str = setting("bf16", "weights: bf16, int8, fp8 (W8A8) or int4 (weight-only)",
                                group=SIMULATOR)
    # eff_bw and overhead_ms: fitted to the decode steps measured on an H200 (bench/gpu_report.py)
    eff_bw: float = setting(0.76, "fraction of HBM bandwidth reached", group=SIMULATOR)
    eff_flops: float = setting(0.6, "fraction of peak tensor FLOP/s reached", group=SIMULATOR)
    overhead_ms: float = setting(0.4, "per-step time outside the roofline (launches, host)",
                                 group=SIMULATOR)
    paged_attn_slowdown: float = setting(
        1.0, "--kv-policy paged: attention KV reads cost this many times the contiguous "
        "kernel's (a block-table lookup per page; bench/kernels.py measures it on a GPU)",
        group=SIMULATOR)
    clock: str = setting("real", "real (sleep each step's modelled time) or virtual (advance a "
                         "clock)", group=SIMULATOR)

    def __post_init__(self):
        if self.clock not in ("real", "virtual"):
            raise ValueError(f"--sim-clock must be real or virtual, not {self.clock!r}")
        if self.paged_attn_slowdown <= 0:
            raise ValueError("--sim-paged-attn-slowdown must be > 0")
