"""Host time per decode step: Scheduler.schedule + build_batch + update with N requests running
and fake tokens (no model), with the garbage collector as compute sets it once started
(pipellm/shared/ heap.py: the heap frozen, young collections every --gc-young-threshold allocations:
"settled"), as it set it before (the heap frozen alone: "frozen") and as CPython leaves it
("default"). Each variant runs in a fresh process, rounds alternating; prompts are random
(20-200 tokens), context 1024.

    python -m bench.host_step [--requests 256] [--steps 300] [--rounds 3]

The last line printed is JSON: {"settled_ms", "frozen_ms", "default_ms", "ratio", ...} (means
over rounds; ratio: frozen / settled).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import log, machine  # noqa: E402

VARIANTS = ("default", "frozen", "settled")


def one_run(variant: str, requests: int, steps: int) -> dict:
    """One variant's overhead figures, in this process."""
    from bench.offline_throughput import measure_overhead

    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(20, 200))]
               for _ in range(requests)]
    args = argparse.Namespace(max_batched_tokens=2048, max_running=requests,
                              overhead_steps=steps)
    return measure_overhead(prompts, 1024, requests * 1024, args, heap=variant)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one run, inline
    args = p.parse_args()
    if args.variant:
        print(json.dumps(one_run(args.variant, args.requests, args.steps)))
        return
    runs = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in VARIANTS:
            out = subprocess.run([sys.executable, "-m", "bench.host_step", "--variant", v,
                                  "--requests", str(args.requests), "--steps", str(args.steps)],
                                 cwd=ROOT, capture_output=True, text=True, check=True)
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            log(f"round {r + 1} {v}: {runs[v][-1]['mean']:.3f} ms/step mean, "
                f"p99 {runs[v][-1]['p99']:.3f}")
    mean = {v: sum(x["mean"] for x in runs[v]) / args.rounds for v in VARIANTS}
    p99 = {v: sum(x["p99"] for x in runs[v]) / args.rounds for v in VARIANTS}
    print(f"machine: {machine()}; {args.requests} requests decoding, {args.steps} steps, "
          f"{args.rounds} rounds")
    print("| heap | ms/step mean | p99 |\n|---|---|---|")
    for v in VARIANTS:
        print(f"| {v} | {mean[v]:.3f} | {p99[v]:.3f} |")
    print(json.dumps({**{f"{v}_ms": round(mean[v], 3) for v in VARIANTS},
                      **{f"{v}_p99_ms": round(p99[v], 3) for v in VARIANTS},
                      "ratio": round(mean["frozen"] / mean["settled"], 2),
                      "requests": args.requests, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
