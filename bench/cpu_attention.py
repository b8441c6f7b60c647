"""The CPU decode attention of one SmolLM2-135M step (9 query heads, 3 KV heads, head_dim 64,
30 layers; --heads for another model's), per code path of pipellm/kernels/cpu/decode_attention.cpp:
the generic code (what INT8 caches and odd head sizes run, and every cache before the
vectorized variants) against the vectorized variant of each ISA level this CPU runs (avx2,
avx512: the same build, the level switched in process), for a batch of sequences decoding at
one context length.

Each of the 30 layers has its own K and V caches (random, in the activations' dtype or
--cache-dtype: float16 under float32 queries is `--kv-cache-dtype float16`) so that they stream
from memory as a real step's do; a "step" is the 30 calls. With a --cache-dtype other than
--dtype, "vs same" times the best path again on caches of the queries' own dtype (the
baseline): its ms / the other cache's ms. Median of --reps steps
after one warm-up; "speed" = generic ms / variant ms, and GB/s = KV bytes read / time.
"spread" times the best path again on the same number of rows spread as ShareGPT's contexts
are (lognormal, tenfold between sequences, in random order): its ms / the equal lengths' ms,
1.0 where the threads share a varied batch evenly.

    python -m bench.cpu_attention [--batches 1,16,64] [--context 250,1000] [--dtype bfloat16]
    python -m bench.cpu_attention --dtype float32 --cache-dtype float16
    python -m bench.cpu_attention --heads 32,32,96 --dtype float32   # Phi-3-mini's heads

The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/cpu_attention.py`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import machine, median_ms  # noqa: E402
from pipellm.kernels.cpu import extension, isa  # noqa: E402

LAYERS = 30
VARIANTS = ("avx2", "avx512")  # the ISA levels with a vectorized variant


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64", help="sequences per step, comma-separated")
    p.add_argument("--context", default="250,1000", help="tokens per sequence, comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--cache-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the caches' (default: --dtype's)")
    p.add_argument("--heads", default="9,3,64",
                   help="query heads, kv heads, head_dim (default SmolLM2-135M's)")
    p.add_argument("--reps", type=int, default=5, help="timed steps per case (median)")
    p.add_argument("--quick", action="store_true", help="batch 4, context 64, 2 layers, 2 reps")
    return p.parse_args(argv)


def step_ms(ext, layers, q, starts, lens, reps: int) -> float:
    def step():
        for k, v in layers:
            ext.decode_attention(q, k, v, starts, lens, q.shape[-1] ** -0.5)
    return median_ms(step, reps)


def make_layers(lens: list[int], heads: list[int], dtype, n_layers: int, seed: int,
                cache_dtype=None):
    """Per layer (K, V) caches (of cache_dtype, default dtype) holding sequences of `lens` back
    to back; q (of dtype), starts, lens. heads: query heads, kv heads, head_dim."""
    g = torch.Generator().manual_seed(seed)
    (n_heads, n_kv, dim), cap, cache_dtype = heads, sum(lens), cache_dtype or dtype
    layers = [(torch.randn(cap, n_kv, dim, generator=g).to(cache_dtype),
               torch.randn(cap, n_kv, dim, generator=g).to(cache_dtype))
              for _ in range(n_layers)]
    q = torch.randn(len(lens), n_heads, dim, generator=g).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    starts = (torch.cumsum(lens_t, 0) - lens_t).to(torch.int32)
    return layers, q, starts, lens_t


def spread_lengths(batch: int, ctx: int, seed: int) -> list[int]:
    """`batch` lengths of total batch * ctx, lognormal (sigma 0.8) as ShareGPT's contexts."""
    g = torch.Generator().manual_seed(seed)
    w = torch.empty(batch).log_normal_(0.0, 0.8, generator=g)
    lens = (w / w.sum() * batch * ctx).round().clamp(min=1).to(torch.int64)
    lens[0] += batch * ctx - int(lens.sum())
    return lens.clamp(min=1).tolist()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    batches = [4] if args.quick else [int(x) for x in args.batches.split(",")]
    contexts = [64] if args.quick else [int(x) for x in args.context.split(",")]
    n_layers, reps = (2, 2) if args.quick else (LAYERS, args.reps)
    ext, dtype = extension(), getattr(torch, args.dtype)
    cache = getattr(torch, args.cache_dtype or args.dtype)
    heads = [int(x) for x in args.heads.split(",")]
    assert ext is not None, \
        "the C++ CPU kernels did not build (python -m pipellm.kernels.cpu says why)"
    here, previous = machine(), ext.block_gemm_isa()
    paths = ["generic"] + [v for v in VARIANTS if v in isa.cpu_levels()]
    print(f"{here}; heads {heads}; {args.dtype} queries, {cache} caches, {n_layers} layers, "
          f"median ms of {reps} steps")
    print(f"{'batch':>5} {'ctx':>5} " + " ".join(f"{p:>16}" for p in paths))
    code = {}  # what each path runs at this head size (a variant may hand it to AVX2's)
    for path in paths:
        ext.set_block_gemm_isa("" if path == "generic" else path)
        code[path] = ext.decode_attention_variant(heads[2]) or "generic"
    ext.set_block_gemm_isa(previous)
    print(f"code each path runs at head_dim {heads[2]}: {code}")
    rows, best = [], paths[-1]
    for batch in batches:
        for ctx in contexts:
            layers, q, starts, lens = make_layers([ctx] * batch, heads, dtype, n_layers,
                                                  batch * ctx, cache)
            cap = batch * ctx
            gbytes = 2 * cap * heads[1] * heads[2] * cache.itemsize * n_layers / 1e9
            ms = {}
            for path in paths:
                ext.set_block_gemm_isa("" if path == "generic" else path)
                ms[path] = step_ms(ext, layers, q, starts, lens, reps)
            spread = make_layers(spread_lengths(batch, ctx, batch + ctx), heads, dtype,
                                 n_layers, 1, cache)
            ext.set_block_gemm_isa("" if best == "generic" else best)
            spread_ratio = round(step_ms(ext, *spread, reps) / ms[best], 2)
            same = None if cache == dtype else round(step_ms(ext, *make_layers(
                [ctx] * batch, heads, dtype, n_layers, batch * ctx), reps) / ms[best], 2)
            ext.set_block_gemm_isa(previous)
            speed = {p: round(ms["generic"] / ms[p], 2) for p in paths}
            print(f"{batch:>5} {ctx:>5} " + " ".join(
                f"{ms[p]:7.2f} ms {speed[p]:4.2f}x" for p in paths) + f"  spread {spread_ratio}"
                + ("" if same is None else f"  vs same {same}x"))
            rows.append({"batch": batch, "context": ctx, "ms": {p: round(v, 3) for p, v in
                                                                  ms.items()},
                         "gb_s": {p: round(gbytes / v * 1000, 1) for p, v in ms.items()},
                         "speed": speed, "spread": spread_ratio, "vs_same": same})
    out = {"bench": "cpu_attention", "machine": here, "heads": heads, "dtype": args.dtype,
           "cache_dtype": str(cache).removeprefix("torch."), "layers": n_layers,
           "paths": paths, "code": code, "rows": rows,
           "speed_at_largest": rows[-1]["speed"][best] if rows else None}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
