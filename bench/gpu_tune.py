"""Launch shapes for the kernels that lost on the first GPU run, swept on the device: INT8- and
FP8-KV decode attention (batch 64, context 4096), one long sequence's decode attention (batch 1,
context 4096; also with the splits merged in the split kernel, Tiling.fused), the W4A16 GEMM at
one row (4096x4096, 14336x4096, groups of 128; split along K, the splits added by a second
launch or by each tile's last split), and at 2 to 256 rows the fused kernel,
dequantize + cuBLAS and tinygemm (pipellm/kernels/int4_gemm.py's choices by rows: TINYGEMM_ROWS,
SMALL_M).

Each candidate is timed replayed from a CUDA graph over cold copies of its inputs
(bench/cuda_timing.py), beside the baseline the target names (the 16-bit kernel as it ships; the
bf16 GEMM), and checked against the reference. The best candidate per case, with its ratio, is
written as JSON to --out; `python -m bench.kernels --tilings FILE` runs the kernel table with
them.

    python -m bench.gpu_tune [--out tilings.json] [--quick]

--quick: two candidates per case at tiny shapes under the interpreter (a smoke test; timings
meaningless). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

if "--quick" in sys.argv[1:] and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from bench.cuda_timing import copies_for, graph_ms  # noqa: E402
from pipellm.kernels import dispatch  # noqa: E402
from pipellm.kernels.decode_attention import TILINGS, Tiling, decode_attention_reference  # noqa: E402
from pipellm.kernels.decode_attention import _decode_attention_triton as decode  # noqa: E402
from pipellm.kernels.int4_gemm import GemmTiling, gemm_tiling, int4_gemm_triton  # noqa: E402
from pipellm.kernels.int4_tiles import int4_tiles_gemm, pack_tiles  # noqa: E402
from pipellm.kernels.int4_weight import dequantize_int4, quantize_int4, unpack_nibbles  # noqa: E402
from pipellm.kernels.kv_quant import KV_GROUP, quantize_kv, to_fp8  # noqa: E402


def timer(cuda: bool):
    def run(calls: list) -> float:
        if cuda:
            return graph_ms(calls)
        t = time.perf_counter()
        for fn in calls:
            fn()
        return 1e3 * (time.perf_counter() - t) / len(calls)
    return run


def decode_inputs(batch, ctx, heads, dt, dev, kv):
    """A decode case; kv: None (16-bit), "int8" or "fp8"."""
    H, HKV, D = heads
    q = torch.randn(batch, H, D, dtype=dt, device=dev)
    k, v = (torch.randn(batch * ctx, HKV, D, dtype=dt, device=dev) for _ in range(2))
    starts = torch.arange(batch, dtype=torch.int32, device=dev) * ctx
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    if kv == "int8":
        (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
        return (q, k, v, starts, lens), dict(k_scale=ks, v_scale=vs)
    if kv == "fp8":
        k, v = to_fp8(k), to_fp8(v)
    return (q, k, v, starts, lens), {}


def sweep_decode(name, batch, ctx, kv, candidates, heads, dt, dev, run) -> dict:
    """Candidates of the split kernel's tiling on one case; baseline: the 16-bit cache with the
    shipped tiling."""
    per_value = {"int8": 1 + 2 / KV_GROUP, "fp8": 1}.get(kv, 2)
    nbytes = batch * ctx * heads[1] * heads[2] * 2 * per_value
    copies = copies_for(int(nbytes)) if dev.type == "cuda" else 1
    sets = [decode_inputs(batch, ctx, heads, dt, dev, kv) for _ in range(copies)]
    base_sets = [decode_inputs(batch, ctx, heads, dt, dev, None) for _ in range(copies)]
    scale = heads[2] ** -0.5
    base = run([lambda a=a: decode(*a, scale, ctx) for a, _ in base_sets])
    want = decode_attention_reference(*sets[0][0], scale, **sets[0][1]).float()
    rows = []
    for t in candidates:
        try:
            got = decode(*sets[0][0], scale, ctx, tiling=t, **sets[0][1])
            err = (got.float() - want).abs().max().item()
            ms = run([lambda a=a, kw=kw, t=t: decode(*a, scale, ctx, tiling=t, **kw)
                      for a, kw in sets])
        except Exception as exc:  # a candidate that fails to compile is reported, not fatal
            print(f"  {name} {t}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        gbs = nbytes / ms / 1e6
        rows.append(dict(tiling=asdict(t), ms=round(ms, 4), gbs=round(gbs, 1),
                         speedup=round(base / ms, 3), max_err=float(f"{err:.2e}")))
        print(f"  {name} {t}: {ms:.4f} ms {gbs:7.1f} GB/s x{base / ms:5.2f} (err {err:.1e})",
              flush=True)
    best = min(rows, key=lambda r: r["ms"]) if rows else None
    return dict(baseline_ms=round(base, 4), best=best, candidates=len(rows))


@functools.cache
def _gemlite():
    """gemlite, imported once (CUDA only: it asks the device its name at import); an H200 takes
    the H100's tuned configs, else gemlite autotunes on first call."""
    import gemlite

    configs = Path(gemlite.__file__).parent / "configs" / "h100.json"
    if "h200" in torch.cuda.get_device_name().lower() and configs.exists():
        gemlite.GemLiteLinear.load_config(str(configs))
    return gemlite


def gemlite_layer(w):
    """gemlite's GemLiteLinear (Mobius Labs' Triton W4A16 kernels, the ones torchao, SGLang and
    HQQ serve with; its GEMV "RevSplitK" at one row) holding an Int4Weight: W = q scale + min
    is its fma mode with zeros = -min / scale."""
    gemlite = _gemlite()
    layer_cls, dtype = gemlite.GemLiteLinear, gemlite.DType
    n, k = w.shape
    layer = layer_cls(4, group_size=w.group_size, in_features=k, out_features=n,
                      input_dtype=dtype.BF16, output_dtype=dtype.BF16)
    layer.pack(unpack_nibbles(w.packed), w.scales, -w.mins / w.scales, None)
    return layer


def sweep_w4a16(m, n, k, group, candidates, dt, dev, run) -> dict:
    """Candidates of the W4A16 GEMM's tiling (None: int4_gemm_triton's own choice; "tiles":
    tinygemm's layout, pipellm/kernels/int4_tiles.py; "gemlite": `gemlite_layer`) against cuBLAS
    bf16 on the dequantized weight."""
    w = torch.randn(n, k, dtype=dt, device=dev) * 0.02
    x = torch.randn(m, k, dtype=dt, device=dev)
    w4 = quantize_int4(w, group).to(dev, dt)
    nbytes = w4.nbytes()
    copies = copies_for(nbytes) if dev.type == "cuda" else 1
    w4s = [w4] + [quantize_int4(torch.randn_like(w) * 0.02, group).to(dev, dt)
                  for _ in range(copies - 1)]
    wqs = [dequantize_int4(q).to(dt) for q in w4s]
    base = run([lambda wq=wq: F.linear(x, wq) for wq in wqs])
    want = F.linear(x.float(), wqs[0].float())
    tiles = {c: [pack_tiles(q, 4 if c == "tiles4" else None) for q in w4s]
             for c in candidates if c in ("tiles", "tiles4")}  # tiles4: inner K tiles of 4
    rows = []
    for t in candidates:
        gemm = (lambda q, t: int4_tiles_gemm(x, q)) if t in tiles else \
            (lambda q, t: q(x)) if t == "gemlite" else \
            (lambda q, t: int4_gemm_triton(x, q, tiling=t))
        weights = tiles.get(t, w4s)
        try:
            if t == "gemlite":  # made here: a missing package is this candidate's failure
                weights = [gemlite_layer(q) for q in w4s]
            err = (gemm(weights[0], t).float() - want).abs().max().item()
            ms = run([lambda q=q, t=t, f=gemm: f(q, t) for q in weights])
        except Exception as exc:
            print(f"  w4a16 m{m} {n}x{k} {t}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        rows.append(dict(tiling=asdict(t) if isinstance(t, GemmTiling) else
                         t or "dequantize + cuBLAS", ms=round(ms, 4),
                         gbs=round(nbytes / ms / 1e6, 1),
                         speedup=round(base / ms, 3), max_err=float(f"{err:.2e}")))
        print(f"  w4a16 m{m} {n}x{k} {t}: {ms:.4f} ms x{base / ms:5.2f} (err {err:.1e})",
              flush=True)
    best = min(rows, key=lambda r: r["ms"]) if rows else None
    return dict(baseline_ms=round(base, 4), best=best, candidates=len(rows))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="tilings.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--cases", default="int8,fp8,decode_b1,w4a16",
                   help="which sweeps, comma-separated (default: these; also deep_16bit, and "
                   "fused: the shipped 16-bit tiling with and without Tiling.fused at other "
                   "shapes)")
    args = p.parse_args(argv)
    cases = set(args.cases.split(","))
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.bfloat16 if cuda else torch.float32
    dispatch.set_backend("triton")
    torch.manual_seed(0)
    run = timer(cuda)
    q = args.quick
    heads, ctx = ((4, 2, 16), 128) if q else ((32, 8, 128), 4096)
    dims = [(64, 64)] if q else [(4096, 4096), (14336, 4096)]
    group = 32 if q else 128
    # candidates that compile for sm_90 without spilling much (tests/sm90.py, cuobjdump)
    quant_c = [Tiling(bn, w, st) for bn, w, st in (
        [(32, 4, 2), (64, 4, 2)] if q else
        [(32, 4, 2), (32, 4, 3), (32, 8, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2)])]
    long_c = [Tiling(bn, 4, 2, ms) for bn, ms in itertools.product(
        (32,) if q else (32, 64), (32, 64) if q else (32, 64, 256))] + ([] if q else [
            Tiling(64, 4, 3, 256), Tiling(64, 4, 4, 256), Tiling(64, 8, 3, 256),
            Tiling(32, 4, 4, 128), Tiling(64, 4, 3, 64)])  # longer splits, deeper pipelines
    long_c += [Tiling(32, 4, 2, 32, True)] + ([] if q else [  # one launch: splits merged
        replace(long_c[0], fused=True), Tiling(64, 4, 2, 64, True), Tiling(64, 4, 3, 256, True)])
    deep_c = [Tiling(32 if q else 64, 4, 3, ms) for ms in (64, 256)]  # at other contexts
    fused_c = [TILINGS["16bit"], replace(TILINGS["16bit"], fused=True)]
    # (block_n, block_k, warps); the last two make the fewest SASS instructions a nibble
    blocks = [(32, 32, 4)] if q else [(32, 64, 4), (32, 128, 4), (64, 64, 4), (128, 64, 4),
                                      (128, 128, 4), (256, 64, 8)]
    gemv_c = [GemmTiling(16, bn, bk, sk, w, fused=f) for (bn, bk, w), sk, f in itertools.product(
        blocks, (1, 2) if q else (4, 8, 16), (False, True)) if sk > 1 or not f] + (
        [] if q else ["tiles", "tiles4", "gemlite"])  # fused: the splits added in one launch
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)"}
    print(res["device"])
    batch = 2 if q else 64
    if "int8" in cases:
        res["int8_decode_b64"] = sweep_decode("int8 b64", batch, ctx, "int8", quant_c, heads,
                                              dt, dev, run)
    if "fp8" in cases and (not q or not cuda):  # e4m3 needs sm_89+ on CUDA
        res["fp8_decode_b64"] = sweep_decode("fp8 b64", batch, ctx, "fp8", quant_c, heads, dt,
                                             dev, run)
    if "decode_b1" in cases:
        res["decode_b1"] = sweep_decode("16-bit b1", 1, ctx, None, long_c, heads, dt, dev, run)
    for b, c in ((1, ctx // 4), (1, 4 * ctx), (16, ctx)) if "fused" in cases else []:
        res[f"fused_b{b}_ctx{c}"] = sweep_decode(f"16-bit fused b{b} ctx{c}", b, c, None,
                                                 fused_c, heads, dt, dev, run)
    for b, c in ((1, ctx // 4), (1, 4 * ctx), (batch, ctx)) if "deep_16bit" in cases else []:
        res[f"deep_16bit_b{b}_ctx{c}"] = sweep_decode(f"16-bit b{b} ctx{c}", b, c, None, deep_c,
                                                      heads, dt, dev, run)
    for n, k in dims if "w4a16" in cases else []:
        res[f"w4a16_m1_{n}x{k}"] = sweep_w4a16(1, n, k, group, gemv_c, dt, dev, run)
    for m in (2, 4, 8, 16, 64, 256) if "w4a16" in cases else []:
        n, k = dims[0]  # the fused kernel (gemm_tiling's), dequantize + cuBLAS, tinygemm
        extra = [] if q else ["tiles", "gemlite"]
        t = gemm_tiling(m, n, k, group)
        res[f"w4a16_rows_m{m}_{n}x{k}"] = sweep_w4a16(
            m, n, k, group, [t] + [replace(t, fused=True)] * (t.split_k > 1) + [None] + extra,
            dt, dev, run)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({name: (r["best"] or {}).get("speedup") if isinstance(r, dict) else r
                      for name, r in res.items()}))


if __name__ == "__main__":
    main()
