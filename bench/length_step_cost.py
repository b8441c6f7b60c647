"""What the hidden-state length head costs a step: its own work against the step it rides on.

The engine (SmolLM2 by default, in-process) decodes a batch of `--batch` requests, each
replaced by a new one when it finishes (output lengths 32..96), so requests finish during the
timed steps. Timed where it runs, on the step path: the runner's probe of the checkpoint rows
(`_probe`, inside launch), the refiner's checkpoint handling in commit (`_observe_lengths`,
including the heads' predictions), `finished` and `tick`; off it, in the refiner's worker
thread: adding up what finished requests taught, pushing it and re-solving (`_sync`, at the
served intervals). Heads are learned before timing, so every checkpoint predicts. The ratios
are hook time / step time, both measured in the same run. `--every 1` is the worst case:
served, a request is a checkpoint once in 32 steps.

    python -m bench.length_step_cost [--batch 64] [--steps 64] [--every 32] [--model PATH]

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import time

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
    p.add_argument("--steps", type=int, default=64, help="decode steps timed")
    p.add_argument("--every", type=int, default=32, help="checkpoint interval (served: 32)")
    p.add_argument("--refine-probe-dim", type=int, default=0,
                   help="--length-refine-probe-dim (0: the default)")
    args = p.parse_args(argv)
    model = args.model or default_model.resolve()
    engine = build_engine(EngineConfig(
        model=model, max_running=args.batch, kv_cache_gib=1.0, hidden_length=True,
        length_refine_every=args.every, length_refine_probe_dim=args.refine_probe_dim))
    lengths, runner = engine.lengths, engine.runner
    warm = SamplingParams(max_tokens=args.every + 8, temperature=0.0, ignore_eos=True)
    lengths.config = RefinerConfig(every=args.every, min_requests=4)
    engine.generate([[1, 2, 3, 4 + i] for i in range(8)], warm)  # the heads learn
    lengths.flush()
    assert set(lengths.heads) == {"prefill", "refine"}
    hook: list[float] = []
    worker: list[float] = []
    runner._probe = timed(runner._probe, hook)
    engine._observe_lengths = timed(engine._observe_lengths, hook)
    lengths.finished = timed(lengths.finished, hook)
    lengths.tick = timed(lengths.tick, hook)
    lengths._sync = timed(lengths._sync, worker)
    rng = random.Random(0)

    def add() -> None:
        engine.add_request([1, rng.randrange(5, 500), 7, 9], SamplingParams(
            max_tokens=rng.randrange(32, 97), temperature=0.0, ignore_eos=True))

    for _ in range(args.batch):
        add()
    for _ in range(4):  # prefill and warm-up
        engine.step()
    hook.clear()
    worker.clear()
    steps, learned = [], lengths.learned
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        for _ in range(args.batch - len(engine.requests)):
            add()
    lengths._wait()  # the sync in flight counts
    finished = lengths.learned - learned
    step_ms = 1e3 * sum(steps) / len(steps)
    hook_ms = 1e3 * sum(hook) / len(steps)
    worker_ms = 1e3 * sum(worker) / len(steps)
    out = {"machine": machine(), "model": model, "batch": args.batch, "every": args.every,
           "probe_dims": list(runner.probe_dims), "steps": args.steps, "finished": finished,
           "step_ms": round(step_ms, 3), "hook_ms": round(hook_ms, 4),
           "worker_ms": round(worker_ms, 4), "predictions": lengths.predictions,
           "hook_share": round(hook_ms / step_ms, 5),
           "worker_share": round(worker_ms / step_ms, 5)}
    print(f"decode step at batch {args.batch}: {step_ms:.2f} ms; {finished} requests finished "
          f"in {args.steps} steps; the length hook (checkpoint every {args.every} tokens, "
          f"probes {runner.probe_dims}): on the step path {hook_ms:.3f} ms = "
          f"{100 * hook_ms / step_ms:.2f}% of the step; in its worker {worker_ms:.3f} ms a "
          f"step = {100 * worker_ms / step_ms:.2f}%")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
