"""Speculative decoding on a modelled GPU: what the simulator's roofline cost model
(pipellm/services/compute/sim/cost.py) says a draft model buys, Llama-3-8B with a Llama-3.2-1B draft
on an H100 in bf16 (and n-gram drafts, which cost no draft steps), against plain decoding.

One speculative step of a batch of B sequences at context `ctx`, k drafts each:
    draft:  k decode steps of the draft model (its first one also takes in the tokens the
            last verify accepted: E rows a sequence instead of 1)
    verify: one target step of B (k + 1) decode rows, row j of a sequence attending ctx + j
            keys (pipellm's verify: pipellm/services/compute/batch.py)
and it yields E = (1 - a^(k+1)) / (1 - a) tokens a sequence when each draft is accepted with
probability a, independently (Leviathan et al.'s expectation). Speed-up = E x plain step time
/ (verify + draft time). The cost model's efficiency factors and per-step overhead are its
defaults unless set (--eff-bw, --overhead-ms: a CUDA-graph decode step has less overhead than
the default 1 ms).

    python -m bench.spec_sim [--gpu h100] [--target llama-3-8b] [--draft llama-3.2-1b]
        [--ctx 1024] [--overhead-ms 1.0] [--eff-bw 0.8]

The last line printed is one JSON object with the headline figures (the best k and its
speed-up per batch and acceptance rate).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/spec_sim.py`
    sys.path.insert(0, str(ROOT))

from pipellm.services.compute.sim.cost import CostModel  # noqa: E402

BATCHES, RATES, KS = (1, 8, 32, 128), (0.5, 0.7, 0.9), range(1, 9)


def expected_tokens(a: float, k: int) -> float:
    """Tokens a sequence gets from one verify of k drafts, each accepted with probability a."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def speedup(target: CostModel, draft: CostModel | None, batch: int, ctx: int, a: float,
            k: int) -> float:
    """Tokens per second with speculation / without, for one (batch, ctx, a, k)."""
    plain = target.step_time([ctx] * batch)
    verify = target.step_time([ctx + j for _ in range(batch) for j in range(k + 1)])
    e = expected_tokens(a, k)
    drafting = 0.0
    if draft is not None:  # catch-up of the accepted tokens, then k - 1 single-token steps
        catch_up = [ctx + j for _ in range(batch) for j in range(round(e))]
        drafting = draft.step_time(catch_up) + (k - 1) * draft.step_time([ctx] * batch)
    return e * plain / (verify + drafting)


def table(args: argparse.Namespace) -> dict:
    kw = dict(eff_bw=args.eff_bw, overhead_s=args.overhead_ms / 1e3)
    target = CostModel(args.gpu, args.target, **kw)
    draft = CostModel(args.gpu, args.draft, **kw)
    out = {}
    for name, d in ((f"draft {args.draft}", draft), ("n-gram", None)):
        rows = {}
        for b in BATCHES:
            for a in RATES:
                best = max(KS, key=lambda k: speedup(target, d, b, args.ctx, a, k))
                rows[f"b{b} a{a}"] = {"k": best, "speedup": round(
                    speedup(target, d, b, args.ctx, a, best), 3)}
        out[name] = rows
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="h100")
    p.add_argument("--target", default="llama-3-8b")
    p.add_argument("--draft", default="llama-3.2-1b")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--overhead-ms", type=float, default=1.0)
    p.add_argument("--eff-bw", type=float, default=0.8)
    args = p.parse_args(argv)
    result = table(args)
    print(f"{args.target} on {args.gpu}, context {args.ctx}, bf16; best k and speed-up over "
          f"plain decoding, per batch and draft acceptance rate a")
    for name, rows in result.items():
        print(f"  {name}:")
        for b in BATCHES:
            cells = "  ".join(f"a={a}: k={rows[f'b{b} a{a}']['k']} "
                              f"x{rows[f'b{b} a{a}']['speedup']:.2f}" for a in RATES)
            print(f"    batch {b:>3}  {cells}")
    headline = {"gpu": args.gpu, "target": args.target, "draft": args.draft, "ctx": args.ctx,
                "overhead_ms": args.overhead_ms, "eff_bw": args.eff_bw, "best": result}
    print(json.dumps(headline))
    return headline


if __name__ == "__main__":
    main()
