"""LoRA serving throughput: 64 requests spread over 1, 4 and 16 adapters against the base model
alone, pipellm and vLLM's CPU build side by side (issue 49).

Adapters: 16 random PEFT adapters of SmolLM2-135M-Instruct (rank 16 on q, k, v, o, gate, up and
down, A and B both random: every delta is real work), made with `peft` in the work directory.
Each server starts twice a round: plain, for the `base` workload, and with `--enable-lora`, the
16 adapters, `--max-loras 16` (all resident, so a batch can mix all of them) and
`--max-lora-rank 16`, for `lora1`, `lora4` and `lora16`: each request names one of the first K
adapters as its model (seeded, pipellm-bench `--lora-modules`, as `vllm bench serve`'s). Every
workload: --num-prompts random prompts, 128 in / 128 out, rate inf, greedy, EOS ignored.

pipellm runs the GGUF (its default configuration), vLLM the GGUF's HF expansion in bf16 on every
core, as in bench/vs_peers.py. Reported: output tok/s per (server, workload), medians over the
rounds; each LoRA workload's ratio to the same server's base; pipellm's ratio to vLLM's.
Targets: pipellm lora4 >= 0.85x its base; pipellm ahead of vLLM on every LoRA workload.

    python -m bench.lora [--rounds 1] [--servers pipellm,pipellm-avx2,vllm-bf16] [--quick]

The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/lora.py`
    sys.path.insert(0, str(ROOT))

from bench import servers, vs_peers  # noqa: E402
from bench.common import log, machine  # noqa: E402

ADAPTERS, RANK = 16, 16
WORKLOADS = {"base": 0, "lora1": 1, "lora4": 4, "lora16": 16}  # -> adapters the requests use
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="pipellm,vllm-bf16",
                   help="of pipellm, pipellm-avx2 (its AVX2 kernels), vllm-bf16")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="1 round, 8 prompts, lora4 only")
    peers = vs_peers.with_own_flags(p, argv)
    if peers.quick:
        peers.rounds, peers.num_prompts = 1, 8
    return peers


def make_adapters(hf_dir: Path, work_dir: Path) -> list[tuple[str, Path]]:
    """(name, directory) of the 16 random adapters, made once under work_dir."""
    out = [(f"lora{i}", work_dir / f"smollm2-lora-r{RANK}-{i}") for i in range(ADAPTERS)]
    if all((d / "adapter_config.json").is_file() for _, d in out):
        return out
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for i, (_, d) in enumerate(out):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=2 * RANK,
                                                target_modules=list(TARGETS),
                                                init_lora_weights=False))
        with torch.no_grad():  # small random deltas: real work, outputs still text-like
            for name, w in model.named_parameters():
                if "lora_" in name:
                    w.normal_(0.0, 0.02)
        model.save_pretrained(d)
    return out


def lora_flags(adapters: list[tuple[str, Path]]) -> str:
    """The serving flags of vLLM's interface, which both servers take."""
    mods = " ".join(f"{n}={d}" for n, d in adapters)
    return (f"--enable-lora --lora-modules {mods} --max-loras {len(adapters)} "
            f"--max-lora-rank {RANK}")


def bench_argv(args, port: int, names: list[str], seed: int, out: Path) -> list[str]:
    return [args.bench_bin, "--base-url", f"http://127.0.0.1:{port}", "--dataset-name", "random",
            "--random-input-len", "128", "--random-output-len", "128", "--request-rate", "inf",
            "--num-prompts", str(args.num_prompts), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-dir",
            str(out.parent), "--result-filename", out.name,
            *(["--lora-modules", *names] if names else [])]


def serve(args, name: str, adapters, wls: list[str], rep: int) -> dict[str, float]:
    """Start `name` (with the adapters when given), run `wls`; {workload: output tok/s}."""
    port, extra = servers.free_port(), lora_flags(adapters) if adapters else ""
    args.pipellm_extra = args.vllm_extra = extra
    tag = f"{name}-{'lora' if adapters else 'base'}-rep{rep}"
    server = vs_peers.make_server(args, name, port, args.results_dir / f"{tag}.log")
    args.commands[tag.rsplit("-", 1)[0]] = vs_peers.command(server, port)
    tput: dict[str, float] = {}
    try:
        with servers.running(server, args.ready_timeout) as startup_s:
            log(f"{tag} ready after {startup_s:.0f} s")
            warm = args.results_dir / f"warmup-{tag}.json"
            servers.run_bench(args, bench_argv(args, port, [n for n, _ in adapters], 99, warm),
                              warm)
            for wl in wls:
                names = [n for n, _ in adapters[: WORKLOADS[wl]]]
                out = args.results_dir / f"{name}-{wl}-rep{rep}.json"
                res = servers.run_bench(args, bench_argv(args, port, names, rep, out), out)
                if res and res["completed"] == args.num_prompts:
                    tput[wl] = res["output_throughput"]
                    log(f"{name} {wl}: {tput[wl]:.1f} tok/s, TPOT {res['mean_tpot_ms']:.1f} ms")
                else:
                    log(f"{name} {wl}: failed ({res and res['failed']} failed requests)")
    except servers.ServerError as exc:
        log(f"{tag}: {exc}")
    return tput


def report(runs: dict[str, dict[str, list[float]]]) -> dict:
    med = {s: {wl: statistics.median(v) for wl, v in r.items() if v} for s, r in runs.items()}
    print("\n| server | " + " | ".join(WORKLOADS) + " | lora4 / base |")
    print("|---|" + "---|" * (len(WORKLOADS) + 1))
    for s, m in med.items():
        cells = [f"{m[wl]:.1f}" if wl in m else "failed" for wl in WORKLOADS]
        ratio = round(m["lora4"] / m["base"], 2) if {"lora4", "base"} <= m.keys() else None
        print(f"| {s} | " + " | ".join(cells) + f" | {ratio} |")
    v = med.get("vllm-bf16", {})
    ours = [s for s in med if s.startswith("pipellm")]
    out = {"lora4_vs_base": {s: round(med[s]["lora4"] / med[s]["base"], 3) for s in ours
                             if {"lora4", "base"} <= med[s].keys()},
           "vs_vllm": {s: {wl: round(med[s][wl] / v[wl], 2) for wl in WORKLOADS
                           if wl in med[s] and wl in v} for s in ours if v}}
    print(f"lora4 / base: {out['lora4_vs_base']} (target >= 0.85); pipellm / vLLM: "
          f"{out['vs_vllm']} (target > 1 on the LoRA workloads)")
    return {**out, "tok_s": med}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    servers.terminate_on_sigterm()
    t0 = time.monotonic()
    vs_peers.prepare(args)
    adapters = make_adapters(args.hf_dir, args.work_dir)
    print(f"machine: {machine()}; {ADAPTERS} adapters of rank {RANK}; {args.num_prompts} "
          f"prompts, 128 in / 128 out, rate inf, greedy; results in {args.results_dir}")
    lora_wls = ["lora4"] if args.quick else [w for w in WORKLOADS if w != "base"]
    runs = {s: {wl: [] for wl in WORKLOADS} for s in args.servers}
    for rep in range(args.rounds):
        for s in args.servers:
            for ads, wls in (([], ["base"]), (adapters, lora_wls)):
                for wl, tps in serve(args, s, ads, wls, rep).items():
                    runs[s][wl].append(tps)
    out = {"bench": "lora", "machine": machine(), "rounds": args.rounds,
           "prompts": args.num_prompts, **report(runs), "commands": args.commands,
           "seconds": round(time.monotonic() - t0)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
