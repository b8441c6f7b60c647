"""Every Triton kernel bench/kernels.py runs, compiled for sm_90 (H100/H200) on the CPU: the
launches are recorded (not run) under the interpreter at the benchmark's head and block sizes
and compiled by Triton and ptxas in a process without the interpreter.

Catches what only the compiler rejects (a global that is not constexpr broke Gemma's soft-cap
prefill on the first GPU run that reached it), and register spills in the kernels of a decode
step (the INT8-KV decode kernel spilled 536 bytes a thread and ran at 0.09x the 16-bit one).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from bench import kernels as bench_kernels
from pipellm.kernels.decode_attention import TILINGS, _decode_attention_triton
from pipellm.kernels.int4_gemm import gemm_tiling, int4_gemm_triton
from pipellm.kernels.int8_quant import quantize_fp8_rows
from tests.sm90 import compile_sm90, record_launches, spec

# The benchmark's constexpr-determining sizes (heads, head_dim, hidden, groups) with few rows.
SHAPES = dict(heads=(32, 8, 128), hidden=4096, inter=1024, vocab=4096, copy_mib=1,
              decode=[(2, 256), (1, 512), (2, 256)], prefill=[(1, 64, 0), (2, 16, 48)],
              norm=[16, 4], tokens=8, sample=4,
              moe=dict(hidden=512, inter=256, experts=8, top_k=2), moe_tokens=[1, 4, 16],
              lora=dict(rank=16, rows=[8, 256], adapters=[4]),  # decode's and prefill's blocks
              device=torch.device("cpu"), dtype=torch.bfloat16)
ON_CUDA = {"UPCAST_DOT": False, "PTX": True}  # constexprs the launchers set differently off CUDA
# Kernels of a decode step, and the most local memory a thread of them may use at their shipped
# launch shapes (none spills today: the INT8 decode kernel holds 126 registers).
NO_SPILL = {"_decode_split_kernel", "_decode_combine_kernel", "_int4_gemm_kernel",
            "_split_k_sum_kernel", "_rms_norm_kernel", "_lora_shrink_kernel",
            "_lora_expand_kernel"}
MAX_SPILL = 16


def gemma_attention() -> None:
    """Decode and prefill attention with Gemma's soft-cap and a sliding window (constexpr
    branches no benchmark case takes)."""
    i32 = dict(dtype=torch.int32)
    q = torch.randn(2, 8, 256, dtype=torch.bfloat16)  # Gemma 2: 8 heads of 256, 4 KV heads
    k, v = (torch.randn(64, 4, 256, dtype=torch.bfloat16) for _ in range(2))
    starts, lens = torch.tensor([0, 32], **i32), torch.tensor([20, 32], **i32)
    bench_kernels.decode_attention(q, k, v, starts, lens, window=16, softcap=50.0)
    bench_kernels.prefill_attention(torch.randn(12, 8, 256, dtype=torch.bfloat16), k, v,
                                    torch.tensor([0, 4, 12], **i32), starts, lens, window=16,
                                    softcap=50.0)


def fused_decode_attention() -> None:
    """The split kernel that merges its own splits (Tiling.fused), Llama-3-8B's heads."""
    q = torch.randn(1, 32, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(512, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    i32 = dict(dtype=torch.int32)
    _decode_attention_triton(q, k, v, torch.tensor([0], **i32), torch.tensor([512], **i32),
                             128**-0.5, 512, 8, tiling=replace(TILINGS["16bit"], fused=True))


@functools.cache
def compiled() -> list[tuple[dict, dict]]:
    from pipellm.kernels import dispatch

    dispatch.set_backend("triton")
    try:
        with record_launches() as launches:
            for build in bench_kernels.builders(SHAPES):
                case = build()
                if case["name"].startswith("w4a16_gemm_m16"):
                    continue  # the same kernel as m1 at the larger tiling: below
                case["tri"]()
            x = torch.randn(32, 4096, dtype=torch.bfloat16)
            w = bench_kernels.quantize_int4(torch.randn(64, 4096), 128).to("cpu", torch.bfloat16)
            int4_gemm_triton(x, w)  # more rows than SMALL_M: the dequant kernel
            int4_gemm_triton(x[:1], w, tiling=replace(gemm_tiling(1, 4096, 4096, 128),
                                                      fused=True))  # split-K in one launch
            gemma_attention()
            fused_decode_attention()
            quantize_fp8_rows(torch.randn(4, 4096, dtype=torch.bfloat16))  # the FP8 linear's
    finally:
        dispatch.set_backend("auto")
    specs, seen = [], set()
    for launch in launches:
        s = spec(launch)
        s["constexprs"].update({k: v for k, v in ON_CUDA.items() if k in s["constexprs"]})
        key = repr(s)
        if key not in seen:
            seen.add(key)
            specs.append(s)
    return list(zip(specs, compile_sm90(specs), strict=True))


def test_every_kernel_compiles_for_sm90():
    results = compiled()
    names = {s["name"] for s, _ in results}
    assert {"_decode_split_kernel", "_int4_gemm_kernel", "_split_k_sum_kernel"} <= names
    failed = {s["name"]: r["error"] for s, r in results if "error" in r}
    assert not failed, failed


@pytest.mark.parametrize("kernel", sorted(NO_SPILL))
def test_decode_step_kernels_do_not_spill(kernel):
    results = [(s, r) for s, r in compiled() if s["name"] == kernel and "error" not in r]
    if not results:
        pytest.skip(f"{kernel} not launched by bench/kernels.py's cases")
    spills = {repr(s["constexprs"]): r for s, r in results if r["spill"] > MAX_SPILL}
    assert not spills, spills


def test_8bit_decode_loops_convert_before_the_layout_change():
    """The INT8- and FP8-KV decode loops against the 16-bit one, Llama-3-8B's heads: each 8-bit
    value converts in the registers it was loaded into (INT8 with its group's scale), before
    the layout change into the dot's operand. The loops took 684 instructions (INT8, its scales
    multiplied one value an instruction) and 580 (FP8, converted after the layout change, a
    byte at a time from shared memory) against 336."""
    loops = {}
    for s, r in compiled():
        c = s["constexprs"]
        if s["name"] == "_decode_split_kernel" and c["HEAD_DIM"] == 128 and not c["FUSED"]:
            kind = "int8" if c["KV_INT8"] else "fp8" if c["KV_FP8"] else "16bit"
            loops[kind] = sum(r["loop"].values())
    assert set(loops) == {"16bit", "int8", "fp8"}, loops
    assert loops["16bit"] > 100, loops  # the loop was found
    assert loops["int8"] <= 1.75 * loops["16bit"], loops
    assert loops["fp8"] <= 1.2 * loops["16bit"], loops


def test_int4_gemv_loop_unpacks_nibbles_in_few_instructions():
    """The W4A16 GEMV at one row (Llama-3-8B's 4096 x 4096, its GEMV tiling, fused or not):
    the nibbles unpacked by inline PTX, 7 instructions per 4 bytes, before the layout change.
    Triton's own byte ops made the loop 6.7 instructions a nibble."""
    loops = []
    for s, r in compiled():
        c = s["constexprs"]
        if s["name"] == "_int4_gemm_kernel" and c["BLOCK_N"] == 128 and c["SPLIT_K"] > 1:
            threads = 32 * s["options"]["num_warps"]
            loops.append(sum(r["loop"].values()) / (c["BLOCK_N"] * c["BLOCK_K"] / threads))
    assert len(loops) >= 2, loops  # the benchmark's and the fused launch
    assert max(loops) <= 5.5, loops
