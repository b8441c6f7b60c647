"""Fused RoPE + KV-cache write: Triton kernel, launcher, PyTorch reference.

`rope_kv_write` replaces, in one kernel launch, the three steps of the attention block:

    q_rot = rope(q); k_rot = rope(k)                     (rotate-half layout, as HF Llama)
    k_cache[slots] = k_rot; v_cache[slots] = v           (index_copy_ at slots)

cos/sin are `RotaryEmbedding`'s float32 tables [max_positions, D // 2] (any scaling: the
scaling lives in the tables). For x = [x1, x2] (the two halves of a head):

    out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]

Rounding. The reference is `RotaryEmbedding.__call__` exactly: cos/sin are cast to x's dtype,
then the two products and their sum/difference each round to x's dtype. The kernel also casts
cos/sin to x's dtype (both use the same rounded table values) but then computes in float32 and
rounds once at the end.
  * float32: the same operations, bit-identical; the launch sets enable_fp_fusion=False so the
    GPU compiler cannot contract a product and the add into an FMA.
  * fp16 / bf16: the kernel is the more accurate; about a quarter of the elements differ from
    the reference, each by at most (eps/2)(|x1| + |x2|) + eps |out| (the reference's product
    roundings plus one rounding on each side), i.e. ~1 ulp except under cancellation.
v is copied bit-for-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipellm.kernels.dispatch import cpu_extension, use_triton
from pipellm.kernels.kv_quant import FP8, KV_GROUP, quantize_kv, to_fp8


@triton.jit
def _rotate(src, stride_h, heads, d, mask, c, s, HALF: tl.constexpr):
    """Rotated halves [BH, BD] (in src's dtype) of heads [BH] of the token row at `src`."""
    ptrs = src + heads[:, None] * stride_h + d[None, :]  # [BH, BD] first-half pointers
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    c = c.to(x1.dtype).to(tl.float32)[None, :]  # [1, BD] table rounded to x's dtype, as the ref
    s = s.to(x1.dtype).to(tl.float32)[None, :]
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o1 = x1f * c - x2f * s
    o2 = x2f * c + x1f * s
    return o1.to(x1.dtype), o2.to(x1.dtype)


@triton.jit
def _store_halves(dst, stride_h, heads, d, mask, o1, o2, HALF: tl.constexpr):
    """Store halves o1, o2 [BH, BD] into heads [BH] of the row at `dst`."""
    ptrs = dst + heads[:, None] * stride_h + d[None, :]  # [BH, BD]
    tl.store(ptrs, o1, mask=mask)
    tl.store(ptrs + HALF, o2, mask=mask)


@triton.jit
def _rope_q_block(q_row, sq_h, qo_row, hb, H, d, d_ok, c, s, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """Rotate q heads [hb * BLOCK_H, (hb + 1) * BLOCK_H) of one token into q_rot."""
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    mask = (heads < H)[:, None] & d_ok[None, :]  # [BH, BD]
    o1, o2 = _rotate(q_row, sq_h, heads, d, mask, c, s, HALF)
    _store_halves(qo_row, 2 * HALF, heads, d, mask, o1, o2, HALF)


@triton.jit
def _store_int8_half(dst, stride_h, s_dst, s_stride_h, heads, h_ok, d, mask, x, first_group,
                     HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     KV_GROUP: tl.constexpr):
    """Quantize half rows x [BH, BD] in groups of KV_GROUP (pipellm/kernels/kv_quant.py: fp16 scale
    = max |x| / 127, value = round(x / scale)); store the int8 values at `dst` and the scales
    at `s_dst` from group `first_group` on."""
    xf = x.to(tl.float32)
    groups = tl.reshape(tl.abs(xf), (BLOCK_H, BLOCK_D // KV_GROUP, KV_GROUP))
    scale = (tl.max(groups, axis=2) / 127.0).to(tl.float16)  # [BH, BD / G]
    sf = scale.to(tl.float32)
    per_value = tl.reshape(tl.broadcast_to(sf[:, :, None], (BLOCK_H, BLOCK_D // KV_GROUP,
                                                             KV_GROUP)), (BLOCK_H, BLOCK_D))
    q = xf / tl.where(per_value > 0, per_value, 1.0)
    q = tl.where(q >= 0, tl.floor(q + 0.5), -tl.floor(-q + 0.5))  # round half away from 0
    q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)
    tl.store(dst + heads[:, None] * stride_h + d[None, :], q, mask=mask)
    g = tl.arange(0, BLOCK_D // KV_GROUP)  # [BD / G] groups of this half
    g_mask = h_ok[:, None] & (g < HALF // KV_GROUP)[None, :]
    tl.store(s_dst + heads[:, None] * s_stride_h + (first_group + g)[None, :], scale,
             mask=g_mask)


@triton.jit
def _rope_kv_block(k_row, sk_h, v_row, sv_h, ko_row, kc_row, skc_h, vc_row, svc_h, ks_row,
                   vs_row, ss_h, hb, HKV, d, d_ok, c, s, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_INT8: tl.constexpr,
                   KV_GROUP: tl.constexpr, KV_FP8: tl.constexpr):
    """Rotate k heads of block hb of one token into k_rot and its cache slot; copy v there
    (KV_INT8: quantized, with their scales at ks_row, vs_row)."""
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    h_ok = heads < HKV
    mask = h_ok[:, None] & d_ok[None, :]  # [BH, BD]
    o1, o2 = _rotate(k_row, sk_h, heads, d, mask, c, s, HALF)
    _store_halves(ko_row, 2 * HALF, heads, d, mask, o1, o2, HALF)
    v_ptrs = v_row + heads[:, None] * sv_h + d[None, :]  # [BH, BD]
    v1 = tl.load(v_ptrs, mask=mask)
    v2 = tl.load(v_ptrs + HALF, mask=mask)
    if KV_INT8:
        half_groups = HALF // KV_GROUP
        for dst, stride, s_dst, x, first in ((kc_row, skc_h, ks_row, o1, 0),
                                             (kc_row + HALF, skc_h, ks_row, o2, half_groups),
                                             (vc_row, svc_h, vs_row, v1, 0),
                                             (vc_row + HALF, svc_h, vs_row, v2, half_groups)):
            _store_int8_half(dst, stride, s_dst, ss_h, heads, h_ok, d, mask, x, first,
                             HALF, BLOCK_H, BLOCK_D, KV_GROUP)
    elif KV_FP8:
        _store_halves(kc_row, skc_h, heads, d, mask, _fp8(o1), _fp8(o2), HALF)
        _store_halves(vc_row, svc_h, heads, d, mask, _fp8(v1), _fp8(v2), HALF)
    else:
        _store_halves(kc_row, skc_h, heads, d, mask, o1, o2, HALF)
        _store_halves(vc_row, svc_h, heads, d, mask, v1, v2, HALF)


@triton.jit
def _fp8(x):
    """x as e4m3, saturated at +-448 (pipellm/kernels/kv_quant.py's to_fp8). Rounded in fp32 first
    (to nearest, 3 mantissa bits; below e4m3's smallest normal 2**-6 to multiples of 2**-9),
    so the cast itself is exact: Triton's interpreter drops the carry when its own rounding
    reaches the next power of two (7.8 -> 4.0)."""
    xf = x.to(tl.float32)
    bits = xf.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # round off 20 of 23 bits
    r = bits.to(tl.float32, bitcast=True)
    r = tl.where(tl.abs(xf) < 0.015625, tl.floor(xf * 512.0 + 0.5) / 512.0, r)
    return tl.minimum(tl.maximum(r, -448.0), 448.0).to(tl.float8e4nv)


@triton.jit
def _rope_kv_kernel(
    q_ptr, k_ptr, v_ptr,  # [T, H, D], [T, Hkv, D], [T, Hkv, D] (head dim contiguous)
    pos_ptr, slot_ptr,  # [T] int32/int64 positions, cache slots
    cos_ptr, sin_ptr,  # [max_pos, D // 2] float32 (rows contiguous)
    kc_ptr, vc_ptr,  # [capacity, Hkv, D] caches (head dim contiguous)
    qo_ptr, ko_ptr,  # [T, H, D], [T, Hkv, D] outputs (contiguous)
    ks_ptr, vs_ptr,  # KV_INT8: [capacity, Hkv, D / KV_GROUP] fp16 scales (one layout)
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,  # strides (elements) over tokens and heads
    skc_t, skc_h, svc_t, svc_h, s_cos, ss_t, ss_h,
    H, HKV,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    KV_INT8: tl.constexpr, KV_GROUP: tl.constexpr, KV_FP8: tl.constexpr,
):
    # grid (T, cdiv(H, BLOCK_HQ) + cdiv(HKV, BLOCK_HKV)): first the q head blocks, then k/v.
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)  # [BD] index within a half
    d_ok = d < HALF
    c = tl.load(cos_ptr + pos * s_cos + d, mask=d_ok, other=0.0)  # [BD] float32
    s = tl.load(sin_ptr + pos * s_cos + d, mask=d_ok, other=0.0)
    n_qb = tl.cdiv(H, BLOCK_HQ)
    if hb < n_qb:
        _rope_q_block(q_ptr + t * sq_t, sq_h, qo_ptr + t * H * 2 * HALF, hb, H, d, d_ok, c, s,
                      HALF, BLOCK_HQ)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        _rope_kv_block(k_ptr + t * sk_t, sk_h, v_ptr + t * sv_t, sv_h,
                       ko_ptr + t * HKV * 2 * HALF, kc_ptr + slot * skc_t, skc_h,
                       vc_ptr + slot * svc_t, svc_h, ks_ptr + slot * ss_t, vs_ptr + slot * ss_t,
                       ss_h, hb - n_qb, HKV, d, d_ok, c, s, HALF, BLOCK_HKV, BLOCK_D, KV_INT8,
                       KV_GROUP, KV_FP8)


def _check(q, k, v, cos, k_cache, v_cache) -> None:
    """Shapes, dtypes and strides the kernel assumes (see `rope_kv_write`)."""
    T, _, D = q.shape
    if D % 2 or k.shape[0] != T or k.shape[2] != D or v.shape != k.shape:
        raise ValueError(f"bad q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    caches_ok = k_cache.shape[1:] == k.shape[1:] and v_cache.shape == k_cache.shape
    if cos.shape[-1] != D // 2 or not caches_ok:
        raise ValueError("cos/sin must be [max_pos, D // 2] and caches [capacity, Hkv, D]")
    if not (q.dtype == k.dtype == v.dtype) or k_cache.dtype != v_cache.dtype or (
            k_cache.dtype not in (q.dtype, torch.int8, FP8)):
        raise ValueError("q, k, v and the caches must share a dtype (or the caches be int8 or "
                         "fp8)")
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, k_cache, v_cache)):
        raise ValueError("the last dim of q, k, v, cos/sin and the caches must be contiguous")


def rope_kv_write_triton(q, k, v, positions, cos, sin, k_cache, v_cache, slots, k_scale=None,
                         v_scale=None):
    """Triton implementation of `rope_kv_write` (same arguments and result)."""
    _check(q, k, v, cos, k_cache, v_cache)
    int8 = k_scale is not None
    if int8 and (k_cache.dtype != torch.int8 or k_scale.stride() != v_scale.stride()
                 or k_scale.stride(-1) != 1 or (q.shape[-1] // 2) % KV_GROUP):
        raise ValueError("INT8 caches: int8 values, scales of one layout, head_dim / 2 a "
                         f"multiple of {KV_GROUP}")
    if sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError("sin must have cos's shape and strides")
    T, H, D = q.shape
    hkv = k.shape[1]
    q_rot = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    k_rot = torch.empty((T, hkv, D), dtype=k.dtype, device=k.device)
    if T == 0:
        return q_rot, k_rot
    block_d = triton.next_power_of_2(D // 2)
    cap = max(1, 2048 // block_d)  # heads per program: <= ~4K elements (two halves) per tile
    bhq = min(triton.next_power_of_2(H), cap)
    bhkv = min(triton.next_power_of_2(hkv), cap)
    grid = (T, triton.cdiv(H, bhq) + triton.cdiv(hkv, bhkv))
    scales = (k_scale, v_scale) if int8 else (k_rot, k_rot)  # placeholders without INT8
    _rope_kv_kernel[grid](
        q, k, v, positions, slots, cos, sin, k_cache, v_cache, q_rot, k_rot, *scales,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        cos.stride(0), scales[0].stride(0), scales[0].stride(1), H, hkv,
        HALF=D // 2, BLOCK_D=block_d, BLOCK_HQ=bhq, BLOCK_HKV=bhkv, KV_INT8=int8,
        KV_GROUP=KV_GROUP, KV_FP8=k_cache.dtype == FP8, num_warps=4,
        enable_fp_fusion=False,  # no FMA contraction: the reference's exact fp32 roundings
    )
    return q_rot, k_rot


def _rotate_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] -> rotated, in x's dtype; exactly `RotaryEmbedding.__call__`."""
    c = cos[positions][:, None, :].to(x.dtype)  # [T, 1, D/2]
    s = sin[positions][:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_kv_write_ref(q, k, v, positions, cos, sin, k_cache, v_cache, slots, k_scale=None,
                      v_scale=None):
    """PyTorch reference: RotaryEmbedding math on q and k, then index_copy_ into the caches
    (quantized to INT8 first when the caches have scales)."""
    q_rot = _rotate_ref(q, positions, cos, sin)  # [T, H, D]
    k_rot = _rotate_ref(k, positions, cos, sin)  # [T, Hkv, D]
    slots = slots.long()
    for cache, scales, rows in ((k_cache, k_scale, k_rot), (v_cache, v_scale, v)):
        if scales is not None:
            rows, row_scales = quantize_kv(rows)
            scales.index_copy_(0, slots, row_scales)
        elif cache.dtype == FP8:  # written as bytes: index_copy_ has no fp8 on a CPU
            rows, cache = to_fp8(rows).view(torch.uint8), cache.view(torch.uint8)
        cache.index_copy_(0, slots, rows.to(cache.dtype))  # fp16 caches: rounded to nearest
    return q_rot, k_rot


def rope_kv_write(
    q: torch.Tensor,  # [T, H, D] (e.g. a view of the fused qkv projection)
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64/int32 position of each token
    cos: torch.Tensor,  # [max_pos, D // 2] float32 (RotaryEmbedding.cos)
    sin: torch.Tensor,  # [max_pos, D // 2] float32 (RotaryEmbedding.sin)
    k_cache: torch.Tensor,  # [capacity, Hkv, D], written in place at `slots`
    v_cache: torch.Tensor,  # [capacity, Hkv, D], written in place at `slots`
    slots: torch.Tensor,  # [T] int64/int32 distinct cache slots
    k_scale: torch.Tensor | None = None,  # INT8 caches: [capacity, Hkv, D / KV_GROUP] fp16
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # q_rot [T, H, D], k_rot [T, Hkv, D]
    """Rotate q and k (rotate-half RoPE), store rotated k and raw v at `slots` of the caches.

    q, k, v may be strided views (last dim contiguous); the outputs are new contiguous tensors.
    With scales, the caches are INT8 (pipellm/kernels/kv_quant.py) and the rows are quantized as
    they are written (in the Triton kernel, fused); FP8 caches (float8_e4m3fn) get them saturated.
    fp16 caches under float32 q get them rounded to nearest (off Triton). Triton where
    `use_triton(q)`, else the C++ CPU kernel (pipellm/kernels/cpu/rope.cpp; float, fp16 and INT8
    caches) where it builds, else the reference (and for FP8 caches off Triton).
    """
    if use_triton(q):
        return rope_kv_write_triton(q, k, v, positions, cos, sin, k_cache, v_cache, slots,
                                    k_scale, v_scale)
    if k_cache.dtype != FP8 and (ext := cpu_extension(q)) is not None:
        return ext.rope_kv_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots, k_scale,
                                 v_scale)
    return rope_kv_write_ref(q, k, v, positions, cos, sin, k_cache, v_cache, slots, k_scale,
                             v_scale)
