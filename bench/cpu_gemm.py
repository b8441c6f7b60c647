"""The CPU GEMMs of one SmolLM2-135M step, per weight format, at the row counts a step has
(M = 1 is a single decode, 200 a prompt): the default INT4 path (W4A8 blocks,
pipellm/kernels/cpu/block_gemm.cpp) in every variant this CPU runs (avx2, avx2_vnni, avx512,
avx512_vnni: the same build, the variant switched in process) against PyTorch's own CPU int4
kernel (bf16 activations, what a CPU without the block GEMMs runs) and the float layers
(oneDNN-packed bf16 and fp32, `model/linear/dense.py`; on an AMX CPU, bf16 is what the `amx`
level runs for steps with many rows, `model/linear/amx.py`) and `--quantization w8a8`'s layer
(per-channel INT8 weights, activations per token: `torch._int_mm` with VNNI, else the block
GEMMs); the LM head as Q8 blocks (the default under int4) in every variant against the fp32 and
bf16 heads.

The projections are the model's: q/k/v fused [960, 576], o [576, 576], gate/up fused
[3072, 576], down [576, 1536], 30 distinct copies of each (random weights, std 0.02) so that
they stream from memory as a real step's do; the head is [49152, 576], HEAD_COPIES copies taken in
turn for the same reason (one Q8 head, 30 MB, stays in a 32 MB L3 between two calls; in a step
the layers pass between two heads). Median of --reps calls
of the whole set, after two warm-up calls; "speed" = baseline ms / block-GEMM ms, per variant.
"prefetch" = each variant's ms with no prefetch / with --prefetch bytes (default: what its level
takes, pipellm/kernels/cpu/block_gemm.cpp) for the pass that streams the weights, the two timed in
turn.

    python -m bench.cpu_gemm [--rows 1,4,16,64,200] [--reps 7] [--activations bfloat16] [--quick]

The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/cpu_gemm.py`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import machine  # noqa: E402
from pipellm.kernels.cpu import isa  # noqa: E402
from pipellm.kernels.dispatch import block_gemm_extension  # noqa: E402
from pipellm.kernels.int4_cpu import pack_int4_cpu  # noqa: E402
from pipellm.kernels.int4_gemm import int4_gemm, prepare_int4  # noqa: E402
from pipellm.kernels.int4_weight import quantize_int4  # noqa: E402
from pipellm.services.compute.model.linear import Linear, Q8Linear  # noqa: E402
from pipellm.services.compute.model.linear.w8a8 import W8A8Linear  # noqa: E402

BASELINES = ("int4-torch", "bf16", "fp32", "w8a8")

PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in], one layer
LAYERS, HEAD, HEAD_COPIES = 30, (49152, 576), 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,64,200", help="activation rows M, comma-separated")
    p.add_argument("--reps", type=int, default=7, help="timed calls per case (median)")
    p.add_argument("--activations", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the activations every column is given (casts are timed)")
    p.add_argument("--prefetch", type=int, default=-1,
                   help="bytes ahead the prefetch column runs (-1: each level's own)")
    p.add_argument("--quick", action="store_true", help="2 layers, M = 1 and 4, 2 reps")
    return p.parse_args(argv)


def median_ms(fn, reps: int) -> float:
    fn(), fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def at_level(level: str, fn):
    """`fn` run with the block GEMMs at ISA `level`."""
    ext = block_gemm_extension(torch.empty(0))

    def call(*args):
        ext.set_block_gemm_isa(level)
        return fn(*args)

    return call


def projection_layers(layers: int, levels: tuple[str, ...]) -> dict[str, list]:
    """Per format, every projection of `layers` layers as (callable, in_features)."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, list] = {f"int4-{lv}": [] for lv in levels}
    out |= {f: [] for f in BASELINES}
    for _ in range(layers):
        for n, k in PROJECTIONS:
            w = torch.randn(n, k, generator=g) * 0.02
            w4 = quantize_int4(w, 32)
            p4, pt = prepare_int4(w4), pack_int4_cpu(w4)
            for lv in levels:
                out[f"int4-{lv}"].append((lambda x, p=p4: int4_gemm(x, p), k))
            out["int4-torch"].append((lambda x, p=pt: int4_gemm(x, p), k))
            bf16, fp32, w8 = Linear(w.bfloat16()), Linear(w), W8A8Linear(w)
            out["bf16"].append((lambda x, f=bf16: f(x.bfloat16()), k))
            out["fp32"].append((lambda x, f=fp32: f(x.float()), k))
            out["w8a8"].append((lambda x, f=w8: f(x.float()), k))
    return out


def heads(levels: tuple[str, ...]) -> dict[str, object]:
    """Per format, a callable that runs the next of HEAD_COPIES distinct heads."""
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(*HEAD, generator=g) * 0.02 for _ in range(HEAD_COPIES)]
    q8 = in_turn([Q8Linear(w) for w in ws])
    bf16, fp32 = in_turn([Linear(w.bfloat16()) for w in ws]), in_turn([Linear(w) for w in ws])
    return {**{f"q8-{lv}": at_level(lv, q8) for lv in levels},
            "bf16": lambda x: bf16(x.bfloat16()), "fp32": lambda x: fp32(x.float())}


def with_prefetch(nbytes: int, fn):
    """`fn` run with the block GEMMs prefetching `nbytes` ahead (-1: the level's own)."""
    ext = block_gemm_extension(torch.empty(0))

    def call(*args):
        ext.set_block_gemm_prefetch(nbytes)
        try:
            return fn(*args)
        finally:
            ext.set_block_gemm_prefetch(-1)

    return call


def prefetch_gain(fn, nbytes: int, reps: int) -> float:
    """`fn`'s ms without prefetch / with `nbytes`', medians of the two timed in turn."""
    off, on = with_prefetch(0, fn), with_prefetch(nbytes, fn)
    off(), on()
    times: dict = {off: [], on: []}
    for _ in range(reps):
        for f in (off, on):
            t = time.perf_counter()
            f()
            times[f].append(time.perf_counter() - t)
    return round(statistics.median(times[off]) / statistics.median(times[on]), 2)


def in_turn(layers: list):
    """A callable that runs `layers` one per call, in turn."""
    turn = itertools.cycle(layers)
    return lambda x: next(turn)(x)


def ratios(times: dict[str, float], levels: tuple[str, ...], prefix: str) -> dict[str, float]:
    """baseline ms / block-GEMM ms for every (level, baseline) pair."""
    return {f"{lv}/{f}": round(times[f] / times[f"{prefix}-{lv}"], 2)
            for lv in levels for f in times if not f.startswith(prefix)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if block_gemm_extension(torch.empty(0)) is None:
        sys.exit("the C++ block GEMMs do not run here (python -m pipellm.kernels.cpu says why)")
    levels = isa.variants()  # the block GEMMs' variants this CPU runs (isa.py)
    rows = [1, 4] if args.quick else [int(r) for r in args.rows.split(",")]
    reps = 2 if args.quick else args.reps
    layers = projection_layers(2 if args.quick else LAYERS, levels)
    layers = {f: [(at_level(f[5:], fn) if f[5:] in levels else fn, k) for fn, k in fs]
              for f, fs in layers.items()}
    head = heads(levels)
    print(f"{machine()}; ISA {isa.describe()}; {len(layers['fp32'])} projections; "
          f"{args.activations} activations")
    print(f"{'M':>4} {'set':<12} " + " ".join(f"{f:>16}" for f in layers))
    result = {}
    for m in rows:
        dtype = getattr(torch, args.activations)
        xs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in layers["fp32"]}}
        proj = {f: median_ms(lambda fs=fs, xs=xs: [fn(xs[k]) for fn, k in fs], reps)
                for f, fs in layers.items()}
        xh = torch.randn(m, HEAD[1]).to(dtype)
        hd = {f: median_ms(lambda fn=fn, xh=xh: fn(xh), reps) for f, fn in head.items()}
        speed, hspeed = ratios(proj, levels, "int4"), ratios(hd, levels, "q8")
        pf = {f"int4-{lv}": prefetch_gain(lambda fs=layers[f"int4-{lv}"], xs=xs:
                                          [fn(xs[k]) for fn, k in fs], args.prefetch, reps)
              for lv in levels}
        pf |= {f"q8-{lv}": prefetch_gain(lambda fn=head[f"q8-{lv}"], xh=xh: fn(xh),
                                         args.prefetch, reps) for lv in levels}
        print(f"{m:>4} {'projections':<12} " + " ".join(f"{v:>13.2f} ms" for v in proj.values()))
        print(f"{'':>4} {'  speed':<12} " + ", ".join(f"{f} {s}x" for f, s in speed.items()))
        print(f"{m:>4} {'LM head':<12} " + ", ".join(f"{f} {v:.2f} ms" for f, v in hd.items()))
        print(f"{'':>4} {'  speed':<12} " + ", ".join(f"{f} {s}x" for f, s in hspeed.items()))
        print(f"{'':>4} {'prefetch':<12} " + ", ".join(f"{f} {g}x" for f, g in pf.items()))
        result[m] = {"projections_ms": {f: round(v, 2) for f, v in proj.items()},
                     "head_ms": {f: round(v, 2) for f, v in hd.items()},
                     "speed": speed, "head_speed": hspeed, "prefetch_gain": pf}
    print(json.dumps({"machine": machine(), "isa": isa.describe(),
                      "activations": args.activations, "prefetch": args.prefetch,
                      "rows": result}))


if __name__ == "__main__":
    main()
