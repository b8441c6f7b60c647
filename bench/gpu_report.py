"""The GPU suite's report (bench/gpu_suite.sh): reads the steps' JSON files from a folder, fits
the simulator's decode efficiency (`fit_decode`) to the measured decode steps, checks the
GPU-path issue's targets, and prints a markdown section for docs/benchmarks.md, then one JSON
line with everything.

    python -m bench.gpu_report out/gpu      # or the folder the device tool brought back
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from pipellm.services.compute.sim.cost import CostModel, fit_decode

PAIRS = {"": ("serve_sg", "vllm_serve"), "fp8": ("serve_sg_fp8", "vllm_serve_fp8")}
STEPS = ("tests", "kernels", "decode1k", "decode4k", "decode_int4", "offline", "serve", "lengths",
         *(step for pair in PAIRS.values() for step in pair))
TARGETS = {  # name -> (figure, threshold, what)
    "decode_graph_pct_bound": (80.0, "decode step, batch 64, ctx 1024, CUDA graph: % of bound"),
    "offline_ratio": (3.0, "offline ShareGPT throughput / transformers generate"),
    "host_share_of_step": (0.10, "host work outside the forward, share of a step (at most)"),
    "length_hook_share": (0.01, "hidden-state length hook on the step path, batch 256, share "
                                "of a step (at most)"),
    "vs_vllm_throughput": (1.0, "served ShareGPT 1,000 at once, output tok/s / vLLM's (the "
                                "lower of greedy and sampled)"),
    "vs_vllm_tpot": (1.0, "p50 TPOT at 4 and 16 req/s, vLLM's / pipellm's (the lowest)"),
}
AT_MOST = ("host_share_of_step", "length_hook_share")


def load(folder: Path) -> dict:
    out = {}
    for step in STEPS:
        path = folder / f"{step}.json"
        try:
            out[step] = json.loads(path.read_text(encoding="utf-8").strip().splitlines()[-1])
        except (OSError, ValueError, IndexError):
            out[step] = None  # the step did not run, or did not finish
    device = folder / "device.txt"
    out["device"] = device.read_text().strip() if device.is_file() else "unknown"
    return out


def gpu_name(device: str) -> str:
    d = device.lower()
    return "h200" if "h200" in d else "h100-pcie" if "pcie" in d else "h100"


def fit(results: dict) -> dict | None:
    """fit_decode on the graph (else eager) decode timings of both contexts."""
    samples = []
    for step in ("decode1k", "decode4k"):
        r = results.get(step)
        for batch, row in ((r or {}).get("batches") or {}).items():
            ms = row.get("graph_ms", row.get("eager_ms"))
            if ms:
                samples.append((int(batch), r["context"], ms / 1e3))
    if len(samples) < 2:
        return None
    f = fit_decode(CostModel(gpu_name(results["device"]), "llama-3-8b", eff_bw=1.0,
                             overhead_s=0.0), samples)
    return {"eff_bw": round(f["eff_bw"], 4), "overhead_ms": round(1e3 * f["overhead_s"], 4),
            "max_rel_err": round(f["max_rel_err"], 4), "samples": len(samples)}


def figures(r: dict) -> dict:
    d1k = ((r.get("decode1k") or {}).get("batches") or {}).get("64", {})
    off = r.get("offline") or {}
    return {"decode_graph_pct_bound": d1k.get("graph_pct_bound"),
            "offline_ratio": off.get("ratio"), "host_share_of_step": off.get("host_share_of_step"),
            "length_hook_share": (r.get("lengths") or {}).get("hook_share"),
            **vs_vllm(r)}


def side_by_side(r: dict) -> list[tuple[str, str, dict, dict]]:
    """(quantization: "" or "fp8", run, pipellm's row, vLLM's row) for every run both servers
    completed."""
    rows = []
    for quant, (ours_step, theirs_step) in PAIRS.items():
        ours = (r.get(ours_step) or {}).get("runs") or {}
        theirs = (r.get(theirs_step) or {}).get("runs") or {}
        rows += [(quant, name, ours[name], theirs[name]) for name in ours if name in theirs]
    return rows


def vs_vllm(r: dict) -> dict:
    """The side-by-side targets' figures: the worst ratio over the runs each covers."""
    tput, tpot = [], []
    for _, name, ours, theirs in side_by_side(r):
        if name.split("-")[0] == "sg" and theirs.get("output_throughput"):
            tput.append(ours["output_throughput"] / theirs["output_throughput"])
        elif ours.get("median_tpot_ms"):
            tpot.append(theirs["median_tpot_ms"] / ours["median_tpot_ms"])
    return {"vs_vllm_throughput": round(min(tput), 3) if tput else None,
            "vs_vllm_tpot": round(min(tpot), 3) if tpot else None}


def verdict(name: str, value) -> str:
    threshold, _ = TARGETS[name]
    if value is None:
        return "not measured"
    ok = value <= threshold if name in AT_MOST else value >= threshold
    return "met" if ok else "NOT met"


def markdown(r: dict, figs: dict, fitted: dict | None) -> str:
    lines = [f"## GPU suite (bench/gpu_suite.sh): {r['device']}", "",
             f"- gpu tests: {r.get('tests')}",
             f"- kernel targets (bench/kernels.py): {(r.get('kernels') or {}).get('targets')}"]
    for name, (threshold, what) in TARGETS.items():
        lines.append(f"- {what}: {figs[name]} (target {threshold}: {verdict(name, figs[name])})")
    for step in ("decode1k", "decode4k", "decode_int4"):  # decode_int4: not in the fit
        for b, row in sorted(((r.get(step) or {}).get("batches") or {}).items(), key=lambda x:
                             int(x[0])):
            lines.append(f"- {step} batch {b}: eager {row.get('eager_ms')} ms, graph "
                         f"{row.get('graph_ms')} ms, bound {row.get('bound_ms')} ms "
                         f"({row.get('graph_pct_bound')}% with the graph)")
    if fitted:
        lines.append(f"- simulator fit (llama-3-8b): eff_bw {fitted['eff_bw']}, overhead "
                     f"{fitted['overhead_ms']} ms (max error {fitted['max_rel_err']:.1%}): "
                     f"--sim-eff-bw / --sim-overhead-ms")
    paged = (r.get("kernels") or {}).get("paged_attn_slowdown")
    if paged:
        lines.append(f"- paged decode attention (block table) / contiguous: {paged}x: "
                     f"bench/ablation.py --paged-attn-slowdown {paged}")
    lengths = r.get("lengths")
    if lengths:
        lines.append(f"- hidden-state length hook (bench/length_step_cost.py): step "
                     f"{lengths.get('step_ms_off')} ms without, {lengths.get('step_ms_on')} ms "
                     f"with it ({lengths.get('slowdown')} slowdown)")
    serve = (r.get("serve") or {}).get("runs")
    if serve:
        for name, row in serve.items():
            lines.append(f"- serving {name}: {row}")
    for step in ("serve_sg", "serve_sg_fp8"):  # where pipellm's steps spent the runs
        for name, row in ((r.get(step) or {}).get("runs") or {}).items():
            busiest = max(row.get("engine") or [], key=_generated, default=None)
            if busiest:
                lines.append(f"- {step} {name}, compute's busiest stats line: {busiest}")
    for step in ("serve", "serve_sg"):  # what pipellm's processes held on the device
        memory = (r.get(step) or {}).get("gpu_memory_mib")
        if memory:
            parent = memory["processes"].get(memory["parent_pid"], 0)
            lines.append(f"- {step}: GPU memory by process {memory['processes']} MiB; the "
                         f"`pipellm up` parent (pid {memory['parent_pid']}) {parent} MiB")
    rows = side_by_side(r)
    if rows:
        lines += ["", "| run | pipellm tok/s | vLLM tok/s | pipellm p50 TTFT / TPOT ms | "
                  "vLLM p50 TTFT / TPOT ms |", "|---|---|---|---|---|"]
        for quant, name, ours, theirs in rows:
            label = f"{quant} {name}".strip()
            lines.append(f"| {label} | {ours['output_throughput']:.0f} | "
                         f"{theirs['output_throughput']:.0f} | {ours['median_ttft_ms']:.0f} / "
                         f"{ours['median_tpot_ms']:.1f} | {theirs['median_ttft_ms']:.0f} / "
                         f"{theirs['median_tpot_ms']:.1f} |")
    return "\n".join(lines)


def _generated(line: str) -> float:
    """A stats line's generation throughput (pipellm/services/compute/step_stats.py)."""
    m = re.search(r"generation throughput: ([\d.]+)", line)
    return float(m.group(1)) if m else 0.0


def main(argv=None) -> int:
    folder = Path((argv or sys.argv[1:] or ["out/gpu"])[0])
    results = load(folder)
    figs, fitted = figures(results), fit(results)
    print(markdown(results, figs, fitted))
    print(json.dumps({"device": results["device"], "figures": figs,
                      "verdicts": {k: verdict(k, v) for k, v in figs.items()}, "fit": fitted,
                      "steps": {s: results[s] is not None for s in STEPS}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
