"""The host's CPU per streamed token in each of pipellm's processes, serving a burst on the
simulated backend (no model: a modelled H200 running Llama-3-8B, the H200's step budget), so
that only the serving path's own work is measured: the gateway, the tokenizer, the
detokenizer, compute's host side, and the client. Variants, each in a fresh server, rounds
alternating, the baseline measured in the same run:

    now        the services' settings as shipped
    baseline   --gc-young-threshold 700 (CPython's young threshold; the heap still frozen)

Workload: --prompts ShareGPT prompts at once (1,000: the published offline count), their
answers' lengths, EOS ignored; the demo model serves the tokenizer (the simulator emits ids of
its vocabulary).

    python -m bench.serve_host [--prompts 1000] [--rounds 2]

Reported: us of CPU per output token per process (utime + stime from /proc over the run), the
output tok/s, and baseline / now per process. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/serve_host.py`
    sys.path.insert(0, str(ROOT))

from bench.common import log, machine  # noqa: E402
from bench.servers import Server, free_port, run_bench, running  # noqa: E402
from pipellm.shared.demo_model import ensure_demo_model  # noqa: E402

VARIANTS = {"now": [], "baseline": ["--gc-young-threshold", "700"]}
SIM = ["--backend", "sim", "--sim-gpu", "h200", "--sim-model", "llama-3-8b",
       "--max-batched-tokens", "8192", "--max-running", "1024", "--kv-cache-tokens", "800000"]
PROCESSES = ("gateway", "tokenizer", "compute", "detokenizer")


def cpu_seconds(pgid: int) -> dict[str, float]:
    """utime + stime of each pipellm service in process group `pgid`, by service name."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        name = next((p for p in PROCESSES if p.encode() in argv), None)
        if int(stat[2]) == pgid and name and b"service" in argv:
            out[name] = out.get(name, 0.0) + (int(stat[11]) + int(stat[12])) / tick
    return out


def one_run(args, variant: str, model: Path, work: Path) -> dict:
    port = free_port()
    server = Server(variant, [sys.executable, "-m", "pipellm.services.cli", "up", "--model",
                              str(model), "--port", str(port), *SIM, *VARIANTS[variant]],
                    f"http://127.0.0.1:{port}/health", work / f"{variant}.log")
    out = work / f"{variant}.json"
    argv = [sys.executable, "-m", "pipellm.loadgen.cli", "--base-url", f"http://127.0.0.1:{port}",
            "--dataset-name", "sharegpt", "--tokenizer", str(model), "--request-rate", "inf",
            "--num-prompts", str(args.prompts), "--ignore-eos", "--disable-tqdm",
            "--seed", "0", "--save-result", "--result-dir", str(work),
            "--result-filename", out.name]
    with running(server, 300):
        before, t0 = cpu_seconds(server.proc.pid), os.times()
        res = run_bench(args, argv, out)
        after, t1 = cpu_seconds(server.proc.pid), os.times()
    if res is None or res["failed"]:
        raise RuntimeError(f"{variant}: the burst failed; see {work}")
    tokens = sum(res["output_lens"])
    per = {p: (after.get(p, 0) - before.get(p, 0)) / tokens * 1e6 for p in PROCESSES}
    per["client"] = (t1.children_user + t1.children_system - t0.children_user
                     - t0.children_system) / tokens * 1e6
    return {"us_per_token": per, "output_throughput": res["output_throughput"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--bench-timeout", type=float, default=600)
    args = p.parse_args(argv)
    model = ensure_demo_model()
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="pipellm-serve-host-") as tmp:
        for r in range(args.rounds):
            for variant in VARIANTS:
                runs[variant].append(one_run(args, variant, model, Path(tmp)))
                log(f"round {r + 1} {variant}: {json.dumps(runs[variant][-1])}")
    res = {v: {"us_per_token": {k: round(statistics.median(x["us_per_token"][k] for x in rs), 1)
                                for k in rs[0]["us_per_token"]},
               "output_throughput": round(statistics.median(
                   x["output_throughput"] for x in rs), 1)} for v, rs in runs.items()}
    now, base = res["now"]["us_per_token"], res["baseline"]["us_per_token"]
    ratio = {k: round(base[k] / now[k], 2) for k in now if now[k] > 0}
    print(f"machine: {machine()}; {args.prompts} ShareGPT prompts at once on the simulated "
          f"H200, medians of {args.rounds} rounds; us of CPU per output token")
    print("| process | now | baseline (young threshold 700) | baseline / now |\n|---|---|---|---|")
    for k in now:
        print(f"| {k} | {now[k]} | {base[k]} | {ratio.get(k, '-')} |")
    out = {"prompts": args.prompts, "rounds": args.rounds, "variants": res, "ratio": ratio}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
