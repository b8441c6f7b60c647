"""Kernel microbenchmarks: each Triton kernel vs its PyTorch baseline, Llama-3-8B shapes, bf16.

On CUDA, per kernel: median time, for the kernels a decode step runs replayed from a CUDA graph
over cold copies of the inputs as the server runs them (bench/cuda_timing.py), else
`triton.testing.do_bench` (warm-up, L2 flushed before each rep, Python's launch included; printed
for every kernel as "launch"), achieved GB/s (TFLOP/s for prefill attention) and % of the device's
peak bandwidth, which is measured in the same run as a 1 GiB device-to-device copy ((bytes read +
written) / time). Bytes are each op's minimal traffic (inputs read once, outputs written once;
sampling: one pass over the logits). Next to it the baseline: eager PyTorch reference ops; decode
attention: SDPA on contiguous [B, H, 1, D] queries and [B, Hkv, ctx, D] K/V (enable_gqa); prefill
attention: SDPA causal on the flash backend (lower-right causal mask for chunks with a prefix);
fused MoE: the per-expert loop (`fused_moe_ref`, transformers' loop: per expert its tokens' gate_up
GEMM, SiLU x mul, down GEMM, weighted index_add). "speed" = baseline time / Triton time (> 1:
Triton faster). Shapes: 32 heads, 8 KV heads, head_dim 128, hidden 4096, intermediate 14336, vocab
128256; the fused MoE at Qwen3-30B-A3B's (hidden 2048, expert intermediate 768, 128 experts, top-8;
router: random weights, softmax, top-k, renormalized) at 1, 16 and 256 tokens, its bytes the
experts its tokens touch (distinct ids x the expert's w13 + w2) plus x, the output and the routing;
segmented LoRA (SGMV: every adapter group's y[rows] += x[rows] @ A @ B in two launches) on the q/o
(4096 -> 4096, one shape) and fused gate_up (4096 -> 28672) projections at rank 16, 64 and 256 rows
split evenly over 4 and 16 adapters, rows in random order, against the per-group loop the caller
otherwise runs (`lora_delta_reference`: per group a gather, two float32 matmuls, a write back),
its bytes x's rows, the adapters' A and B, y's rows read and written;
gated activations (SiLU x mul, GELU-tanh x mul) at T=4096. Targets, printed PASS/MISS: decode
attention >= 85% of peak at batch 64, context 4096; fused add+RMSNorm >= 70% of peak at T=4096;
prefill attention at 2k tokens within 1.3x of SDPA flash; INT8 KV decode attention (the baseline:
the same kernel on the 16-bit cache) >= 1.5x its speed at batch 64, context 4096; one 4096-token
sequence's decode attention >= 60% of peak; INT4 weight-only GEMM >= 2x the bf16 GEMM at batch 1;
none for the fused MoE, LoRA or the activations.

    python -m bench.kernels [--quick]

--quick: every code path at tiny shapes; without CUDA on CPU tensors under TRITON_INTERPRET=1,
where the timings mean nothing. The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/kernels.py`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402  (does not import triton)

if "--quick" in sys.argv[1:] and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels' @triton.jit runs

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from torch.backends.cuda import SDPAParams, can_use_flash_attention  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from bench.cuda_timing import copies_for, graph_ms  # noqa: E402
from bench.paged_attention import decode_attention_paged  # noqa: E402
from pipellm.kernels import dispatch  # noqa: E402
from pipellm.kernels.activation import (  # noqa: E402
    gelu_tanh_mul,
    gelu_tanh_mul_ref,
    silu_mul,
    silu_mul_ref,
)
from pipellm.kernels.decode_attention import Tiling, decode_attention  # noqa: E402
from pipellm.kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402
from pipellm.kernels.int4_gemm import GemmTiling, int4_gemm, prepare_int4  # noqa: E402
from pipellm.kernels.int4_weight import dequantize_int4, quantize_int4  # noqa: E402
from pipellm.kernels.kv_quant import quantize_kv, to_fp8  # noqa: E402
from pipellm.kernels.lora import lora_delta_, lora_delta_reference  # noqa: E402
from pipellm.kernels.prefill_attention import prefill_attention  # noqa: E402
from pipellm.kernels.rmsnorm import add_rms_norm, add_rms_norm_ref  # noqa: E402
from pipellm.kernels.rope import rope_kv_write, rope_kv_write_ref  # noqa: E402
from pipellm.kernels.sampling import SamplingBatch, sample, sample_reference  # noqa: E402
from pipellm.services.compute.model.moe import route  # noqa: E402
from pipellm.services.compute.model.rope import RotaryEmbedding  # noqa: E402

FULL = dict(heads=(32, 8, 128), hidden=4096, inter=14336, vocab=128256, copy_mib=1024,
            decode=[(64, 4096), (1, 4096), (256, 4096)], prefill=[(1, 2048, 0), (4, 512, 1536)],
            norm=[4096, 64], tokens=4096, sample=256,
            moe=dict(hidden=2048, inter=768, experts=128, top_k=8), moe_tokens=[1, 16, 256],
            lora=dict(rank=16, rows=[64, 256], adapters=[4, 16]))
QUICK = dict(heads=(4, 2, 16), hidden=256, inter=512, vocab=1000, copy_mib=16,
             decode=[(2, 64), (1, 64), (3, 64)], prefill=[(1, 64, 0), (2, 16, 48)],
             norm=[16, 4], tokens=16, sample=8,
             moe=dict(hidden=64, inter=32, experts=8, top_k=2), moe_tokens=[1, 4, 16],
             lora=dict(rank=16, rows=[8, 32], adapters=[2, 4]))
DECODE_PCT, NORM_PCT, PREFILL_RATIO = 85.0, 70.0, 1.3  # decode: the GPU-path issue
INT8_SPEEDUP = 1.5  # INT8 KV decode attention against the 16-bit kernel (GPU round two)
PAGE = 16  # vLLM's default block size, for the paged decode attention baseline
W4A16_SPEEDUP = 2.0  # INT4 weight-only GEMM against the bf16 GEMM at batch 1 (same issue)
LONG_PCT = 60.0  # one 4096-token sequence's decode attention, % of peak (same issue)


def fp8_ok(device) -> bool:
    """Whether FP8 KV runs here (CUDA compute capability 8.9+, or the interpreter on CPU)."""
    dev = torch.device(device)
    return dev.type != "cuda" or torch.cuda.get_device_capability(dev) >= (8, 9)


def timeit(fn, cuda: bool) -> float:
    """Median ms of fn(): do_bench on CUDA; else 3 perf_counter runs after a warm-up call."""
    if cuda:
        return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def peak_gbs(s: dict, cuda: bool) -> float:
    """Device-to-device copy bandwidth: (bytes read + bytes written) / time."""
    src = torch.empty(s["copy_mib"] << 20, dtype=torch.uint8, device=s["device"])
    dst = torch.empty_like(src)
    ms = timeit(lambda: dst.copy_(src), cuda)
    return 2 * src.numel() / ms / 1e6


def max_err(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"max|diff| {(a.float() - b.float().reshape(a.shape)).abs().max().item():.2e}"


def flash_sdpa(q, k, v, **kw):
    """SDPA restricted to the flash backend with native GQA; where that is refused, the same
    with K/V heads repeated (noted). Returns the callable, already run once."""
    def run(k=k, v=v, gqa=True):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kw)

    if q.is_cuda and not can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, True, True), True):
        print("  note: can_use_flash_attention is False for these inputs (reasons logged "
              "above); a lower-right causal mask then runs another backend silently")
    try:
        run()
        return run
    except RuntimeError as exc:
        print(f"  note: flash SDPA refused GQA ({str(exc).splitlines()[0][:100]}); baseline "
              f"repeats the K/V heads")
        g = q.shape[1] // k.shape[1]
        fn = functools.partial(run, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), False)
        fn()
        return fn


def case_decode(s: dict, batch: int, ctx: int) -> dict:
    (H, HKV, D), dt, dev = s["heads"], s["dtype"], s["device"]
    q = torch.randn(batch, H, D, dtype=dt, device=dev)
    k = torch.randn(batch * ctx, HKV, D, dtype=dt, device=dev)  # cache: sequences back to back
    v = torch.randn_like(k)
    starts = torch.arange(batch, dtype=torch.int32, device=dev) * ctx
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    kb, vb = (t.view(batch, ctx, HKV, D).transpose(1, 2).contiguous() for t in (k, v))
    qb, scale = q[:, :, None, :], D**-0.5  # [B, H, 1, D] contiguous; K/V [B, Hkv, ctx, D]
    return dict(
        name=f"decode_attn_b{batch}_ctx{ctx}", unit="GB/s",
        work=(2 * k.numel() + 2 * q.numel()) * q.element_size(),
        tri=lambda: decode_attention(q, k, v, starts, lens, scale, max_seq_len=ctx),
        base=lambda: F.scaled_dot_product_attention(qb, kb, vb, scale=scale, enable_gqa=True),
        graph=True, check=max_err)


def case_decode_int8(s: dict, batch: int, ctx: int) -> dict:
    """INT8 KV (values + fp16 scales per 8) against the same kernel on the 16-bit cache."""
    (H, HKV, D), dt, dev = s["heads"], s["dtype"], s["device"]
    q = torch.randn(batch, H, D, dtype=dt, device=dev)
    k = torch.randn(batch * ctx, HKV, D, dtype=dt, device=dev)
    v = torch.randn_like(k)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    starts = torch.arange(batch, dtype=torch.int32, device=dev) * ctx
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    scale = D**-0.5
    return dict(
        name=f"decode_attn_int8_b{batch}_ctx{ctx}", unit="GB/s",
        work=2 * (kq.numel() + ks.numel() * ks.element_size()) + 2 * q.numel() * q.element_size(),
        tri=lambda: decode_attention(q, kq, vq, starts, lens, scale, max_seq_len=ctx,
                                     k_scale=ks, v_scale=vs),
        base=lambda: decode_attention(q, k, v, starts, lens, scale, max_seq_len=ctx),
        graph=True, check=max_err)


def case_decode_fp8(s: dict, batch: int, ctx: int) -> dict:
    """FP8 KV (e4m3, scale 1) against the same kernel on the 16-bit cache."""
    (H, HKV, D), dt, dev = s["heads"], s["dtype"], s["device"]
    q = torch.randn(batch, H, D, dtype=dt, device=dev)
    k = torch.randn(batch * ctx, HKV, D, dtype=dt, device=dev)
    v = torch.randn_like(k)
    k8, v8 = to_fp8(k), to_fp8(v)
    starts = torch.arange(batch, dtype=torch.int32, device=dev) * ctx
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    scale = D**-0.5
    return dict(
        name=f"decode_attn_fp8_b{batch}_ctx{ctx}", unit="GB/s",
        work=2 * k8.numel() + 2 * q.numel() * q.element_size(),
        tri=lambda: decode_attention(q, k8, v8, starts, lens, scale, max_seq_len=ctx),
        base=lambda: decode_attention(q, k, v, starts, lens, scale, max_seq_len=ctx),
        graph=True, check=max_err)


def case_decode_paged(s: dict, batch: int, ctx: int, page: int = PAGE) -> dict:
    """Our contiguous segments against the same kernel reading a block table (vLLM's paged
    layout, pages handed out shuffled): speed = paged time / contiguous time, the cost the
    simulator's paged baseline is given (--sim-paged-attn-slowdown)."""
    (H, HKV, D), dt, dev = s["heads"], s["dtype"], s["device"]
    q = torch.randn(batch, H, D, dtype=dt, device=dev)
    k = torch.randn(batch * ctx, HKV, D, dtype=dt, device=dev)
    v = torch.randn_like(k)
    starts = torch.arange(batch, dtype=torch.int32, device=dev) * ctx
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    pages = batch * ctx // page
    perm = torch.randperm(pages, device=dev)  # page j of the paged cache holds segment page
    kp, vp = (torch.empty_like(t).view(pages, page, HKV, D) for t in (k, v))
    kp[perm], vp[perm] = k.view(pages, page, HKV, D), v.view(pages, page, HKV, D)
    table = perm.view(batch, ctx // page).to(torch.int32)  # [B, pages per sequence]
    kp, vp, scale = kp.view_as(k), vp.view_as(v), D**-0.5
    return dict(
        name=f"decode_attn_vs_paged{page}_b{batch}_ctx{ctx}", unit="GB/s",
        work=(2 * k.numel() + 2 * q.numel()) * q.element_size(),
        tri=lambda: decode_attention(q, k, v, starts, lens, scale, max_seq_len=ctx),
        base=lambda: decode_attention_paged(q, kp, vp, table, lens, scale, page, ctx),
        graph=True, check=max_err)


def case_w4a16(s: dict, rows: int, n: int, k: int, group: int = 128) -> dict:
    """INT4 weight-only GEMM (groups of 128) as served (`prepare_int4`'s layout: tinygemm's tiles
    for bf16 on CUDA) against the bf16 GEMM."""
    dt, dev = s["dtype"], s["device"]
    x = torch.randn(rows, k, dtype=dt, device=dev)
    w = torch.randn(n, k, dtype=dt, device=dev) * 0.02
    w4 = quantize_int4(w, group).to(dev, dt)
    wq = dequantize_int4(w4).to(dt)  # the same weights, dequantized once
    wp = prepare_int4(w4)
    return dict(
        name=f"w4a16_gemm_m{rows}_{n}x{k}", unit="GB/s", work=n * k // 2 + rows * (n + k) * 2,
        tri=lambda: int4_gemm(x, wp), base=lambda: F.linear(x, wq), graph=True,
        check=max_err)


def case_prefill(s: dict, n_seqs: int, q_len: int, prefix: int) -> dict:
    (H, HKV, D), dt, dev = s["heads"], s["dtype"], s["device"]
    ctx, scale, i32 = prefix + q_len, D**-0.5, dict(dtype=torch.int32, device=dev)
    q = torch.randn(n_seqs * q_len, H, D, dtype=dt, device=dev)
    k = torch.randn(n_seqs * ctx, HKV, D, dtype=dt, device=dev)
    v = torch.randn_like(k)
    cu, starts = torch.arange(n_seqs + 1, **i32) * q_len, torch.arange(n_seqs, **i32) * ctx
    ctx_lens = torch.full((n_seqs,), ctx, **i32)
    qb = q.view(n_seqs, q_len, H, D).transpose(1, 2).contiguous()  # [S, H, q_len, D]
    kb, vb = (t.view(n_seqs, ctx, HKV, D).transpose(1, 2).contiguous() for t in (k, v))
    mask = dict(is_causal=True) if prefix == 0 else dict(attn_mask=causal_lower_right(q_len, ctx))
    keys = n_seqs * sum(range(prefix + 1, ctx + 1))  # (query, visible key) pairs
    return dict(
        name=f"prefill_attn_{n_seqs}x{q_len}" + (f"_prefix{prefix}" if prefix else ""),
        unit="TFLOP/s", work=4 * H * D * keys,  # QK^T and PV: 2 flops per multiply-add each
        tri=lambda: prefill_attention(q, k, v, cu, starts, ctx_lens, scale, max_q_len=q_len),
        base=flash_sdpa(qb, kb, vb, scale=scale, **mask),
        check=lambda a, b: max_err(a, b.transpose(1, 2)))


def case_norm(s: dict, T: int) -> dict:
    N, dt, dev = s["hidden"], s["dtype"], s["device"]
    x, r = (torch.randn(T, N, dtype=dt, device=dev) for _ in range(2))
    w = 1 + 0.1 * torch.randn(N, dtype=dt, device=dev)
    return dict(name=f"add_rms_norm_t{T}", unit="GB/s", work=(4 * T * N + N) * x.element_size(),
                tri=lambda: add_rms_norm(x, r, w, 1e-5),
                base=lambda: add_rms_norm_ref(x, r, w, 1e-5),
                graph=True, check=lambda a, b: max_err(a[0], b[0]))


def case_rope(s: dict, T: int) -> dict:
    (H, HKV, D), dt, dev = s["heads"], s["dtype"], s["device"]
    qkv = torch.randn(T, (H + 2 * HKV) * D, dtype=dt, device=dev)  # as the model's projection
    q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, HKV * D, HKV * D], dim=-1))
    rope = RotaryEmbedding(D, T, 500000.0, None, dev)
    pos = torch.arange(T, device=dev)  # positions, also the cache slots
    kc, vc = (torch.zeros(T, HKV, D, dtype=dt, device=dev) for _ in range(2))
    args = (q, k, v, pos, rope.cos, rope.sin, kc, vc, pos)
    per_token = (2 * H + 5 * HKV) * D * qkv.element_size() + 4 * D + 16  # q,k,v,outs,cos/sin,ids
    return dict(name=f"rope_kv_write_t{T}", unit="GB/s", work=T * per_token,
                tri=lambda: rope_kv_write(*args), base=lambda: rope_kv_write_ref(*args),
                graph=True, check=lambda a, b: max_err(a[0], b[0]))


def case_silu(s: dict, T: int) -> dict:
    inter, dt, dev = s["inter"], s["dtype"], s["device"]
    gu = torch.randn(T, 2 * inter, dtype=dt, device=dev)
    return dict(name=f"silu_mul_t{T}", unit="GB/s", work=3 * T * inter * gu.element_size(),
                tri=lambda: silu_mul(gu), base=lambda: silu_mul_ref(gu), graph=True,
                check=max_err)


def case_gelu(s: dict, T: int) -> dict:
    inter, dt, dev = s["inter"], s["dtype"], s["device"]
    gu = torch.randn(T, 2 * inter, dtype=dt, device=dev)
    return dict(name=f"gelu_tanh_mul_t{T}", unit="GB/s", work=3 * T * inter * gu.element_size(),
                tri=lambda: gelu_tanh_mul(gu), base=lambda: gelu_tanh_mul_ref(gu), graph=True,
                check=max_err)


def case_fused_moe(s: dict, T: int) -> dict:
    """Triton grouped GEMM over the pairs sorted by expert against the per-expert loop. Bytes:
    the experts touched (distinct ids) x (w13 + w2), x read, the output written, the routing."""
    m, dt, dev = s["moe"], s["dtype"], s["device"]
    H, inter, E, k = m["hidden"], m["inter"], m["experts"], m["top_k"]
    x = torch.randn(T, H, dtype=dt, device=dev)
    router = torch.randn(E, H, dtype=dt, device=dev) * H**-0.5
    w13 = torch.randn(E, 2 * inter, H, dtype=dt, device=dev) * H**-0.5  # [E, 2I, H]
    w2 = torch.randn(E, H, inter, dtype=dt, device=dev) * inter**-0.5  # [E, H, I]
    weights, ids = route(x, router, k, renormalize=True)  # [T, k] float32, int64
    touched = ids.unique().numel()
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    work = touched * per_expert + 2 * x.numel() * x.element_size() + T * k * (4 + 8)
    return dict(name=f"fused_moe_e{E}k{k}_t{T}", unit="GB/s", work=work,
                tri=lambda: fused_moe(x, w13, w2, weights, ids),
                base=lambda: fused_moe_ref(x, w13, w2, weights, ids), check=max_err)


def case_lora(s: dict, proj: str, T: int, adapters: int) -> dict:
    """Segmented LoRA on a q/o ([hidden, hidden]) or gate_up ([hidden, 2 inter]) projection:
    T rows in random order, split evenly over `adapters` groups (one slot each), against the
    per-group loop. Each side updates its own copy of y; the check compares the first deltas."""
    dt, dev, rank = s["dtype"], s["device"], s["lora"]["rank"]
    d_in, d_out = s["hidden"], s["hidden"] if proj == "q_o" else 2 * s["inter"]
    x = torch.randn(T, d_in, dtype=dt, device=dev)
    a = torch.randn(adapters, d_in, rank, dtype=dt, device=dev) * d_in**-0.5
    b = torch.randn(adapters, rank, d_out, dtype=dt, device=dev) * rank**-0.5
    y0 = torch.randn(T, d_out, dtype=dt, device=dev)
    y_tri, y_base = y0.clone(), y0.clone()
    starts = torch.arange(adapters + 1, device=dev) * T // adapters  # int64, even groups
    args = (x, a, b, torch.randperm(T, device=dev), starts, torch.arange(adapters, device=dev),
            triton.cdiv(T, adapters))
    work = (x.numel() + a.numel() + b.numel() + 2 * y0.numel()) * x.element_size()
    delta = lambda y: y.float() - y0.float()  # noqa: E731
    return dict(name=f"lora_{proj}_r{rank}_t{T}_a{adapters}", unit="GB/s", work=work,
                tri=lambda: (lora_delta_(y_tri, *args), y_tri)[1],
                base=lambda: (lora_delta_reference(y_base, *args), y_base)[1],
                check=lambda p, q: max_err(delta(p), delta(q)))


def case_sample(s: dict, B: int) -> dict:
    """Rows mixed: top-k 50 on even rows, top-p 0.9 on rows not divisible by 3 (both, either or
    neither), temperature 0.8, float32 logits as the model returns them."""
    dev = s["device"]
    logits = 4 * torch.randn(B, s["vocab"], device=dev)
    rows = torch.arange(B, device=dev)
    top_k = torch.where(rows % 2 == 0, 50, 0)
    top_p = torch.where(rows % 3 == 0, 1.0, 0.9).float()
    batch = SamplingBatch(temperature=torch.full((B,), 0.8, device=dev), top_p=top_p,
                          min_p=torch.zeros(B, device=dev), top_k=top_k, seeds=rows * 7919 + 1,
                          steps=torch.zeros_like(rows))
    return dict(name=f"sample_b{B}", unit="GB/s", work=logits.numel() * 4,
                tri=lambda: sample(logits, batch), base=lambda: sample_reference(logits, batch),
                check=lambda a, b: f"ids equal {int((a[0] == b[0]).sum())}/{B}")


def measure(build, peak: float, cuda: bool) -> dict:
    """One case: do_bench times (launches from Python included) and, for cases marked `graph`
    on CUDA, graph-replay times over cold copies of the inputs (bench/cuda_timing.py): how the
    server's decode steps run. Speed and % of peak are the graph's where there is one."""
    spec = build()
    check = spec["check"](spec["tri"](), spec["base"]())  # also compiles / warms both
    ms, base_ms = timeit(spec["tri"], cuda), timeit(spec["base"], cuda)
    r = dict(launch_ms=round(ms, 4), launch_baseline_ms=round(base_ms, 4))
    if cuda and spec.get("graph"):
        specs = [spec] + [build() for _ in range(copies_for(spec["work"]) - 1)]
        ms, base_ms = (graph_ms([sp[key] for sp in specs]) for key in ("tri", "base"))
        r.update(graph_copies=len(specs))
    div, gbs = (1e6, True) if spec["unit"] == "GB/s" else (1e9, False)  # work / ms -> unit
    rate, base_rate = spec["work"] / ms / div, spec["work"] / base_ms / div
    r.update(ms=round(ms, 4), baseline_ms=round(base_ms, 4), speedup=round(base_ms / ms, 3))
    r["gbs" if gbs else "tflops"] = round(rate, 1)
    pct = f" ({100 * rate / peak:4.0f}% peak)" if gbs else ""
    if gbs:
        r["pct_peak"] = round(100 * rate / peak, 1)
    how = "graph" if "graph_copies" in r else "launch"
    print(f"{spec['name']:<30} {how:<6} triton {ms:9.4f} ms {rate:8.1f} {spec['unit']}{pct} | "
          f"baseline {base_ms:9.4f} ms {base_rate:8.1f} {spec['unit']} | speed "
          f"x{base_ms / ms:5.2f} | launch x{r['launch_baseline_ms'] / r['launch_ms']:5.2f} | "
          f"{check}", flush=True)
    return r


def builders(s: dict) -> list:
    p = functools.partial
    return [*(p(case_decode, s, b, c) for b, c in s["decode"]),
            p(case_decode_int8, s, *s["decode"][0]),
            *([p(case_decode_fp8, s, *s["decode"][0])] if fp8_ok(s["device"]) else []),
            p(case_decode_paged, s, *s["decode"][0]),
            *(p(case_w4a16, s, m, n, s["hidden"]) for m in (1, 16)
              for n in (s["hidden"], s["inter"])),
            *(p(case_prefill, s, *args) for args in s["prefill"]),
            *(p(case_norm, s, t) for t in s["norm"]),
            p(case_rope, s, s["tokens"]), p(case_silu, s, s["tokens"]),
            p(case_gelu, s, s["tokens"]),
            *(p(case_fused_moe, s, t) for t in s["moe_tokens"]),
            *(p(case_lora, s, proj, t, n) for proj in ("q_o", "gate_up")
              for t in s["lora"]["rows"] for n in s["lora"]["adapters"]),
            p(case_sample, s, s["sample"])]


def targets(s: dict, res: dict) -> dict:
    """Name -> (value, PASS/MISS) for the kernels issue's three targets, INT8 KV's and
    W4A16's (none for the fused MoE or the activations)."""
    b, c = s["decode"][0]
    n, q_len, prefix = s["prefill"][0]
    dec = res.get(f"decode_attn_b{b}_ctx{c}", {}).get("pct_peak", 0.0)
    norm = res.get(f"add_rms_norm_t{s['norm'][0]}", {}).get("pct_peak", 0.0)
    pre = res.get(f"prefill_attn_{n}x{q_len}", {})
    ratio = pre["ms"] / pre["baseline_ms"] if pre.get("ms") else float("inf")
    ok = lambda good: "PASS" if good else "MISS"
    int8 = res.get(f"decode_attn_int8_b{b}_ctx{c}", {}).get("speedup", 0.0)
    b1, c1 = s["decode"][1]
    long = res.get(f"decode_attn_b{b1}_ctx{c1}", {}).get("pct_peak", 0.0)
    w4 = {f"w4a16_gemm_m1_{n}x{s['hidden']}_speedup_vs_bf16>={W4A16_SPEEDUP:g}":
          (v, ok(v >= W4A16_SPEEDUP)) for n in (s["hidden"], s["inter"])
          for v in [res.get(f"w4a16_gemm_m1_{n}x{s['hidden']}", {}).get("speedup", 0.0)]}
    return {**w4, f"decode_attn_int8_b{b}_ctx{c}_speedup_vs_16bit>={INT8_SPEEDUP:g}":
                (int8, ok(int8 >= INT8_SPEEDUP)),
            f"decode_attn_b{b}_ctx{c}_pct_peak>={DECODE_PCT:g}": (dec, ok(dec >= DECODE_PCT)),
            f"decode_attn_b{b1}_ctx{c1}_pct_peak>={LONG_PCT:g}": (long, ok(long >= LONG_PCT)),
            f"add_rms_norm_t{s['norm'][0]}_pct_peak>={NORM_PCT:g}": (norm, ok(norm >= NORM_PCT)),
            f"prefill_{n}x{q_len}_time/flash<={PREFILL_RATIO:g}":
                (round(ratio, 3), ok(ratio <= PREFILL_RATIO))}


def apply_tilings(tuned: dict) -> None:
    """The kernels' launch shapes set to bench/gpu_tune.py's best candidates (this process)."""
    decode_attention_module = importlib.import_module("pipellm.kernels.decode_attention")
    int4_gemm_module = importlib.import_module("pipellm.kernels.int4_gemm")
    best = lambda key: (tuned.get(key) or {}).get("best")  # noqa: E731
    if r := best("int8_decode_b64"):
        decode_attention_module.TILINGS["int8"] = Tiling(**r["tiling"])
    if r := best("fp8_decode_b64"):
        decode_attention_module.TILINGS["fp8"] = Tiling(**r["tiling"])
    if r := best("decode_b1"):
        decode_attention_module.TILINGS["16bit"] = Tiling(**r["tiling"])
    tinygemm_rows = []  # the rows at which tinygemm's tiles won
    for key in tuned:
        if key.startswith(("w4a16_m1_", "w4a16_rows_m")) and (r := best(key)):
            rows = 1 if key.startswith("w4a16_m1_") else int(key.split("_")[2][1:])
            if r["tiling"] == "tiles":
                tinygemm_rows.append(rows)
            elif rows == 1 and isinstance(r["tiling"], dict):  # a Triton tiling won
                n, k = map(int, key.removeprefix("w4a16_m1_").split("x"))
                int4_gemm_module.TUNED[n, k] = GemmTiling(**r["tiling"])
    if any(key.startswith("w4a16_m1_") for key in tuned):
        int4_gemm_module.TINYGEMM_ROWS = max(tinygemm_rows, default=0)
    print(f"tilings from bench/gpu_tune.py: 16-bit {decode_attention_module.TILINGS['16bit']}, "
          f"int8 {decode_attention_module.TILINGS['int8']}, "
          f"fp8 {decode_attention_module.TILINGS['fp8']}, W4A16 {int4_gemm_module.TUNED}, "
          f"tinygemm up to {int4_gemm_module.TINYGEMM_ROWS} rows")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (smoke run; see docstring)")
    p.add_argument("--tilings", help="bench/gpu_tune.py's JSON: run with its best tilings")
    args = p.parse_args(argv)
    if args.tilings:
        apply_tilings(json.loads(Path(args.tilings).read_text()))
    cuda = torch.cuda.is_available()
    s = dict(QUICK if args.quick else FULL, device=torch.device("cuda" if cuda else "cpu"),
             dtype=torch.bfloat16 if cuda else torch.float16)  # the interpreter's dot: no bf16
    dispatch.set_backend("triton")  # the public functions run their Triton kernels
    device = torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1)"
    print(f"device: {device}; torch {torch.__version__}, triton {triton.__version__}; "
          f"{s['dtype']}{'; quick shapes' if args.quick else ''}")
    if not cuda:
        print("WARNING: no CUDA device: kernels run under the Triton interpreter; the timings "
              "below are meaningless (smoke test of the code paths only)")
    torch.manual_seed(0)
    peak = peak_gbs(s, cuda)
    print(f"peak bandwidth (device copy of {s['copy_mib']} MiB, read + write): {peak:.1f} GB/s")
    res = {}
    for build in builders(s):
        try:
            name = build()["name"]
            res[name] = measure(build, peak, cuda)
        except Exception as exc:  # one failing case must not lose the others' figures
            print(f"ERROR in {build.func.__name__}{build.args[1:]}: {type(exc).__name__}: {exc}")
            res[f"{build.func.__name__}{build.args[1:]}"] = dict(error=str(exc)[:300])
        if cuda:
            torch.cuda.empty_cache()
    tg = targets(s, res)
    for name, (value, verdict) in tg.items():
        print(f"target {name}: {value} {verdict}")
    b, c = s["decode"][0]
    paged = res.get(f"decode_attn_vs_paged{PAGE}_b{b}_ctx{c}", {}).get("speedup")
    print(f"paged attention slowdown (block table, page {PAGE}): {paged}")
    m = s["moe"]
    moe = {t: res.get(f"fused_moe_e{m['experts']}k{m['top_k']}_t{t}", {}).get("speedup")
           for t in s["moe_tokens"]}
    print(f"fused MoE speed vs the per-expert loop, by tokens: {moe}")
    lora = {k: v.get("speedup") for k, v in res.items() if k.startswith("lora_")}
    print(f"LoRA SGMV speed vs the per-group loop: {lora}")
    print(json.dumps(dict(device=device, torch=torch.__version__, triton=triton.__version__,
                          quick=args.quick, timings_meaningful=cuda, peak_gbs=round(peak, 1),
                          paged_attn_slowdown=paged, fused_moe_speedup_vs_loop=moe,
                          lora_speedup_vs_loop=lora,
                          kernels=res,
                          targets={k: v[1] for k, v in tg.items()})))


if __name__ == "__main__":
    main()
