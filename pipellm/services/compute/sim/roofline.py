"""`pipellm roofline`: which GPU for which model, from the cost model (`cost.py`).

For each GPU x model: weights, KV bytes per token and the KV capacity; then per decode batch x
context: bytes and FLOPs of one decode step, its minimum time, the maximum output tokens/s
(batch / step time), which bound dominates, and whether batch x context fits the KV cache. With
the default efficiencies (1.0, no overhead) the times are physical lower bounds; pass
--eff-bw/--eff-flops/--overhead-ms for the sim backend's realistic ones. The last line printed
is one JSON object.
"""

from __future__ import annotations

import argparse
import json

from pipellm.services.compute.sim.cost import (
    DEFAULT_RESERVE_BYTES,
    KV_DTYPE_BYTES,
    WEIGHT_DTYPE_BYTES,
    CostModel,
    kv_dtype_bytes,
)
from pipellm.services.compute.sim.hardware import GPUS, MODELS, GiB


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default="h100", help=f"comma-separated: {', '.join(GPUS)}")
    p.add_argument("--model", default="llama-3-8b",
                   help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--contexts", default="512,2048,8192")
    p.add_argument("--kv-dtype", default="bf16", choices=tuple(KV_DTYPE_BYTES))
    p.add_argument("--weight-dtype", default="bf16", choices=tuple(WEIGHT_DTYPE_BYTES))
    p.add_argument("--eff-bw", type=float, default=1.0)
    p.add_argument("--eff-flops", type=float, default=1.0)
    p.add_argument("--overhead-ms", type=float, default=0.0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)


def table(gpu: str, model: str, batches: list[int], contexts: list[int], kv_dtype: str = "bf16",
          weight_dtype: str = "bf16", eff_bw: float = 1.0, eff_flops: float = 1.0,
          overhead_s: float = 0.0, mem_util: float = 0.9) -> dict:
    """The roofline of `model` on `gpu` as a dict (what the JSON line holds)."""
    cm = CostModel(gpu, model, kv_dtype_bytes(kv_dtype), eff_bw, eff_flops, overhead_s,
                   weight_dtype)
    try:
        capacity = cm.kv_capacity_tokens(mem_util)
    except ValueError:
        capacity = 0
    m = cm.model  # a token runs the active experts only (all of them for a dense model)
    per_token_flops = 2 * (m.active_linear_params + m.router_params + m.lm_head_params)
    rows = []
    for ctx in contexts:
        for b in batches:
            c = cm.decode(b, ctx)
            rows.append({
                "batch": b, "context": ctx, "weight_gb": c.weight_bytes / 1e9,
                "kv_gb": c.kv_bytes / 1e9, "gflop": c.flops / 1e9, "mem_ms": c.mem_s * 1e3,
                "compute_ms": c.compute_s * 1e3, "step_ms": c.time_s * 1e3,
                "tok_s": b / c.time_s, "bound": c.bound, "fits": b * ctx <= capacity,
            })
    return {
        "gpu": cm.gpu.name, "gpu_label": cm.gpu.label, "model": cm.model.name,
        "params_b": cm.model.params / 1e9, "weight_dtype": weight_dtype, "kv_dtype": kv_dtype,
        "eff_bw": eff_bw, "eff_flops": eff_flops, "overhead_ms": overhead_s * 1e3,
        "weights_resident_gb": cm.resident_weight_bytes / 1e9,
        # every expert: what a large batch reads (a row's weight_gb: what its batch touches)
        "weights_per_step_gb": (cm.body_bytes + cm.head_bytes) / 1e9,
        "kv_bytes_per_token": cm.kv_bytes_per_token, "kv_capacity_tokens": capacity,
        "kv_capacity_note": f"{mem_util:g} x {cm.gpu.memory_bytes / GiB:.1f} GiB - weights - "
                            f"{DEFAULT_RESERVE_BYTES / GiB:g} GiB reserve",
        # prefill is compute-bound: tokens/s when every FLOP is a matmul FLOP at the peak
        "prefill_tok_s_max": cm.gpu.peak_flops(weight_dtype) * eff_flops / per_token_flops,
        "rows": rows,
    }


def format_table(t: dict) -> str:
    lines = [
        f"{t['model']} ({t['params_b']:.2f} B params, {t['weight_dtype']} weights, "
        f"{t['kv_dtype']} KV) on {t['gpu']} ({t['gpu_label']}); eff bw {t['eff_bw']:g}, "
        f"flops {t['eff_flops']:g}, overhead {t['overhead_ms']:g} ms",
        f"  weights {t['weights_resident_gb']:.2f} GB resident, {t['weights_per_step_gb']:.2f} GB "
        f"read per step at most (no embedding table; a MoE's batch reads the experts it "
        f"routes to); KV {t['kv_bytes_per_token'] / 1024:g} KiB/token; "
        f"KV capacity {t['kv_capacity_tokens']:,} tokens ({t['kv_capacity_note']})",
        f"  prefill (compute-bound) at most {t['prefill_tok_s_max']:,.0f} tokens/s",
        f"  {'batch':>5} {'context':>7} {'weights GB':>10} {'KV GB':>7} {'GFLOP':>8} "
        f"{'mem ms':>7} {'FLOP ms':>7} {'step ms':>7} {'max out tok/s':>13} {'bound':>7} fits",
    ]
    for r in t["rows"]:
        lines.append(
            f"  {r['batch']:>5} {r['context']:>7} {r['weight_gb']:>10.2f} {r['kv_gb']:>7.2f} "
            f"{r['gflop']:>8.0f} {r['mem_ms']:>7.2f} {r['compute_ms']:>7.2f} "
            f"{r['step_ms']:>7.2f} {r['tok_s']:>13,.0f} {r['bound']:>7} "
            f"{'yes' if r['fits'] else 'NO'}")
    return "\n".join(lines)


def format_summary(tables: list[dict]) -> str:
    """One line per GPU x model: capacity, batch-1 latency, best throughput that fits."""
    lines = [f"{'model':<15} {'gpu':<10} {'weights GB':>10} {'KV tokens':>10} "
             f"{'batch-1 ms':>10} {'best out tok/s (batch x ctx that fits)':>40}"]
    for t in tables:
        fit = [r for r in t["rows"] if r["fits"]]
        best = max(fit, key=lambda r: r["tok_s"]) if fit else None
        b1 = min(t["rows"], key=lambda r: (r["batch"], r["context"]))
        where = (f"{best['tok_s']:,.0f} ({best['batch']} x {best['context']})" if best
                 else "does not fit")
        lines.append(f"{t['model']:<15} {t['gpu']:<10} {t['weights_resident_gb']:>10.1f} "
                     f"{t['kv_capacity_tokens']:>10,} {b1['step_ms']:>10.2f} {where:>40}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    tables, skipped = [], []
    for m in args.model.split(","):
        for g in args.gpu.split(","):
            try:
                tables.append(table(g, m, batches, contexts, args.kv_dtype, args.weight_dtype,
                                    args.eff_bw, args.eff_flops, args.overhead_ms / 1e3,
                                    args.gpu_memory_utilization))
            except ValueError as e:  # an unknown name, or no fp8 on this GPU
                if len(args.model.split(",")) * len(args.gpu.split(",")) == 1:
                    raise
                skipped.append({"gpu": g, "model": m, "error": str(e)})
    for t in tables:
        print(format_table(t))
        print()
    for s in skipped:
        print(f"skipped {s['model']} on {s['gpu']}: {s['error']}")
    if len(tables) > 1:
        print(format_summary(tables))
    print(json.dumps({"tables": [_rounded(t) for t in tables], "skipped": skipped}))
    return 0


def _rounded(obj):
    if isinstance(obj, float):
        return float(f"{obj:.5g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj
