// Fused RoPE + KV-cache write: the CPU twin of pipellm/kernels/rope.py's Triton kernel (reference:
// rope_kv_write_ref, i.e. RotaryEmbedding's math, then index_copy_ into the caches).
//
// q [T, H, D], k, v [T, Hkv, D]: strided views (e.g. split from the fused qkv output; only the
// head dim need be contiguous). positions, slots [T] int32/int64; cos, sin [max_pos, D / 2]
// float32. k_cache, v_cache [capacity, Hkv, D] in q's dtype, fp16 under float32 q (rounded to
// nearest as written), or int8 with fp16 scales k_scale, v_scale [capacity, Hkv, D / 8]
// (pipellm/kernels/kv_quant.py's groups of 8).
// Returns (q_rot [T, H, D], k_rot [T, Hkv, D]), new and contiguous; writes k_rot and v at
// row `slots[t]` of the caches (quantized for INT8 caches). One work item per token.
//
// Rotate-half: for a head x = [x1, x2], out = [x1 c - x2 s, x2 c + x1 s], with c, s the table
// rows rounded to x's dtype first (as the reference casts them). Computed in float32, rounded
// once, as the Triton kernel: bit-identical to the reference in float32; in fp16/bf16 the more
// accurate (the reference rounds each product), ~1 ulp apart. v is copied bit for bit; INT8
// rows quantize as quantize_kv does, bit for bit (scale = fp16(max |x| / 127) per group of 8;
// values round(x / scale) half away from 0).
#include "common.h"

#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 8;

// A [rows, heads, D] tensor's base and strides (elements): row r, head h at at(r, h).
template <typename T>
struct Heads {
  T* p = nullptr;
  int64_t sr = 0, sh = 0;
  T* at(int64_t r, int64_t h) const { return p + r * sr + h * sh; }
};

template <typename T>
Heads<T> heads_of(const at::Tensor& t) {
  return {t.data_ptr<std::remove_const_t<T>>(), t.stride(0), t.stride(1)};
}

template <typename scalar_t, typename cache_t>
struct RopeArgs {
  Heads<const scalar_t> q, k, v;
  scalar_t* q_out;  // [T, H, D] contiguous
  scalar_t* k_out;  // [T, Hkv, D] contiguous
  Heads<cache_t> kc, vc;
  Heads<at::Half> ks, vs;  // INT8 caches' scales (p nullptr otherwise)
  const float* cos;
  const float* sin;
  int64_t s_cos, s_sin;  // table row strides
  const int64_t* pos;
  const int64_t* slot;
  int64_t H, Hkv, D;
};

// One head x [D] -> o [D] rotated with table rows c, s [D / 2] (already in x's precision).
// The products go through p [2 D] before the sums: the compiler cannot contract them into FMAs,
// so float32 rounds as the reference does (bit-identical); in fp16/bf16 every product is exact.
template <typename scalar_t>
void rotate(const scalar_t* __restrict x, const float* __restrict c, const float* __restrict s,
            int64_t half, float* __restrict p, scalar_t* __restrict o) {
  for (int64_t d = 0; d < half; ++d) {
    const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[d + half]);
    p[d] = x1 * c[d];
    p[half + d] = x2 * s[d];
    p[2 * half + d] = x2 * c[d];
    p[3 * half + d] = x1 * s[d];
  }
  for (int64_t d = 0; d < half; ++d) {
    o[d] = static_cast<scalar_t>(p[d] - p[half + d]);
    o[d + half] = static_cast<scalar_t>(p[2 * half + d] + p[3 * half + d]);
  }
}

// Per-chunk fp32 scratch: table rows c, s [D / 2], rotate's products p [2 D], and for INT8
// caches one head row and its group scales.
struct Scratch {
  std::vector<float> c, s, p, row, scales;
  explicit Scratch(int64_t D) : c(D / 2), s(D / 2), p(2 * D), row(D), scales(D / kGroup) {}
};

// Head row x [D] -> cache row dst [D]: a copy, or int8 values and D / 8 fp16 scales at sc.
template <typename scalar_t, typename cache_t>
void write_row(const scalar_t* x, int64_t D, cache_t* dst, at::Half* sc, Scratch& w) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    float* row = w.row.data();
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(x[d]);
    for (int64_t g = 0; g < D / kGroup; ++g) {  // scale = fp16(max |x| / 127)
      float amax = 0.f;
      for (int64_t j = g * kGroup; j < (g + 1) * kGroup; ++j)
        amax = std::max(amax, std::abs(row[j]));
      sc[g] = static_cast<at::Half>(pipellm::ieee_div(amax, 127.f));
      w.scales[g] = static_cast<float>(sc[g]);  // quantize against the stored scale
    }
    pipellm::ieee_div_groups(row, D, w.scales.data(), kGroup);
    for (int64_t d = 0; d < D; ++d) dst[d] = pipellm::to_int8(row[d]);
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<cache_t>(x[d]);
  }
}

template <typename scalar_t, typename cache_t>
void rope_token(const RopeArgs<scalar_t, cache_t>& a, int64_t t, Scratch& w) {
  const int64_t half = a.D / 2, pos = a.pos[t], slot = a.slot[t];
  for (int64_t d = 0; d < half; ++d) {  // the tables rounded to x's dtype, as the reference
    w.c[d] = pipellm::round_to<scalar_t>(a.cos[pos * a.s_cos + d]);
    w.s[d] = pipellm::round_to<scalar_t>(a.sin[pos * a.s_sin + d]);
  }
  const float* c = w.c.data();
  const float* s = w.s.data();
  for (int64_t h = 0; h < a.H; ++h)
    rotate(a.q.at(t, h), c, s, half, w.p.data(), a.q_out + (t * a.H + h) * a.D);
  for (int64_t h = 0; h < a.Hkv; ++h) {
    scalar_t* kr = a.k_out + (t * a.Hkv + h) * a.D;
    rotate(a.k.at(t, h), c, s, half, w.p.data(), kr);
    write_row(kr, a.D, a.kc.at(slot, h), a.ks.p ? a.ks.at(slot, h) : nullptr, w);
    write_row(a.v.at(t, h), a.D, a.vc.at(slot, h), a.vs.p ? a.vs.at(slot, h) : nullptr, w);
  }
}

template <typename scalar_t, typename cache_t>
void rope_tokens(const RopeArgs<scalar_t, cache_t>& a, int64_t T) {
  pipellm::for_row_chunks(T, (a.H + 2 * a.Hkv) * a.D, [&](int64_t begin, int64_t end) {
    Scratch w(a.D);
    for (int64_t t = begin; t < end; ++t) rope_token(a, t, w);
  });
}

// An index tensor [T] (int32/int64) as int64, each checked to lie in [0, bound).
std::vector<int64_t> indices(const at::Tensor& t, int64_t T, int64_t bound, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == T, what, " must be [T]");
  std::vector<int64_t> out(T);
  AT_DISPATCH_INDEX_TYPES(t.scalar_type(), "rope_indices", [&] {
    const auto acc = t.accessor<index_t, 1>();
    for (int64_t i = 0; i < T; ++i) out[i] = acc[i];
  });
  for (int64_t i : out) TORCH_CHECK(0 <= i && i < bound, what, " out of range: ", i);
  return out;
}

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
           const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
           const at::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k_cache.dim() == 3, "q, k, v, caches: 3-D");
  const int64_t D = q.size(2);
  TORCH_CHECK(D % 2 == 0 && k.size(0) == q.size(0) && k.size(2) == D && v.sizes() == k.sizes(),
              "bad q/k/v shapes");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k, v must share a dtype");
  TORCH_CHECK(k_cache.size(1) == k.size(1) && k_cache.size(2) == D &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "caches must be [capacity, Hkv, D], one dtype");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D / 2 && sin.sizes() == cos.sizes() &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos/sin must be float32 [max_pos, D / 2]");
  for (const auto* t : {&q, &k, &v, &cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->stride(-1) == 1, "last dims must be contiguous");
}

void check_scales(const at::Tensor& k_cache, const at::Tensor& ks, const at::Tensor& vs) {
  const int64_t D = k_cache.size(2);
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && D % kGroup == 0,
              "INT8 caches: int8 values, head_dim a multiple of 8");
  for (const auto* s : {&ks, &vs})
    TORCH_CHECK(s->scalar_type() == at::kHalf && s->dim() == 3 && s->stride(2) == 1 &&
                s->size(0) == k_cache.size(0) && s->size(1) == k_cache.size(1) &&
                s->size(2) == D / kGroup, "scales must be fp16 [capacity, Hkv, D / 8]");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rope_kv_write(
    at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor positions,
    at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
    at::Tensor slots, std::optional<at::Tensor> k_scale,
    std::optional<at::Tensor> v_scale) {
  check(q, k, v, cos, sin, k_cache, v_cache);
  const bool int8 = k_scale.has_value();
  TORCH_CHECK(int8 == v_scale.has_value(), "pass both k_scale and v_scale, or neither");
  if (int8) check_scales(k_cache, *k_scale, *v_scale);
  const bool half = !int8 && k_cache.scalar_type() == at::kHalf && q.scalar_type() == at::kFloat;
  TORCH_CHECK(int8 || half || k_cache.scalar_type() == q.scalar_type(),
              "caches must be q's dtype, fp16 under float32 q, or int8");
  const int64_t T = q.size(0), H = q.size(1), Hkv = k.size(1), D = q.size(2);
  const auto pos = indices(positions, T, cos.size(0), "positions");
  const auto slot = indices(slots, T, k_cache.size(0), "slots");
  auto q_rot = at::empty({T, H, D}, q.options());
  auto k_rot = at::empty({T, Hkv, D}, k.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rope_kv_write", [&] {
    auto run = [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      RopeArgs<scalar_t, cache_t> a{heads_of<const scalar_t>(q), heads_of<const scalar_t>(k),
                                    heads_of<const scalar_t>(v), q_rot.data_ptr<scalar_t>(),
                                    k_rot.data_ptr<scalar_t>(), heads_of<cache_t>(k_cache),
                                    heads_of<cache_t>(v_cache), {}, {}, cos.data_ptr<float>(),
                                    sin.data_ptr<float>(), cos.stride(0), sin.stride(0),
                                    pos.data(), slot.data(), H, Hkv, D};
      if (int8) a.ks = heads_of<at::Half>(*k_scale), a.vs = heads_of<at::Half>(*v_scale);
      rope_tokens(a, T);
    };
    if (int8) run(int8_t{});
    else if (half) run(at::Half{});
    else run(scalar_t{});
  });
  return {q_rot, k_rot};
}
