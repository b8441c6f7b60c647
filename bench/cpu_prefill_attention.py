"""The CPU prefill attention of one SmolLM2-135M layer (9 query heads, 3 KV heads, head_dim 64)
over a batch of whole prompts, per code path of pipellm/kernels/prefill_attention.py: the
float32-GEMM path (`_prefill_attention_cpu`, what runs without the C++ kernels or with a window,
softcap or INT8) against the C++ kernel (pipellm/kernels/cpu/prefill_attention.cpp) at every ISA
level this CPU runs (switched in process: avx2 and avx512 in float32 vectors; bf16 on an AMX CPU at
the avx512 levels: AMX tiles; and bf16 as a pooling forward runs it, P rounded to bf16 alone
(coarse_p): `amx_coarse_p` on the tiles, `avx512_bf16` as bf16 products on a CPU with
AVX512-BF16 and no AMX), and torch's SDPA per sequence (the reference) as a third opinion.
Prompts: ShareGPT texts' token lengths (data/sharegpt_samples_1024.json, cut to 2,000
characters as bench/pooling.py cuts them) up to --tokens a batch, the first --batches batches.
Reported per thread count: the median ms of a batch over --reps, and the ratio GEMM ms /
kernel ms per level.

    python -m bench.cpu_prefill_attention [--dtype bfloat16] [--tokens 2048] [--threads 1,2]

The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/cpu_prefill_attention.py`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import machine, median_ms  # noqa: E402
from pipellm.kernels.cpu import extension, isa  # noqa: E402
from pipellm.kernels.prefill_attention import _prefill_attention_cpu, prefill_attention_reference  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="q and the caches (a GGUF model's on a CPU with AVX512-BF16: bfloat16)")
    return p.parse_args(argv)


def prompt_batches(tokens: int, count: int) -> list[list[int]]:
    """Consecutive ShareGPT prompt lengths (SmolLM2's tokenizer), `tokens` at most a batch."""
    from bench.pooling import inputs
    from pipellm.shared.default_model import cached_path
    from pipellm.shared.tokenizer import encode, load_tokenizer

    tok = load_tokenizer(str(cached_path()))
    out, batch = [], []
    for text in inputs(20 * count * tokens // 190):
        n = len(encode(tok, text))
        if batch and sum(batch) + n > tokens:
            out.append(batch)
            batch = []
            if len(out) == count:
                break
        batch.append(n)
    return out


def make_case(lens: list[int], seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, HEAD_DIM, generator=g).to(dtype)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, cu[:-1].clone(), torch.tensor(lens, dtype=torch.int32)


def kernel_paths(ext, dtype: torch.dtype) -> dict:
    """name -> the C++ kernel at each block-GEMM level this CPU runs (its kernel choice follows
    the level), named by what it runs there; the CPU's own level restored after each call."""
    own, paths = ext.block_gemm_isa(), {}
    bf16 = dtype == torch.bfloat16
    for level in (lv for lv in isa.cpu_levels() if lv in isa.BLOCK_GEMM_LEVELS):
        ext.set_block_gemm_isa(level)
        tiles = bf16 and ext.prefill_attention_amx_ready()
        name = "amx" if tiles else ("avx2" if level == "avx2" else "avx512")
        # P in bf16 alone (ForwardBatch.coarse_p): the tiles' one product, or bf16 products
        coarse = {"amx": "amx_coarse_p", "avx512": "avx512_bf16"}.get(name) \
            if bf16 and (tiles or "avx512_bf16" in isa.cpu_flags()) else None

        def run(c, level=level, coarse_p=False):
            ext.set_block_gemm_isa(level)
            try:
                return ext.prefill_attention(*c, HEAD_DIM ** -0.5, coarse_p=coarse_p)
            finally:
                ext.set_block_gemm_isa(own)

        if name in paths:
            continue
        paths[name] = run
        if coarse:
            paths[coarse] = lambda c, run=run: run(c, coarse_p=True)
    ext.set_block_gemm_isa(own)
    return paths


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    ext = extension()
    if ext is None or not ext.block_gemm_isa():
        raise SystemExit(f"no C++ prefill kernel on this CPU ({isa.describe()})")
    dtype = getattr(torch, args.dtype)
    cases = [make_case(lens, i, dtype)
             for i, lens in enumerate(prompt_batches(args.tokens, args.batches))]
    scale = HEAD_DIM ** -0.5
    kernels = kernel_paths(ext, dtype)
    paths = {"gemm": lambda c: _prefill_attention_cpu(*c, scale), **kernels,
             "sdpa": lambda c: prefill_attention_reference(*c, scale)}
    out = {"bench": "cpu_prefill_attention", "machine": machine(), "isa": isa.describe(),
           "dtype": args.dtype, "tokens": args.tokens, "batches": [c[5].tolist() for c in cases],
           "ms": {}, "gemm_over_kernel": {}}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        ms = {name: statistics.median(median_ms(lambda c=c, f=f: f(c), args.reps)
                                      for c in cases) for name, f in paths.items()}
        ratio = {k: round(ms["gemm"] / ms[k], 2) for k in kernels}
        out["ms"][threads] = {k: round(v, 3) for k, v in ms.items()}
        out["gemm_over_kernel"][threads] = ratio
        print(f"{threads} thread(s): " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
              + "; gemm / kernel " + ", ".join(f"{k} {r:.2f}x" for k, r in ratio.items()),
              flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
