"""What the hidden-state length head costs a step, measured two ways in the same run.

Two engines on the same model (SmolLM2 by default, in-process), one with the hook
(`--hidden-length`) and one without, decode the same stream of requests at batch `--batch`:
each request is replaced when it finishes (output lengths 32..96), so requests finish, and
the hook learns, during the timed steps. They take turns, `--rounds` times `--steps` steps
each, and their mean step times give the slowdown: everything the hook costs, including its
worker thread competing for the cores. Beside it, the hook's own work in the engine with it:
on the step path, the runner's probe of the checkpoint rows (`_probe`), the refiner's
checkpoint handling in commit (`_observe_lengths`, with the heads' predictions), `finished`
and `tick`; off it, in the refiner's worker thread, adding up what finished requests taught,
pushing it and re-solving (`_sync`, at the served intervals; wall time, so it includes
waiting for the cores). Heads are learned before timing, so every checkpoint predicts.
`--every 1` is the worst case: served, a request is a checkpoint once in 32 steps.

    python -m bench.length_step_cost [--batch 64] [--steps 32] [--rounds 3] [--every 32]
                                     [--warmup 4]

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace

import torch

from bench.common import machine
from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.kv.kv_cache import KVCache
from pipellm.shared import default_model
from pipellm.shared.config import EngineConfig, SchedulerConfig
from pipellm.shared.model_config import ModelConfig
from pipellm.shared.sampling import SamplingParams


def timed(fn, sink: list[float]):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sink.append(time.perf_counter() - t)
    return wrapper


class Stream:
    """An engine kept at `batch` running requests, the same request sequence for every engine."""

    def __init__(self, engine, batch: int):
        self.engine, self.batch, self.rng = engine, batch, random.Random(0)
        self.refill()

    def refill(self) -> None:
        for _ in range(self.batch - len(self.engine.requests)):
            self.engine.add_request([1, self.rng.randrange(5, 500), 7, 9], SamplingParams(
                max_tokens=self.rng.randrange(32, 97), temperature=0.0, ignore_eos=True))

    def run(self, steps: int) -> float:
        """Seconds for `steps` steps (refilling between them)."""
        total = 0.0
        for _ in range(steps):
            t = time.perf_counter()
            self.engine.step()
            total += time.perf_counter() - t
            self.refill()
        lengths = self.engine.lengths
        if lengths is not None:  # the worker's job in flight is this engine's time
            t = time.perf_counter()
            lengths.wait()
            total += time.perf_counter() - t
        return total


def kv_tokens(model: str, gib: float) -> int:
    """--kv-cache-gib as KV slots, on a CPU and a GPU alike (sized from memory, each engine on
    a GPU would take 90% of it)."""
    cfg = ModelConfig.from_path(model)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return int(gib * 2**30 // KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads,
                                                      cfg.head_dim, dtype))


def with_hook(model: str, args) -> tuple:
    """The engine with the hook, its heads learned; its hook's parts timed into (on the step
    path, syncs) lists."""
    engine = build_engine(EngineConfig(
        model=model, scheduler=SchedulerConfig(max_running=args.batch),
        kv_cache_tokens=kv_tokens(model, args.kv_cache_gib),
        hidden_length=True, length_refine_every=args.every, length_probe_dim=args.probe_dim))
    lengths, runner = engine.lengths, engine.runner
    lengths.config = replace(lengths.config, min_requests=4,
                             background={"auto": lengths.config.background, "on": True,
                                         "off": False}[args.worker])
    warm = SamplingParams(max_tokens=args.every + 8, temperature=0.0, ignore_eos=True)
    engine.generate([[1, 2, 3, 4 + i] for i in range(8)], warm)
    lengths.flush()
    assert set(lengths.heads) == {"prefill", "refine"}
    hook: list[float] = []
    sync: list[float] = []
    runner._probe = timed(runner._probe, hook)
    engine._observe_lengths = timed(engine._observe_lengths, hook)
    lengths.finished = timed(lengths.finished, hook)
    lengths.tick = timed(lengths.tick, hook)
    lengths._sync = timed(lengths._sync, sync)
    return engine, hook, sync


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="default: SmolLM2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="each engine's")
    p.add_argument("--steps", type=int, default=32, help="decode steps a round")
    p.add_argument("--rounds", type=int, default=3, help="turns each engine takes")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (on CUDA: enough "
                   "for the graphs of every batch size the rounds meet)")
    p.add_argument("--every", type=int, default=32, help="checkpoint interval (served: 32)")
    p.add_argument("--worker", choices=("auto", "on", "off"), default="auto",
                   help="sync in a worker thread (auto: the engine's choice, on)")
    p.add_argument("--probe-dim", type=int, default=0,
                   help="--length-probe-dim (0: the default)")
    args = p.parse_args(argv)
    model = args.model or default_model.resolve()
    on, hook, sync = with_hook(model, args)
    off = build_engine(EngineConfig(model=model, scheduler=SchedulerConfig(max_running=args.batch),
                                    kv_cache_tokens=kv_tokens(model, args.kv_cache_gib)))
    streams = {"off": Stream(off, args.batch), "on": Stream(on, args.batch)}
    for stream in streams.values():
        stream.run(args.warmup)  # prefill and warm-up
    hook.clear()
    sync.clear()
    learned = on.lengths.learned
    seconds = {name: [] for name in streams}
    for _ in range(args.rounds):
        for name, stream in streams.items():
            seconds[name].append(stream.run(args.steps))
    n = args.rounds * args.steps
    step_ms = {name: 1e3 * sum(v) / n for name, v in seconds.items()}
    hook_ms, sync_ms = 1e3 * sum(hook) / n, 1e3 * sum(sync) / n
    slowdown = step_ms["on"] / step_ms["off"] - 1
    background = on.lengths.config.background
    out = {"machine": machine(), "model": model, "batch": args.batch, "every": args.every,
           "worker": background, "probe_dim": on.runner.probe_dim, "steps": n,
           "finished": on.lengths.learned - learned,
           "step_ms_off": round(step_ms["off"], 3), "step_ms_on": round(step_ms["on"], 3),
           "rounds_ms": {k: [round(1e3 * x / args.steps, 2) for x in v]
                         for k, v in seconds.items()},
           "slowdown": round(slowdown, 4), "hook_ms": round(hook_ms, 4),
           "sync_ms": round(sync_ms, 4), "predictions": on.lengths.predictions,
           "hook_share": round(hook_ms / step_ms["on"], 5)}
    where = "in its worker thread (wall time)" if background else "inside tick, included above"
    print(f"decode step at batch {args.batch}, checkpoint every {args.every} tokens, probe "
          f"{on.runner.probe_dim}, {out['finished']} requests finished in {n} steps: "
          f"{step_ms['off']:.2f} ms without the hook, {step_ms['on']:.2f} ms with it "
          f"({100 * slowdown:+.2f}%; rounds {out['rounds_ms']}). The hook's own work on the "
          f"step path: {hook_ms:.3f} ms a step ({100 * out['hook_share']:.2f}%); its syncs "
          f"{sync_ms:.3f} ms a step, {where}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
