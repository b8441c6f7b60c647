"""What the hidden-state length head costs a step: its own work against the step it rides on.

The engine (SmolLM2 by default, in-process) decodes a batch of `--batch` requests; the hook's
work is timed where it runs: the probe projection of the sampled rows (inside the runner's
launch, timed here on the same shapes), the refiner's checkpoint handling in commit
(`_observe_lengths`, including the head's prediction) and `tick` (pushes and re-solves), with
a head already learned so that every checkpoint predicts. The ratio is hook time / step time,
both measured in the same run. Every request's checkpoint interval is 1 here (`--every`), the
worst case: served, a request is a checkpoint once in 32 steps.

    python -m bench.length_step_cost [--batch 64] [--steps 32] [--model PATH]

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.common import machine
from services.compute.backend import build_engine
from services.compute.length.refiner import RefinerConfig
from shared import default_model
from shared.config import EngineConfig
from shared.sampling import SamplingParams


def timed(fn, sink: list[float]):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sink.append(time.perf_counter() - t)
    return wrapper


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="default: SmolLM2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--every", type=int, default=1, help="checkpoint interval (served: 32)")
    args = p.parse_args(argv)
    model = args.model or default_model.resolve()
    engine = build_engine(EngineConfig(model=model, max_running=args.batch, kv_cache_gib=1.0,
                                       hidden_length=True))
    lengths = engine.lengths
    lengths.config = RefinerConfig(every=args.every, min_requests=4, push_s=0, refresh_s=0)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.generate([[1, 2, 3, 4 + i] for i in range(8)], warm)  # the head learns
    lengths.tick()
    assert set(lengths.heads) == {"prefill", "refine"}
    hook: list[float] = []
    engine._observe_lengths = timed(engine._observe_lengths, hook)
    lengths.tick = timed(lengths.tick, hook)
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request([1, 5 + i % 50, 7, 9], params)
    for _ in range(4):  # prefill and warm-up
        engine.step()
    hook.clear()
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    hidden = engine.runner.model_config.hidden_size
    h = torch.randn(args.batch, hidden, device=engine.runner.device)
    proj = []
    for _ in range(args.steps):
        t = time.perf_counter()
        (h.float() @ engine.runner.probe).cpu()
        proj.append(time.perf_counter() - t)
    step_ms = 1e3 * sum(steps) / len(steps)
    hook_ms = 1e3 * (sum(hook) + sum(proj)) / len(steps)
    out = {"machine": machine(), "model": model, "batch": args.batch, "every": args.every,
           "step_ms": round(step_ms, 3), "hook_ms": round(hook_ms, 4),
           "projection_ms": round(1e3 * sum(proj) / len(proj), 4),
           "predictions": lengths.predictions, "hook_share": round(hook_ms / step_ms, 5)}
    print(f"decode step at batch {args.batch}: {step_ms:.2f} ms; the length hook "
          f"(checkpoint every {args.every} tokens): {hook_ms:.3f} ms = "
          f"{100 * hook_ms / step_ms:.2f}% of the step")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
