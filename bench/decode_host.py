"""Where a single decode step's time goes, in process: the C++ kernels' calls against the rest
(Python, torch's dispatch and allocations, OpenMP's fork and join), one sequence at a time.

An engine on --model (default: SmolLM2's GGUF, its INT4 blocks) runs --requests requests of
--prompt random tokens and --tokens decode steps each, one at a time. Rounds alternate between
plain steps (their wall time is the step) and steps whose calls into the C++ module are timed
one by one (their sum is the kernels' time; a timing wrapper costs ~1 us a call, outside the
sum). host = step - kernels; "calls" are the module's calls per step.

    python -m bench.decode_host [--model PATH] [--rounds 3] [--requests 4] [--sampled]

The last line printed is JSON: {"step_ms", "kernel_ms", "host_ms", "host_share", "calls", ...}
(medians over rounds; "kernels_ms", each function's ms a step, from the last round).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import log, machine  # noqa: E402


class TimedModule:
    """The C++ module with each function's calls timed while `on`: seconds and calls by name."""

    def __init__(self, module):
        self.module, self.seconds, self.calls, self.on = module, Counter(), Counter(), False

    def __getattr__(self, name: str):
        fn = getattr(self.module, name)
        if not callable(fn):
            return fn

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
        return timed


def decode(engine, params, prompt: int, requests: int, rng: random.Random,
           timed: TimedModule | None = None) -> tuple[float, int]:
    """(seconds, steps) of the decode steps of `requests` requests served one at a time;
    `timed` times the kernels' calls of those steps (not of the prefills)."""
    total, steps, vocab = 0.0, 0, min(20000, engine.model_config.vocab_size)
    for _ in range(requests):
        engine.add_request([rng.randrange(vocab // 10, vocab) for _ in range(prompt)], params)
        engine.step()  # the prefill
        if timed is not None:
            timed.on = True
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
            steps += 1
        total += time.perf_counter() - start
        if timed is not None:
            timed.on = False
    return total, steps


def measure(args) -> dict:
    from kernels import cpu
    from services.compute.backend import build_engine
    from shared.config import EngineConfig
    from shared.sampling import SamplingParams
    from shared.settings import with_settings

    engine = build_engine(with_settings(EngineConfig(), model=args.model,
                                        kv_cache_tokens=args.prompt + args.tokens + 64,
                                        max_running=1))
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True,
                            **({"temperature": 0.7, "top_p": 0.9} if args.sampled else
                               {"temperature": 0.0}))
    rng = random.Random(0)
    decode(engine, params, args.prompt, 1, rng)  # warm-up
    plain = cpu.extension()
    if plain is None:
        raise SystemExit("the C++ CPU kernels are not loaded here: nothing to time")
    steps, kernels, calls, per = [], [], 0.0, Counter()
    for r in range(args.rounds):
        seconds, n = decode(engine, params, args.prompt, args.requests, rng)
        steps.append(seconds / n * 1e3)
        timed = cpu._state["module"] = TimedModule(plain)
        try:
            _, n = decode(engine, params, args.prompt, args.requests, rng, timed)
        finally:
            cpu._state["module"] = plain
        kernels.append(sum(timed.seconds.values()) / n * 1e3)
        calls = sum(timed.calls.values()) / n
        per = Counter({k: v / n * 1e3 for k, v in timed.seconds.items()})
        log(f"round {r + 1}: step {steps[-1]:.2f} ms, kernels {kernels[-1]:.2f} ms")
    step, kernel = statistics.median(steps), statistics.median(kernels)
    return {"step_ms": round(step, 3), "kernel_ms": round(kernel, 3),
            "host_ms": round(step - kernel, 3), "host_share": round(1 - kernel / step, 3),
            "calls": round(calls, 1), "sampled": args.sampled,
            "kernels_ms": {k: round(v, 3) for k, v in per.most_common()}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the default model's GGUF")
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--requests", type=int, default=4, help="per round and variant")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sampled", action="store_true", help="temperature 0.7, top_p 0.9")
    args = p.parse_args(argv)
    if args.model is None:
        from shared import default_model

        args.model = str(default_model.fetch())
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    where = machine()
    print(f"machine: {where}; model {Path(args.model).name}; {args.prompt} in, "
          f"{args.tokens} out, one request at a time")
    out = {"machine": where, **measure(args)}
    print(f"decode step {out['step_ms']:.2f} ms: kernels {out['kernel_ms']:.2f} ms "
          f"({out['calls']:.0f} calls), host {out['host_ms']:.2f} ms "
          f"({100 * out['host_share']:.0f}%)")
    for name, ms in out["kernels_ms"].items():
        print(f"  {name:24s} {ms:7.3f} ms")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
