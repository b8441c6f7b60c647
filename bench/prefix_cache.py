"""Prefix caching on CPU, side by side: pipellm and vLLM, each with and without its cache.

Same model (SmolLM2-135M-Instruct), same machine, same load, one run; the servers as
bench/vs_peers.py runs them (pipellm: its default, the GGUF; vLLM: vllm-bf16, bf16 on the GGUF's
float32 HF expansion, model on every core). Each round starts each of the four servers in
turn (a fresh server, so no round serves another's prompts from its cache), warms it, and
drives it with the two prefix-heavy workloads of the load generator
(pipellm/loadgen/prefix_datasets.py), greedy, EOS ignored (every request generates its sample's
answer length), lengths counted with the model's tokenizer:

    shared-prefix       a ~1k-token system text before every ShareGPT question
    sharegpt-multiturn  4-turn conversations, each prompt the last one + its answer + a question

at `--request-rate` (Poisson arrivals; a finite rate lets a turn arrive after the one before it
finished, as a user's would) and at rate inf (every request at once: the QPS a server sustains).
Reported: medians over the rounds of median TTFT and of request throughput, and the ratios
without / with the cache (TTFT: how many times lower; QPS: how many times higher).

    python -m bench.prefix_cache [--rounds 3] [--quick] [--num-prompts 32]
        [--request-rate 1] [vs_peers' flags: --vllm-bin, --kv-cache-gib, ...]

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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import servers, vs_peers  # noqa: E402
from bench.common import log, machine  # noqa: E402

# name -> (vs_peers' server, its prefix caching flag)
SERVERS = {
    "pipellm": ("pipellm", ""),
    "pipellm+cache": ("pipellm", "--enable-prefix-caching"),
    "vllm": ("vllm-bf16", "--no-enable-prefix-caching"),
    "vllm+cache": ("vllm-bf16", "--enable-prefix-caching"),
}
DATASETS = ("shared-prefix", "sharegpt-multiturn")
METRICS = ("median_ttft_ms", "request_throughput", "output_throughput")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=32, help="requests per run")
    p.add_argument("--request-rate", type=float, default=1.0, help="req/s of the paced runs")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"of {', '.join(SERVERS)}")
    own, rest = p.parse_known_args(argv)
    args = vs_peers.parse_args(rest)  # the server flags, shared with bench/vs_peers.py
    for k, v in vars(own).items():
        setattr(args, k, v)
    if args.quick:
        args.num_prompts = min(args.num_prompts, 12)
    args.servers = [s for s in args.servers.split(",") if s]
    if unknown := set(args.servers) - set(SERVERS):
        p.error(f"unknown servers {sorted(unknown)}")
    return args


def workloads(args) -> dict[str, list[str]]:
    """Run name -> pipellm-bench flags."""
    out = {}
    for d in DATASETS:
        for rate in (args.request_rate, float("inf")):
            name = f"{d}@{'inf' if rate == float('inf') else f'{rate:g}'}"
            out[name] = ["--dataset-name", d, "--request-rate", str(rate)]
    return out


def bench_argv(args, flags: list[str], port: int, seed: int, out: Path):
    return [args.bench_bin, "--base-url", f"http://127.0.0.1:{port}", *flags,
            "--dataset-path", str(args.sharegpt_path), "--tokenizer", str(args.hf_dir),
            "--num-prompts", str(args.num_prompts), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--disable-tqdm", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name]


def serve_round(args, name: str, rep: int) -> list[dict]:
    kind, flag = SERVERS[name]
    extra = "pipellm_extra" if kind == "pipellm" else "vllm_extra"
    saved = getattr(args, extra)
    setattr(args, extra, f"{saved} {flag}")
    port = servers.free_port()
    server = vs_peers.make_server(args, kind, port, args.results_dir / f"{name}-rep{rep}.log")
    setattr(args, extra, saved)
    rows = []
    log(f"round {rep + 1}/{args.rounds}: starting {name} on port {port}")
    with servers.running(server, args.ready_timeout) as startup_s:
        log(f"{name} ready after {startup_s:.0f} s")
        if args.warmup_prompts > 0:
            out = args.results_dir / f"warmup-{name}-rep{rep}.json"
            servers.run_bench(args, vs_peers.bench_argv(args, "warmup", port, args.seed + 99,
                                                        out, args.warmup_prompts), out)
        for i, (wl, flags) in enumerate(workloads(args).items()):
            out = args.results_dir / f"{name}-{wl}-rep{rep}.json"
            res = servers.run_bench(args, bench_argv(args, flags, port,
                                                     args.seed + 100 * rep + i, out), out)
            row = dict(server=name, workload=wl, rep=rep, ok=res is not None)
            if res is not None:
                row.update({k: res[k] for k in (*METRICS, "completed", "failed")})
                log(f"{name} {wl}: median TTFT {res['median_ttft_ms']:.0f} ms, "
                    f"{res['request_throughput']:.2f} req/s, {res['failed']} failed")
            rows.append(row)
    return rows


def summarize(rows: list[dict], servers: list[str]) -> dict:
    """Per run: each server's medians over rounds, and per server kind the ratios of the
    uncached to the cached server (TTFT) and of the cached to the uncached (throughput)."""
    out = {}
    for wl in dict.fromkeys(r["workload"] for r in rows):
        entry = {}
        for s in servers:
            ok = [r for r in rows if r["workload"] == wl and r["server"] == s and r["ok"]]
            entry[s] = {m: round(statistics.median(r[m] for r in ok), 3) if ok else None
                        for m in METRICS}
            entry[s]["runs_ok"] = len(ok)
            entry[s]["failed_requests"] = sum(r["failed"] for r in ok)
        for kind in ("pipellm", "vllm"):
            off, on = entry.get(kind), entry.get(kind + "+cache")
            if off and on and on["median_ttft_ms"] and off["request_throughput"]:
                entry[kind + " cache gain"] = dict(
                    ttft_x_lower=round(off["median_ttft_ms"] / on["median_ttft_ms"], 2),
                    qps_x=round(on["request_throughput"] / off["request_throughput"], 2))
        out[wl] = entry
    return out


def print_summary(summary: dict, args) -> None:
    print(f"\nmedians of {args.rounds} round(s); {args.num_prompts} requests a run")
    print(f"{'run':<26} {'server':<14} {'median TTFT ms':>15} {'req/s':>8} {'out tok/s':>10}")
    for wl, e in summary.items():
        for s in args.servers:
            m = e[s]
            ttft = "-" if m["median_ttft_ms"] is None else f"{m['median_ttft_ms']:.0f}"
            qps = "-" if m["request_throughput"] is None else f"{m['request_throughput']:.3f}"
            tps = "-" if m["output_throughput"] is None else f"{m['output_throughput']:.1f}"
            print(f"{wl:<26} {s:<14} {ttft:>15} {qps:>8} {tps:>10}")
        for kind in ("pipellm", "vllm"):
            if g := e.get(kind + " cache gain"):
                print(f"{'':<26} {kind} cache: TTFT {g['ttft_x_lower']:.2f}x lower, "
                      f"QPS {g['qps_x']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    servers.terminate_on_sigterm()
    args.servers, names = [SERVERS[n][0] for n in args.servers], args.servers  # for prepare
    vs_peers.prepare(args)
    args.servers = names
    print(f"machine: {machine()}; GGUF {args.gguf}; HF {args.hf_dir}; results in "
          f"{args.results_dir}")
    rows: list[dict] = []
    t0 = time.monotonic()
    for rep in range(args.rounds):
        for name in args.servers:
            rows += serve_round(args, name, rep)
    (args.results_dir / "runs.json").write_text(json.dumps(rows, indent=1))
    summary = summarize(rows, args.servers)
    print_summary(summary, args)
    print(json.dumps(dict(summary=summary, rounds=args.rounds, num_prompts=args.num_prompts,
                          request_rate=args.request_rate, servers=args.servers,
                          seconds=round(time.monotonic() - t0), machine=machine(),
                          results_dir=str(args.results_dir))))


if __name__ == "__main__":
    main()
