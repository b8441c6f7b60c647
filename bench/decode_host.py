"""Where a decode step's time goes, in process: the C++ kernels' calls against the rest (Python,
torch's dispatch and allocations, OpenMP's fork and join), one sequence (or --batch) at a time.

An engine on --model (default: SmolLM2's GGUF, its INT4 blocks) runs --requests groups of
--batch requests (default 1) of --prompt random tokens and --tokens decode steps each, a group
at a time, in two variants: the layers as LlamaModel's Python loop ("loop") and as one C++ call
("fused", pipellm/services/compute/model/fused_decode.py; where the model takes it), in turn each
round. Each variant's rounds alternate between plain steps (their wall time is the step) and steps
whose calls into the C++ module are timed one by one (their sum is the kernels' time; a timing
wrapper costs ~1 us a call, outside the sum). host = step - kernels; "calls" are the module's
calls per step.

    python -m bench.decode_host [--model PATH] [--rounds 3] [--requests 4] [--batch 1]
                                [--sampled]

The last line printed is JSON: {"loop": {"step_ms", "kernel_ms", "host_ms", "host_share",
"calls", "kernels_ms"}, "fused": {...}, "speedup": loop step / fused step, ...} (medians over
rounds; "kernels_ms", each function's ms a step, from the last round).
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
           timed: TimedModule | None = None, batch: int = 1) -> tuple[float, int]:
    """(seconds, steps) of the decode steps of `requests` groups of `batch` requests, a group
    at a time (its prefills first, then its decode steps together); `timed` times the kernels'
    calls of those steps (not of the prefills)."""
    total, steps, vocab = 0.0, 0, min(20000, engine.model_config.vocab_size)
    for _ in range(requests):
        for _ in range(batch):
            engine.add_request([rng.randrange(vocab // 10, vocab) for _ in range(prompt)],
                               params)
        while any(s.num_output == 0 for s in engine.requests.values()):
            engine.step()  # the prefills
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
    """Rounds of each variant in turn: the layer loop (LlamaModel._layers, its kernels timed
    in a second pass) and, where the model takes it, the fused call (model/fused_decode.py)."""
    from pipellm.kernels import cpu
    from pipellm.services.compute.backend import build_engine
    from pipellm.shared.config import EngineConfig
    from pipellm.shared.sampling import SamplingParams
    from pipellm.shared.settings import with_settings

    engine = build_engine(with_settings(EngineConfig(), model=args.model,
                                        kv_cache_tokens=(args.prompt + args.tokens + 64)
                                        * args.batch, max_running=args.batch))
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True,
                            **({"temperature": 0.7, "top_p": 0.9} if args.sampled else
                               {"temperature": 0.0}))
    rng = random.Random(0)
    decode(engine, params, args.prompt, 1, rng, batch=args.batch)  # warm-up
    plain = cpu.extension()
    if plain is None:
        raise SystemExit("the C++ CPU kernels are not loaded here: nothing to time")
    model = engine.runner.model
    fused = getattr(model, "fused", None)
    variants = {"loop": None, **({"fused": fused} if fused is not None else {})}
    rounds = {name: {"step": [], "kernel": []} for name in variants}
    calls, per = {}, {}
    for r in range(args.rounds):
        for name, variant in variants.items():
            model.fused = variant
            seconds, n = decode(engine, params, args.prompt, args.requests, rng,
                                batch=args.batch)
            rounds[name]["step"].append(seconds / n * 1e3)
            timed = cpu._state["module"] = TimedModule(plain)
            try:
                _, n = decode(engine, params, args.prompt, args.requests, rng, timed,
                              args.batch)
            finally:
                cpu._state["module"] = plain
            rounds[name]["kernel"].append(sum(timed.seconds.values()) / n * 1e3)
            calls[name] = sum(timed.calls.values()) / n
            per[name] = Counter({k: v / n * 1e3 for k, v in timed.seconds.items()})
            log(f"round {r + 1}, {name}: step {rounds[name]['step'][-1]:.2f} ms, "
                f"kernels {rounds[name]['kernel'][-1]:.2f} ms")
    model.fused = fused
    out = {name: _summary(rounds[name], calls[name], per[name]) for name in variants}
    if "fused" in out:
        out["speedup"] = round(out["loop"]["step_ms"] / out["fused"]["step_ms"], 3)
    return {**out, "sampled": args.sampled, "batch": args.batch}


def _summary(rounds: dict, calls: float, per: Counter) -> dict:
    step, kernel = statistics.median(rounds["step"]), statistics.median(rounds["kernel"])
    return {"step_ms": round(step, 3), "kernel_ms": round(kernel, 3),
            "host_ms": round(step - kernel, 3), "host_share": round(1 - kernel / step, 3),
            "calls": round(calls, 1), "kernels_ms": {k: round(v, 3) for k, v in per.most_common()}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the default model's GGUF")
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--requests", type=int, default=4, help="groups per round and variant")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sampled", action="store_true", help="temperature 0.7, top_p 0.9")
    args = p.parse_args(argv)
    if args.model is None:
        from pipellm.shared import default_model

        args.model = str(default_model.fetch())
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    where = machine()
    print(f"machine: {where}; model {Path(args.model).name}; {args.prompt} in, "
          f"{args.tokens} out, {args.batch} request(s) at a time")
    out = {"machine": where, **measure(args)}
    for name in ("loop", "fused"):
        if name in out:
            v = out[name]
            print(f"{name}: decode step {v['step_ms']:.2f} ms: kernels {v['kernel_ms']:.2f} ms "
                  f"({v['calls']:.0f} calls), host {v['host_ms']:.2f} ms "
                  f"({100 * v['host_share']:.0f}%)")
            for kernel, ms in v["kernels_ms"].items():
                print(f"  {kernel:24s} {ms:7.3f} ms")
    if "speedup" in out:
        print(f"fused / loop: {out['speedup']:.3f}x")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
