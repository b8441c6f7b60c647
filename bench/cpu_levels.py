"""The default model's engine, in process, at each CPU configuration this machine runs: which
ISA level the kernels take (`--cpu-isa`) and which dtype the activations and KV cache are
(`--dtype`), on the same requests, greedy and sampled.

    avx2-fp32          the AVX2 block GEMMs, float32 (what an AVX2-only CPU runs)
    vnni-fp32          the avx512_vnni block GEMMs, float32 (the default before the amx level)
    vnni-bf16          the same with bfloat16 activations and KV cache
    amx-bf16           the amx level: bf16 copies in oneDNN (AMX tiles) for steps with many
                       rows (model/linear/amx.py); bfloat16 (an AMX CPU's default)

Configurations this CPU lacks are left out. Each request: `--input-len` random prompt tokens,
`--output-len` output tokens (EOS ignored), `--requests` of them added at once; output tok/s
of the whole run (prefills and decodes) and its ratio to vnni-fp32's (else the first's), measured
in the same run, for greedy and for sampled (temperature 0.7, top_p 0.9), `--rounds` times
(median).

    python -m bench.cpu_levels [--requests 64] [--input-len 200] [--output-len 100] [--rounds 2]

The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/cpu_levels.py`
    sys.path.insert(0, str(ROOT))

from bench.common import log, machine  # noqa: E402
from pipellm.kernels.cpu import isa  # noqa: E402
from pipellm.shared.sampling import SamplingParams  # noqa: E402

CONFIGS = {"avx2-fp32": ("avx2", "float32"), "vnni-fp32": ("avx512_vnni", "float32"),
           "vnni-bf16": ("avx512_vnni", "bfloat16"), "amx-bf16": ("amx", "bfloat16")}
BASELINE = "vnni-fp32"
SAMPLING = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="default: the project's default model")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="8 requests of 32 in / 8 out, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.input_len, args.output_len, args.rounds = 8, 32, 8, 1
    return args


def engine_for(model: str, level: str, dtype: str, args):
    from pipellm.services.compute.backend import build_engine
    from pipellm.shared.config import EngineConfig, SchedulerConfig

    return build_engine(EngineConfig(
        model=model, cpu_isa=level, dtype=dtype, kv_cache_tokens=args.requests * (
            args.input_len + args.output_len + 16),
        scheduler=SchedulerConfig(max_running=args.requests)))


def tok_s(engine, args, sampling: dict, seed: int) -> float:
    """Output tok/s of `args.requests` requests added at once, run to the end."""
    rng = random.Random(seed)
    for i in range(args.requests):
        prompt = [rng.randrange(100, 40_000) for _ in range(args.input_len)]
        engine.add_request(prompt, SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                                                  seed=i, **sampling))
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return args.requests * args.output_len / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    from pipellm.shared import default_model

    args = parse_args(argv)
    model = args.model or default_model.resolve()
    levels = isa.cpu_levels()
    configs = {n: c for n, c in CONFIGS.items() if c[0] in levels}
    here = machine()  # before an engine forces a level
    log(f"machine: {here}; configurations {', '.join(configs)}")
    res: dict[str, dict[str, float]] = {}
    for name, (level, dtype) in configs.items():
        engine = engine_for(model, level, dtype, args)
        tok_s(engine, args, SAMPLING["greedy"], seed=-1)  # warm-up
        res[name] = {mode: round(statistics.median(
            tok_s(engine, args, s, seed=r) for r in range(args.rounds)), 1)
            for mode, s in SAMPLING.items()}
        log(f"{name}: {res[name]}")
        del engine
    base = BASELINE if BASELINE in res else next(iter(res))
    print(f"{args.requests} requests x ({args.input_len} in, {args.output_len} out), median of "
          f"{args.rounds} rounds, output tok/s (x {base}):")
    for name, r in res.items():
        print(f"  {name:<10} " + "  ".join(
            f"{m} {v:7.1f} ({v / res[base][m]:.2f}x)" for m, v in r.items()))
    out = dict(machine=here, model=str(model), requests=args.requests,
               input_len=args.input_len, output_len=args.output_len, rounds=args.rounds,
               tok_s=res, ratio={n: {m: round(v / res[base][m], 3) for m, v in r.items()}
                                 for n, r in res.items()})
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
