"""Serving on a GPU through the real servers: `pipellm up` (gateway, tokenizers, compute,
detokenizer, embedded Redis) or vLLM's `vllm serve` (its CUDA build carried by
bench/vllm_gpu.py), on one Llama-3-8B-shaped random bf16 model with the demo tokenizer's
vocabulary (every generated id decodes), driven by `pipellm-bench`: the same client, requests
and seeds for both. Part of bench/gpu_suite.sh (steps serve, serve_sg, vllm_serve); the last
line printed is one JSON object.

Workloads (`--workloads`), EOS ignored, each greedy and/or sampled (`--sampling`; sampled:
temperature 0.7, top_p 0.9, names end in -s):

    rand    random 512 in / 256 out, 512 prompts, all at once
    rand8   the same at 8 req/s (Poisson)
    sg      ShareGPT (data/, demo-tokenizer lengths), 1,000 prompts, all at once: the
            published offline figures' count
    sg4     ShareGPT at 4 req/s, --rate-prompts prompts
    sg16    ShareGPT at 16 req/s

    python -m bench.gpu_serve [--server pipellm|vllm] [--workloads sg,sg4,sg16]
        [--sampling greedy,sampled] [--model-dir /tmp/l3-serve]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from bench.common import log, machine
from bench.servers import Server, ServerError, free_port, run_bench, running
from bench.vllm_gpu import SITE as VLLM_SITE
from pipellm.shared.demo_model import build_demo_tokenizer, ensure_demo_model

SHAPE = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, intermediate_size=14336, rope_theta=500000.0)
KEYS = ("output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms",
        "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "completed", "failed")
RANDOM = ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "256"]
WORKLOADS = {  # name -> (pipellm-bench flags, prompts: an int or the flag that sets them)
    "rand": ([*RANDOM, "--request-rate", "inf"], "num_prompts"),
    "rand8": ([*RANDOM, "--request-rate", "8"], "num_prompts"),
    "sg": (["--dataset-name", "sharegpt", "--request-rate", "inf"], "sharegpt_prompts"),
    "sg4": (["--dataset-name", "sharegpt", "--request-rate", "4"], "rate_prompts"),
    "sg16": (["--dataset-name", "sharegpt", "--request-rate", "16"], "rate_prompts"),
}
STATS_INTERVAL_S = 2  # pipellm's stats lines (--log-stats-interval), several a run
ENGINE_LINE = "Engine 000: "
SAMPLING = {"greedy": ("", ["--temperature", "0"]),
            "sampled": ("-s", ["--temperature", "0.7", "--top-p", "0.9"])}


def _names(text: str, known) -> list[str]:
    names = [s for s in text.split(",") if s]
    if bad := [s for s in names if s not in known]:
        raise argparse.ArgumentTypeError(f"unknown {bad}: choose from {', '.join(known)}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--server", choices=("pipellm", "vllm"), default="pipellm")
    a("--device", default="cuda", help="pipellm's (cpu: a smoke run on a small --model-dir)")
    a("--quantization", choices=("none", "fp8"), default="none", help="fp8: both servers "
      "quantize the bf16 weights at load (e4m3; vLLM's and pipellm's --quantization fp8)")
    a("--workloads", type=lambda s: _names(s, WORKLOADS), default="rand,rand8")
    a("--sampling", type=lambda s: _names(s, SAMPLING), default="greedy")
    a("--num-prompts", type=int, default=512, help="of rand and rand8")
    a("--sharegpt-prompts", type=int, default=1000, help="of sg")
    a("--rate-prompts", type=int, default=120, help="of sg4 and sg16")
    a("--warmup-prompts", type=int, default=16, help="unmeasured, per sampling mode")
    a("--context", type=int, default=2048)
    a("--model-dir", type=Path, default=None, help="kept and reused (default: a temporary "
      "folder); both servers of one machine read the same weights")
    a("--vllm-site", type=Path, default=VLLM_SITE)
    a("--ready-timeout", type=float, default=600)
    a("--bench-timeout", type=float, default=400)
    a("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(out: Path, context: int) -> None:
    """Random Llama-3-8B-shaped weights (bf16, made on the GPU, seeded) + the demo tokenizer."""
    tok = build_demo_tokenizer()
    cfg = transformers.LlamaConfig(**SHAPE, vocab_size=tok.get_vocab_size(),
                                   max_position_embeddings=context, tie_word_embeddings=False,
                                   bos_token_id=tok.token_to_id("<s>"),
                                   eos_token_id=tok.token_to_id("</s>"), dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    demo = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, out / name)


def describe(model: Path) -> str:
    """The served model in a few words, from its config.json."""
    c = json.loads((model / "config.json").read_text())
    return (f"{c['model_type']} {c['num_hidden_layers']} layers x {c['hidden_size']}, vocab "
            f"{c['vocab_size']}, {c.get('dtype') or c.get('torch_dtype')}, {model}")


def make_server(args, model: Path, port: int, log_path: Path) -> Server:
    if args.server == "pipellm":
        argv = [sys.executable, "-m", "pipellm.services.cli", "up", "--model", str(model), "--port",
                str(port), "--device", args.device, "--dtype", "bfloat16", "--max-model-len",
                str(args.context), "--quantization", args.quantization,
                "--log-stats-interval", str(STATS_INTERVAL_S)]
        return Server("pipellm", argv, f"http://127.0.0.1:{port}/health", log_path)
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--host",
            "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len",
            str(args.context)] + (["--quantization", "fp8"] if args.quantization == "fp8" else [])
    cuda_bin = "/usr/local/cuda/bin"  # flashinfer (vLLM's sampler) compiles with nvcc
    env = {"PYTHONPATH": str(args.vllm_site), "PATH": f"{os.environ.get('PATH', '')}:{cuda_bin}",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}  # the device reaches no network
    return Server("vllm", argv, f"http://127.0.0.1:{port}/v1/models", log_path, env)


def bench_argv(args, workload: str, sampling: str, port: int, model: Path, out: Path,
               prompts: int | None = None) -> list[str]:
    flags, count = WORKLOADS[workload]
    n = prompts or getattr(args, count)
    return [sys.executable, "-m", "pipellm.loadgen.cli", "--base-url", f"http://127.0.0.1:{port}",
            *flags, "--tokenizer", str(model), "--max-model-len", str(args.context),
            "--num-prompts", str(n), "--ignore-eos", *SAMPLING[sampling][1],
            "--seed", str(args.seed), "--disable-tqdm", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name]


def gpu_processes() -> dict[str, int]:
    """MiB of GPU memory per process id, as nvidia-smi lists them ({} without it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = (line.split(",") for line in out.splitlines() if line.count(",") == 1)
    return {pid.strip(): int(mib) for pid, mib in rows if mib.strip().isdigit()}


def engine_lines(log_path: Path, start: int) -> list[str]:
    """pipellm compute's stats lines (pipellm/services/compute/step_stats.py) in its log past byte
    `start`: what a run's steps did, read beside its figures."""
    with open(log_path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return [line.split(ENGINE_LINE, 1)[1] for line in text.splitlines() if ENGINE_LINE in line]


def drive(args, port: int, model: Path, results: Path, log_path: Path) -> dict:
    """Every (sampling, workload) run against a ready server; {name: KEYS} of those that ran,
    with pipellm's stats lines of the run (`engine`)."""
    rows = {}
    for sampling in args.sampling:
        suffix = SAMPLING[sampling][0]
        warm = results / f"warmup{suffix}.json"  # a sampled warm-up also compiles samplers
        run_bench(args, bench_argv(args, "rand", sampling, port, model, warm,
                                   args.warmup_prompts), warm)
        for workload in args.workloads:
            name = workload + suffix
            out = results / f"{name}.json"
            start = log_path.stat().st_size
            res = run_bench(args, bench_argv(args, workload, sampling, port, model, out), out)
            if res is not None:
                rows[name] = {k: res.get(k) for k in KEYS}
                if args.server == "pipellm":
                    rows[name]["engine"] = engine_lines(log_path, start)
                log(f"{args.server} {name}: {json.dumps(rows[name])}")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.cuda.get_device_name() if args.device == "cuda" else machine()
    print(f"machine: {machine()}; {device}; server {args.server}")
    with tempfile.TemporaryDirectory(prefix="pipellm-gpu-serve-") as tmp:
        model, results = args.model_dir or Path(tmp) / "model", Path(tmp) / "results"
        if not (model / "config.json").is_file():
            build_model(model, args.context)
        port = free_port()
        server = make_server(args, model, port, results / f"{args.server}.log")
        rows, startup_s, memory = {}, None, {}
        try:
            with running(server, args.ready_timeout) as startup_s:
                log(f"{args.server} ready after {startup_s:.0f} s")
                # the `pipellm up` parent (the process started here) should hold none
                memory = {"parent_pid": str(server.proc.pid), "processes": gpu_processes()}
                rows = drive(args, port, model, results, server.log_path)
                if len(rows) < len(args.workloads) * len(args.sampling):
                    log(f"some runs failed; {args.server}'s log ends:\n{server.log_tail(30)}")
        except ServerError as e:  # its message ends with the server's last log lines
            log(str(e))
        print(json.dumps({"server": args.server, "quantization": args.quantization,
                          "device": device, "model": describe(model), "context": args.context,
                          "startup_s": startup_s and round(startup_s, 1),
                          "gpu_memory_mib": memory, "runs": rows}))
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
