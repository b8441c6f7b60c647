"""torch.compile of the CPU forward pass: does it pay on pipellm's default path?

Two in-process engines on the default model (SmolLM2's GGUF, INT4 blocks with int8 activations:
what `pipellm serve` runs), identical but for the model's `forward_hidden`: eager, or wrapped
in `torch.compile(dynamic=True)` (Inductor, vLLM's CPU backend's choice). Each engine runs, in
turns, `--rounds` times:

    b1      decode steps with one running request (TPOT at batch 1)
    b16     decode steps with 16 running requests
    prefill one 200-token prompt, one output token (TTFT's model part)

Reported: mean ms per step of each engine, the ratio compiled / eager (below 1: compile pays),
the compile's own time (first calls of each shape), and how many graphs Dynamo made and broke
(the C++ kernels are opaque calls to it: each is a graph break). The last line is one JSON
object.

    python -m bench.cpu_compile [--rounds 3] [--steps 32] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import log, machine  # noqa: E402
from bench.length_step_cost import Stream, kv_tokens  # noqa: E402
from pipellm.services.compute.backend import build_engine  # noqa: E402
from pipellm.shared import default_model  # noqa: E402
from pipellm.shared.config import EngineConfig, SchedulerConfig  # noqa: E402
from pipellm.shared.sampling import SamplingParams  # noqa: E402


def engine(model: str, batch: int, compiled: bool):
    e = build_engine(EngineConfig(model=model, scheduler=SchedulerConfig(max_running=batch),
                                  kv_cache_tokens=kv_tokens(model, 0.5)))
    if compiled:
        torch._dynamo.config.recompile_limit = 64  # its best chance: no eager fallback at 8
        m = e.runner.model
        m.forward_hidden = torch.compile(m.forward_hidden, dynamic=True)
    return e


def prefill_ms(e, length: int = 200, times: int = 2) -> float:
    """Mean ms of a `length`-token prompt's prefill + first token, alone in the engine."""
    out = []
    for i in range(times):
        prompt = [1] + [(7 * j + i) % 400 + 5 for j in range(length - 1)]
        t = time.perf_counter()
        e.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.mean(out)


def decode_ms(stream: Stream, steps: int) -> float:
    return 1e3 * stream.run(steps) / steps


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="default: the project's default model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=32, help="decode steps a round")
    args = p.parse_args(argv)
    model = args.model or default_model.resolve()
    mach = machine()
    engines = {}
    compile_s = {}
    for name in ("eager", "compiled"):
        t = time.perf_counter()
        one = engine(model, 1, name == "compiled")  # prefill: alone in its engine
        streams = {f"b{b}": Stream(engine(model, b, name == "compiled"), b) for b in (1, 16)}
        for s in streams.values():
            s.run(4)  # first shapes (compiles those of the compiled engine)
        prefill_ms(one, times=1)
        compile_s[name] = round(time.perf_counter() - t, 1)
        engines[name] = (streams, one)
        log(f"{name}: built and warmed in {compile_s[name]} s")
    ms = {name: {"b1": [], "b16": [], "prefill": []} for name in engines}
    for r in range(args.rounds):
        for name, (streams, one) in engines.items():
            ms[name]["b1"].append(decode_ms(streams["b1"], args.steps))
            ms[name]["b16"].append(decode_ms(streams["b16"], args.steps))
            ms[name]["prefill"].append(prefill_ms(one))
            log(f"round {r + 1}: {name} " + ", ".join(f"{k} {v[-1]:.2f} ms"
                                                      for k, v in ms[name].items()))
    med = {n: {k: round(statistics.median(v), 3) for k, v in d.items()} for n, d in ms.items()}
    ratio = {k: round(med["compiled"][k] / med["eager"][k], 3) for k in med["eager"]}
    counters = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()
                if k in ("stats", "graph_break")}
    breaks = sum(counters.get("graph_break", {}).values())
    print(f"\n{'':10} {'b1 ms/step':>12} {'b16 ms/step':>12} {'prefill 200 ms':>15}")
    for n in med:
        print(f"{n:10} {med[n]['b1']:12.2f} {med[n]['b16']:12.2f} {med[n]['prefill']:15.1f}")
    print(f"{'ratio':10} {ratio['b1']:12.3f} {ratio['b16']:12.3f} {ratio['prefill']:15.3f}"
          f"   (compiled / eager; below 1 pays)")
    print(f"build + warm-up: eager {compile_s['eager']} s, compiled {compile_s['compiled']} s; "
          f"graph breaks {breaks}")
    out = dict(median_ms=med, ratio=ratio, warmup_s=compile_s, graph_breaks=breaks,
               rounds=args.rounds, steps=args.steps, model=str(model), machine=mach)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
