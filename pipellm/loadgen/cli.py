"""`pipellm-bench`: load-test any OpenAI-compatible server; `vllm bench serve`'s metrics and flags.

    pipellm-bench --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 256 --random-output-len 64 --num-prompts 200 --request-rate 8 \\
        --ignore-eos --save-result --plot
    pipellm-bench --dataset-name azure --trace-time-scale 0.2 --num-prompts 500
    pipellm-bench --dataset-name sharegpt --sweep --sweep-slo ttft:3000 tpot:50

Prints vLLM's result table (a sweep: one line per probed rate and `qps_at_slo`); with
--save-result writes the JSON (vLLM's keys, per-request arrays included).
"""

from __future__ import annotations

import argparse
import sys

import aiohttp

from pipellm.loadgen import arrivals, plots, report, runner, sweep, workload
from pipellm.loadgen.client import Endpoint
from pipellm.loadgen.metrics import METRICS, parse_slos
from pipellm.loadgen.runner import RunConfig
from pipellm.shared.open_files import raise_open_files_limit


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipellm-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    a("--model", default=None, help="default: the first of GET /v1/models")
    a("--label", default=None, help="result name prefix (default openai / openai-chat)")
    a("--tokenizer", default=None, help="tokenizer.json (or its directory) to count ShareGPT "
      "lengths with (default: 4 characters per token)")
    a("--dataset-name", choices=workload.DATASETS, default="random", help="prefix-heavy: "
      "sharegpt-multiturn (4-turn conversations, each prompt the last one + its answer + a "
      "new question) and shared-prefix (a 1k-token system text before every question); see "
      "pipellm.loadgen.prefix_datasets")
    a("--dataset-path", default=None, help="default: the file in data/")
    a("--num-prompts", type=int, default=1000)
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0)
    a("--max-model-len", type=int, default=None, help="clip requests to this context "
      "(default: the server's max_model_len when /v1/models gives it)")
    a("--mode", choices=workload.MODES, default=None, help="see pipellm.loadgen.workload")
    a("--request-rate", type=float, default=float("inf"))
    a("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    a("--trace-time-scale", type=float, default=1.0, help="multiply trace times (0.1 = 10x "
      "faster)")
    a("--max-concurrency", type=int, default=None)
    a("--warmup-requests", "--num-warmups", dest="warmup_requests", type=int, default=0)
    a("--ignore-eos", action="store_true", help="send ignore_eos (max_tokens = the sample's "
      "output length); always on for the random dataset and throughput mode")
    a("--lora-modules", nargs="+", default=None, metavar="NAME", help="LoRA adapters the "
      "server serves: each request names one of them as its model, at random (seeded)")
    a("--interactive-fraction", type=float, default=0.0, help="priority mix: this fraction of "
      "the requests (seeded) are interactive, the rest batch; the result adds each class's "
      "TTFT and E2EL (`classes`)")
    a("--interactive-input-len", type=int, default=32, help="an interactive request's prompt")
    a("--interactive-output-len", type=int, default=32, help="an interactive request's output")
    a("--interactive-priority", type=int, default=0, help="the `priority` interactive "
      "requests send (lower runs first; vLLM's field)")
    a("--batch-priority", type=int, default=1, help="the `priority` batch requests send (0 "
      "for servers under fcfs, which refuse others)")
    a("--temperature", type=float, default=None)
    a("--top-p", type=float, default=None)
    a("--top-k", type=int, default=None)
    a("--seed", type=int, default=0)
    a("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft, tpot, e2el")
    a("--metric-percentiles", default="99")
    a("--percentile-metrics", default=",".join(METRICS),
      help="default ttft,tpot,itl,e2el (vLLM's default leaves out e2el)")
    a("--save-result", action="store_true")
    a("--result-filename", default=None)
    a("--result-dir", default=None)
    a("--plot", action="store_true", help="PNG beside the result file (needs matplotlib)")
    a("--disable-tqdm", action="store_true", help="no progress bar")
    a("--sweep", action="store_true", help="find the highest QPS meeting --sweep-slo")
    a("--sweep-slo", nargs="+", default=["ttft:3000", "tpot:50"], metavar="KEY:MS")
    a("--sweep-percentile", type=float, default=99.0)
    a("--sweep-start-rate", type=float, default=1.0)
    a("--sweep-probes", type=int, default=6)
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 no request succeeded or the server is unreachable, 2 bad usage."""
    args = parser().parse_args(argv)
    raise_open_files_limit()  # a connection per request in flight
    try:
        slos = parse_slos(args.goodput)
        sweep_cfg = sweep.SweepConfig(parse_slos(args.sweep_slo), args.sweep_percentile,
                                      args.sweep_start_rate, args.sweep_probes)
        percentiles = [float(x) for x in args.metric_percentiles.split(",")]
        metrics = [m for m in args.percentile_metrics.split(",") if m]
        check(args, metrics)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        server = runner.prepare(endpoint(args))
        items, offsets = workload.build(args, server.endpoint, server.max_model_len)
    except (aiohttp.ClientError, OSError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = RunConfig(server.endpoint, args.max_concurrency, args.warmup_requests,
                    not args.disable_tqdm)
    label = args.label or ("openai-chat" if server.endpoint.chat else "openai")
    meta = config(args, server.endpoint, label)
    if args.sweep:
        return _sweep(args, cfg, items, meta, sweep_cfg, percentiles, metrics, slos)
    result = {**meta, **runner.benchmark(cfg, items, offsets, percentiles, metrics, slos)}
    print(report.table(result, metrics, percentiles))
    if why := report.failures(result["errors"]):
        print(why, file=sys.stderr)
    path = report.result_path(label, meta["request_rate"], args.max_concurrency,
                              server.endpoint.model, meta["date"], args.result_filename,
                              args.result_dir)
    _finish(args, result, path, plots.plot_latency_cdfs)
    return 0 if result["completed"] else 1


def check(args: argparse.Namespace, metrics: list[str]) -> None:
    """Raise ValueError for option combinations that cannot work."""
    if bad := set(metrics) - set(METRICS):
        raise ValueError(f"unknown --percentile-metrics {sorted(bad)}")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.sweep and workload.mode_of(args) != "poisson":
        raise ValueError("--sweep needs --mode poisson")
    if args.mode == "trace" and args.dataset_name != "azure":
        raise ValueError("--mode trace needs --dataset-name azure")
    if not 0.0 <= args.interactive_fraction <= 1.0:
        raise ValueError("--interactive-fraction must be in [0, 1]")
    if args.interactive_fraction and workload.mode_of(args) == "throughput":
        raise ValueError("--interactive-fraction needs distinct requests, not --mode throughput")


def endpoint(args: argparse.Namespace) -> Endpoint:
    extra = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                               ("top_k", args.top_k)) if v is not None}
    ignore_eos = (args.ignore_eos or args.dataset_name == "random"
                  or workload.mode_of(args) == "throughput")
    return Endpoint(args.base_url or f"http://{args.host}:{args.port}", args.endpoint,
                    args.model or "", ignore_eos, extra)


def config(args: argparse.Namespace, ep: Endpoint, label: str) -> dict:
    """The run's settings, under vLLM's keys where it has them."""
    mode = workload.mode_of(args)
    rate = args.request_rate if mode == "poisson" else float("inf")
    return {"date": report.now_stamp(), "backend": label, "endpoint_type": label,
            "label": label, "model_id": ep.model, "tokenizer_id": args.tokenizer,
            "num_prompts": args.num_prompts,
            "request_rate": rate if rate < float("inf") else "inf",
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
            "endpoint": ep.path, "dataset_name": args.dataset_name, "mode": mode,
            "ignore_eos": ep.ignore_eos, "seed": args.seed,
            "trace_time_scale": args.trace_time_scale if mode == "trace" else None,
            "warmup_requests": args.warmup_requests, "lora_modules": args.lora_modules,
            **({"interactive_fraction": args.interactive_fraction,
                "interactive_input_len": args.interactive_input_len,
                "interactive_output_len": args.interactive_output_len,
                "interactive_priority": args.interactive_priority,
                "batch_priority": args.batch_priority} if args.interactive_fraction else {})}


def _sweep(args, cfg, items, meta, sweep_cfg, percentiles, metrics, slos) -> int:
    pcts = sorted({*percentiles, sweep_cfg.percentile})
    mets = [m for m in METRICS if m in metrics or m in sweep_cfg.slos]

    def probe(rate: float) -> dict:
        schedule = arrivals.poisson(len(items), rate, args.burstiness, args.seed)
        result = runner.benchmark(cfg, items, schedule, pcts, mets, slos)
        print(f"rate {rate:.3f} req/s: {result['request_throughput']:.2f} req/s done, "
              f"{result['failed']} failed", file=sys.stderr)
        return result

    found = sweep.search(probe, sweep_cfg)
    print(report.sweep_table(found))
    if note := sweep.short_run_note(found, len(items)):
        print(note, file=sys.stderr)
    result = {**meta, "request_rate": "sweep", **found}
    path = report.result_path(meta["label"], "sweep", args.max_concurrency, meta["model_id"],
                              meta["date"], args.result_filename, args.result_dir)
    _finish(args, result, path, plots.plot_sweep)
    return 0


def _finish(args, result: dict, path, plot) -> None:
    if args.save_result:
        print(f"saved {report.save(result, path)}")
    if args.plot and (png := plot(result, path.with_suffix(".png"))) is not None:
        print(f"plot {png}")


if __name__ == "__main__":
    sys.exit(main())
