"""pipellm against vLLM on CPU, side by side: same model, same machine, same load, one run.

The model is SmolLM2-135M-Instruct: its Q4_1 GGUF (`--gguf`) expanded once by transformers
into a float32 Hugging Face directory under `--work-dir` (bench/smol_model.py). Online, each
repetition round starts pipellm (`pipellm up`), drives it with every workload, stops it, then
does the same with vLLM (`vllm serve`): never both at once, a fresh server per round (so vLLM's
prefix cache cannot serve one round's prompts from another's). The load is `pipellm-bench`
(loadgen/, `vllm bench serve`'s flags and metrics), greedy, EOS ignored:

    random_inf   random dataset, 200 in / 100 out, all requests at once (rate inf)
    random_2rps  the same at 2 req/s (Poisson arrivals)
    sharegpt     ShareGPT samples (lengths counted with the model's tokenizer), rate inf;
                 each request generates exactly the real answer's length

Every (server, workload) pair runs `--repeats` times (a different seed per round and workload,
the same for both servers); reported are medians and the ratios pipellm / vLLM. Offline,
pipellm's in-process engine runs against transformers `generate` (bench/vs_vllm_offline.py).

    python -m bench.vs_vllm [--repeats 3] [--quick] [--skip-online] [--skip-offline]
        [--pipellm-model PATH] [--gguf FILE] [--vllm-bin PATH] [--work-dir DIR]

The raw pipellm-bench result JSONs and the server logs go to `--results-dir`. The last line
printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/vs_vllm.py`
    sys.path.insert(0, str(ROOT))

from bench.common import log, machine  # noqa: E402
from bench.servers import (  # noqa: E402
    Server,
    free_port,
    run_bench,
    running,
    terminate_on_sigterm,
)
from bench.smol_model import default_gguf, expand_gguf  # noqa: E402
from loadgen.datasets import SHAREGPT_FILE, default_data_dir  # noqa: E402

SERVERS = ("pipellm", "vllm")
RANDOM = ["--dataset-name", "random", "--random-input-len", "200", "--random-output-len", "100"]
WORKLOADS = {
    "random_inf": [*RANDOM, "--request-rate", "inf"],
    "random_2rps": [*RANDOM, "--request-rate", "2"],
    "sharegpt": ["--dataset-name", "sharegpt", "--request-rate", "inf"],
}
METRICS = {  # pipellm-bench / vLLM result key -> table label
    "output_throughput": "output tok/s",
    "mean_ttft_ms": "mean TTFT ms",
    "mean_tpot_ms": "mean TPOT ms",
    "request_throughput": "requests/s",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--repeats", type=int, default=3, help="runs of each (server, workload) pair")
    a("--num-prompts", type=int, default=64, help="prompts per random workload")
    a("--sharegpt-prompts", type=int, default=64)
    a("--quick", action="store_true", help="smoke run: 1 repeat, 16 prompts everywhere")
    a("--skip-online", action="store_true", help="no servers (pipellm vs vLLM)")
    a("--skip-offline", action="store_true", help="no in-process engine vs transformers")
    a("--gguf", type=Path, default=None, help="the GGUF to expand (default: the project's "
      "default model, SmolLM2-135M-Instruct, fetched once)")
    a("--pipellm-model", default=None, help="what pipellm serves (default: the expanded HF "
      "directory, the very files vLLM serves; the GGUF gives the same float32 weights)")
    a("--work-dir", type=Path, default=Path("~/.cache/pipellm/vs_vllm").expanduser())
    a("--results-dir", type=Path, default=None, help="default: WORK_DIR/results/<time>")
    a("--sharegpt-path", type=Path, default=default_data_dir() / SHAREGPT_FILE)
    a("--pipellm-bin", default=str(ROOT / ".venv/bin/pipellm"))
    a("--bench-bin", default=str(ROOT / ".venv/bin/pipellm-bench"))
    a("--vllm-bin", default="/work/vllm-venv/bin/vllm")
    a("--pipellm-threads", type=int, default=0, help="torch threads of pipellm's compute "
      "(0: pipellm's default, torch's: one per core)")
    a("--warmup-prompts", type=int, default=8, help="requests sent to each fresh server "
      "before the measured runs (not measured)")
    a("--kv-cache-gib", type=float, default=2.0, help="KV cache of both servers")
    a("--max-model-len", type=int, default=2048)
    a("--pipellm-extra", default="", help="more `pipellm up` flags, one string")
    a("--vllm-extra", default="", help="more `vllm serve` flags, one string")
    a("--vllm-cores", default="auto", help="VLLM_CPU_OMP_THREADS_BIND: the cores vLLM runs "
      "its model on (auto: its default, all but one; e.g. 0-1 for both of two)")
    a("--ready-timeout", type=float, default=900.0, help="seconds for a server to start")
    a("--bench-timeout", type=float, default=1800.0, help="seconds for one pipellm-bench run")
    a("--offline-prompts", type=int, default=32)
    a("--offline-threads", type=int, default=os.cpu_count(), help="torch threads, offline "
      "(both sides)")
    a("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.num_prompts, args.sharegpt_prompts = 1, 16, 16
        args.offline_prompts = min(args.offline_prompts, 16)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.results_dir = args.results_dir or args.work_dir / "results" / stamp
    return args


def make_server(args: argparse.Namespace, name: str, hf_dir: Path, port: int,
                rep: int) -> Server:
    """`pipellm up` or `vllm serve` on `port`, float32, context --max-model-len."""
    log_path = args.results_dir / f"{name}-rep{rep}.log"
    if name == "pipellm":
        argv = [args.pipellm_bin, "up", "--model", str(args.pipellm_model or hf_dir),
                "--port", str(port), "--device", "cpu", "--dtype", "float32",
                "--max-model-len", str(args.max_model_len), "--kv-cache-gib",
                str(args.kv_cache_gib), *shlex.split(args.pipellm_extra)]
        if args.pipellm_threads:
            argv += ["--threads", str(args.pipellm_threads)]
        return Server(name, argv, f"http://127.0.0.1:{port}/health", log_path)
    argv = [args.vllm_bin, "serve", str(hf_dir), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", str(args.max_model_len),
            *shlex.split(args.vllm_extra)]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gib:g}",
           "VLLM_CPU_OMP_THREADS_BIND": args.vllm_cores}
    return Server(name, argv, f"http://127.0.0.1:{port}/v1/models", log_path, env)


def bench_argv(args: argparse.Namespace, workload: str, port: int, seed: int,
               hf_dir: Path, out: Path) -> list[str]:
    n = args.sharegpt_prompts if workload == "sharegpt" else args.num_prompts
    extra = (["--dataset-path", str(args.sharegpt_path), "--tokenizer", str(hf_dir)]
             if workload == "sharegpt" else [])
    return [args.bench_bin, "--base-url", f"http://127.0.0.1:{port}", *WORKLOADS[workload],
            *extra, "--num-prompts", str(n), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--disable-tqdm", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name]


def warm(args: argparse.Namespace, port: int, hf_dir: Path) -> None:
    """A few requests first: both servers do one-time work on their first batches (vLLM
    compiles for new shapes), which the measured runs should not include."""
    if args.warmup_prompts <= 0:
        return
    out = args.results_dir / f"warmup-{port}.json"
    argv = bench_argv(args, "random_inf", port, args.seed + 99, hf_dir, out)
    argv[argv.index("--num-prompts") + 1] = str(args.warmup_prompts)
    run_bench(args, argv, out)


def serve_round(args: argparse.Namespace, name: str, hf_dir: Path, rep: int) -> list[dict]:
    """Start server `name`, run every workload against it once, stop it; one row per run."""
    port, rows = free_port(), []
    server = make_server(args, name, hf_dir, port, rep)
    log(f"round {rep + 1}/{args.repeats}: starting {name} on port {port}")
    with running(server, args.ready_timeout) as startup_s:
        log(f"{name} ready after {startup_s:.0f} s")
        warm(args, port, hf_dir)
        for i, workload in enumerate(WORKLOADS):
            seed = args.seed + 100 * rep + i  # same for both servers, new for every run
            out = args.results_dir / f"{name}-{workload}-rep{rep}.json"
            t0 = time.monotonic()
            res = run_bench(args, bench_argv(args, workload, port, seed, hf_dir, out), out)
            row = dict(server=name, workload=workload, rep=rep, ok=res is not None,
                       startup_s=round(startup_s, 1), seconds=round(time.monotonic() - t0, 1))
            if res is not None:
                row.update({k: res[k] for k in (*METRICS, "completed", "failed")})
                log(f"{name} {workload}: {res['output_throughput']:.1f} tok/s, "
                    f"{res['completed']} done, {res['failed']} failed")
            rows.append(row)
    return rows


def run_online(args: argparse.Namespace, hf_dir: Path) -> tuple[list[dict], dict]:
    """Rounds pipellm, vLLM, pipellm, vLLM...; the rows and each server's thread settings."""
    rows: list[dict] = []
    for rep in range(args.repeats):
        for name in SERVERS:
            rows += serve_round(args, name, hf_dir, rep)
    return rows, thread_notes(args)


def thread_notes(args: argparse.Namespace) -> dict:
    """What threads each server ran its model with (vLLM's from its own log)."""
    vllm = "?"
    log_path = args.results_dir / "vllm-rep0.log"
    if log_path.is_file():
        text = log_path.read_text(encoding="utf-8", errors="replace")
        cores = re.search(r"core ids=(\[[^\]]*\])", text)
        # the model worker's own line wins over the engine core's
        torch_t = (re.search(r"leaving Torch threads at (\d+)", text)
                   or re.search(r"Reducing Torch threads from \d+ to (\d+)", text))
        vllm = (f"model on cores {cores.group(1) if cores else '?'} with "
                f"{torch_t.group(1) if torch_t else '?'} torch thread(s) ("
                + (f"its default on {os.cpu_count()} cores: one core kept for itself)"
                   if args.vllm_cores == "auto" else
                   f"VLLM_CPU_OMP_THREADS_BIND={args.vllm_cores})"))
    threads = (f"--threads {args.pipellm_threads}" if args.pipellm_threads else
               f"its default, {os.cpu_count()} torch threads (one per core)")
    return dict(pipellm=f"compute with {threads}; gateway, tokenizer, detokenizer and redis as "
                        "separate processes, unpinned", vllm=vllm)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def summarize(rows: list[dict]) -> dict:
    """Per workload and server: median of each metric over the runs that produced a result,
    runs ok / in all, failed requests; and the ratio pipellm / vLLM of the medians."""
    out: dict = {}
    for wl in dict.fromkeys(r["workload"] for r in rows):
        entry: dict = {}
        for server in SERVERS:
            runs = [r for r in rows if r["workload"] == wl and r["server"] == server]
            ok = [r for r in runs if r["ok"]]
            entry[server] = {m: _median([r[m] for r in ok]) for m in METRICS}
            entry[server].update(runs_ok=len(ok), runs=len(runs),
                                 failed_requests=sum(r["failed"] for r in ok))
        entry["ratio"] = {m: _ratio(entry["pipellm"][m], entry["vllm"][m]) for m in METRICS}
        out[wl] = entry
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_online(summary: dict, args: argparse.Namespace, threads: dict) -> None:
    print(f"\nonline: medians of {args.repeats} run(s) per (server, workload); "
          f"{args.num_prompts} random prompts, {args.sharegpt_prompts} ShareGPT prompts; "
          "ratio = pipellm / vLLM (throughput: higher is better for pipellm; TTFT, TPOT: "
          "lower is)")
    print(f"{'workload':<12} {'metric':<14} {'pipellm':>10} {'vLLM':>10} {'ratio':>7}")
    for wl, e in summary.items():
        for m, label in METRICS.items():
            print(f"{wl:<12} {label:<14} {_fmt(e['pipellm'][m]):>10} {_fmt(e['vllm'][m]):>10} "
                  f"{_fmt(e['ratio'][m], '.2f'):>7}")
        runs = ", ".join(f"{s} {e[s]['runs_ok']}/{e[s]['runs']} runs ok, "
                         f"{e[s]['failed_requests']} failed requests" for s in SERVERS)
        print(f"{'':<12} ({runs})")
    for name, note in threads.items():
        print(f"threads, {name}: {note}")


def headline(args, summary: dict | None, threads: dict | None, offline: dict | None) -> dict:
    return dict(online=summary, offline=offline, threads=threads, repeats=args.repeats,
                num_prompts=args.num_prompts, sharegpt_prompts=args.sharegpt_prompts,
                workloads={k: " ".join(v) for k, v in WORKLOADS.items()},
                server_lifetime="one start per server per repetition round",
                pipellm_model=str(args.pipellm_model), vllm_cores=args.vllm_cores,
                quick=args.quick,
                results_dir=str(args.results_dir), machine=args.machine,
                load_avg=round(os.getloadavg()[0], 2))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    terminate_on_sigterm()
    gguf = args.gguf or default_gguf()
    log(f"model: {gguf} -> float32 HF directory under {args.work_dir}")
    hf_dir = expand_gguf(gguf, args.work_dir)
    args.pipellm_model = args.pipellm_model or str(hf_dir)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    args.machine = machine()  # before the offline part changes the torch thread count
    print(f"machine: {args.machine}; model {hf_dir} (from {gguf.name}); pipellm serves "
          f"{args.pipellm_model}; results in {args.results_dir}")
    summary = threads = offline = None
    if not args.skip_online:
        if not Path(args.vllm_bin).is_file():
            sys.exit(f"vLLM not found at {args.vllm_bin}: give --vllm-bin or --skip-online")
        rows, threads = run_online(args, hf_dir)
        (args.results_dir / "runs.json").write_text(json.dumps(rows, indent=1))
        summary = summarize(rows)
        print_online(summary, args, threads)
    if not args.skip_offline:
        from bench.vs_vllm_offline import compare, print_offline

        offline = compare(hf_dir, args.offline_prompts, 200, 100, args.offline_threads,
                          args.seed)
        print_offline(offline)
    print(json.dumps(headline(args, summary, threads, offline)))


if __name__ == "__main__":
    main()
