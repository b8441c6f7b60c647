// Prefill attention on AMX tiles (BF16 products, float32 sums): per sequence and KV head, K and
// V are packed once into the tiles' B layouts (pairs of rows interleaved, zero keys up to a
// multiple of 64); then per (sequence, head, block of 16 queries), taken longest first from a
// shared counter:
//   S = Q K^T over the keys the block sees (64 at a time: C tiles 0-3, Q in tile 4, K in 5),
//   each row's exact softmax in float32 (AVX-512) of its causal keys, P = e^(s - max) as two
//   bf16 parts (its rounding and the rest: about 16 bits, where FlashAttention keeps 8), or
//   with `coarse_p` its rounding alone (8 bits, one tile product fewer), zeros past the row's
//   last key;
//   O = P V (64 output dims at a time: C tiles 0-3, P's parts in tiles 6 and 5, V in 7),
//   divided by the row's sum and rounded to bf16.
// Not an online softmax: a block's scores for every key it sees are held at once (16 rows of
// float32 per thread), which a prompt's keys fit in.
#include "prefill_attention.h"
#include "isa_target.h"

#include <memory>
#include <numeric>

#if defined(PIPELLM_X86) && defined(__linux__)

PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
#include "simd_avx512.h"
#include "prefill_attention_schedule.h"
#ifdef PIPELLM_AMX_EMULATE
#include "amx_emulate.h"
#endif

namespace {

using pipellm::prefill::Args;
using bf16 = c10::BFloat16;
using V = Avx512F;

constexpr int64_t kRows = 16;   // queries of a block: a tile's rows
constexpr int64_t kKeys = 64;   // keys a QK pass scores (4 C tiles of 16)
constexpr int64_t kStep = 32;   // keys a PV tile product sums (a bf16 A tile's width)
constexpr int64_t kTile = 512;  // bf16 values in a packed 16 x 32 tile (1 KiB)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {  // all eight tiles: 16 rows of 64 bytes
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

int64_t padded(int64_t n) { return (n + kKeys - 1) / kKeys * kKeys; }

// One (sequence, KV head)'s K and V in B-tile layouts, n_pad keys (zeros past n):
//   k: [n_pad / 16 key blocks][D / 32 dim chunks][16 dim pairs][16 keys][2]
//   v: [n_pad / 32 key steps][D / 16 dim blocks][16 key pairs][16 dims][2]
// K's tiles are 16 x 16 transposes of (key, dim pair) words, gathered a row at a time; V's rows
// interleave two keys' 16 dims.
void pack(const Args& a, int64_t s, int64_t g, bf16* kp, bf16* vp) {
  const int64_t n = a.lens[s], n_pad = padded(n), D = a.D;
  const bf16* k = static_cast<const bf16*>(a.k) + a.starts[s] * a.k_ts + g * a.k_hs;
  const bf16* v = static_cast<const bf16*>(a.v) + a.starts[s] * a.v_ts + g * a.v_hs;
  const __m512i keys = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5,
                                                           4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(a.k_ts / 2)));
  for (int64_t b = 0; b < n_pad / 16; ++b) {
    const int64_t left = std::clamp<int64_t>(n - b * 16, 0, 16);
    const __mmask16 valid = static_cast<__mmask16>((1u << left) - 1);
    const int* base = reinterpret_cast<const int*>(k + b * 16 * a.k_ts);
    for (int64_t c = 0; c < D / 32; ++c)
      for (int64_t r = 0; r < 16; ++r)
        _mm512_storeu_si512(kp + ((b * (D / 32) + c) * 16 + r) * 32,
                            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, keys,
                                                        base + c * 16 + r, 4));
  }
  const __m256i none = _mm256_setzero_si256();
  for (int64_t t = 0; t < n_pad / kStep; ++t)
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t key = t * kStep + 2 * r;
      for (int64_t u = 0; u < D / 16; ++u) {
        auto row = [&](int64_t i) {
          return i < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i * a.v_ts +
                                                                               u * 16))
                       : none;
        };
        const __m512i lo = _mm512_cvtepu16_epi32(row(key));
        const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(row(key + 1)), 16);
        _mm512_storeu_si512(vp + ((t * (D / 16) + u) * 16 + r) * 32, _mm512_or_si512(lo, hi));
      }
    }
}

struct Scratch {
  std::vector<float> s;  // [16, width] scores
  std::vector<bf16> p;   // [16, width] e^(s - max) rounded to bf16
  std::vector<bf16> lo;  // [16, width] what that rounding left out, rounded to bf16 (unused
                         // with coarse_p)
  std::vector<bf16> q;   // [16, D] the block's queries (zero rows past the last)
  std::vector<float> o;  // [16, 64] one pass of P V
  std::vector<float> sum;
};

// scores s[16, 0 .. nk64) of the block's queries (sq) against the packed keys
void scores(const bf16* sq, const bf16* kp, int64_t D, int64_t nk64, float* s, int64_t width) {
  for (int64_t k0 = 0; k0 < nk64; k0 += kKeys) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(4, sq + c * 32, D * sizeof(bf16));
      const bf16* b = kp + ((k0 / 16) * (D / 32) + c) * kTile;
      const int64_t next = (D / 32) * kTile;  // the next block of 16 keys, same chunk
      _tile_loadd(5, b, 64); _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(5, b + next, 64); _tile_dpbf16ps(1, 4, 5);
      _tile_loadd(5, b + 2 * next, 64); _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(5, b + 3 * next, 64); _tile_dpbf16ps(3, 4, 5);
    }
    const int64_t stride = width * sizeof(float);
    _tile_stored(0, s + k0, stride); _tile_stored(1, s + k0 + 16, stride);
    _tile_stored(2, s + k0 + 32, stride); _tile_stored(3, s + k0 + 48, stride);
  }
}

// 2^x (x <= 0): 2^f by its Taylor polynomial for f = x - round(x) in [-1/2, 1/2] (relative
// error ~1e-7), scaled by 2^round(x) (scalef: 0 far below, no integer tricks)
V::F exp2(V::F x) {
  const V::F n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const V::F f = V::sub(x, n);
  V::F y = V::set1(1.5403530e-4f);
  for (float c : {1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f,
                  1.0f})
    y = V::fmadd(y, f, V::set1(c));
  return _mm512_scalef_ps(y, n);
}

// e as two bf16 parts at p and lo: e's rounding and the rest (together ~16 bits of e); lo
// null: the rounding alone
void store_split(bf16* p, bf16* lo, V::F e) {
  const V::F hi = V::round_bf16(e);
  V::store(p, hi);
  if (lo) V::store(lo, V::sub(e, hi));
}

// row r of p and lo: e^(scale * (s - max)) over keys [0, seen) split in two bf16 parts (lo
// null: rounded to bf16 alone), zeros over [seen, nk32); the sum
float softmax_row(const float* s, bf16* p, bf16* lo, int64_t seen, int64_t nk32,
                  float scale) {
  const int64_t full = seen / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (seen - full)) - 1);
  V::F m = V::set1(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < full; j += 16) m = _mm512_max_ps(m, V::loadf(s + j));
  if (tail) m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + full));
  const float sl = scale * 1.44269504f;  // e^(scale * d) = 2^(sl * d)
  const V::F mx = V::set1(_mm512_reduce_max_ps(m) * sl), sc = V::set1(sl);
  V::F acc = V::fzero();
  for (int64_t j = 0; j < full; j += 16) {
    const V::F e = exp2(_mm512_fmsub_ps(V::loadf(s + j), sc, mx));
    acc = V::add(acc, e);
    store_split(p + j, lo ? lo + j : nullptr, e);
  }
  if (tail) {
    const V::F e = _mm512_maskz_mov_ps(tail, exp2(_mm512_fmsub_ps(
        _mm512_maskz_loadu_ps(tail, s + full), sc, mx)));
    acc = V::add(acc, e);
    store_split(p + full, lo ? lo + full : nullptr, e);
  }
  for (int64_t j = full + (tail ? 16 : 0); j < nk32; j += 16) {
    V::store(p + j, V::fzero());
    if (lo) V::store(lo + j, V::fzero());
  }
  return V::sum(acc);
}

// out rows [0, m) of the block = (P V) / sum, 64 dims a pass (lo null: P's first part alone)
void weighted(const bf16* p, const bf16* lo, const bf16* vp, int64_t D, int64_t nk32,
              int64_t width, const float* sum, int64_t m, float* o, bf16* out,
              int64_t out_ts) {
  for (int64_t e = 0; e < D; e += 64) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t t = 0; t < nk32 / kStep; ++t) {
      _tile_loadd(6, p + t * kStep, width * sizeof(bf16));
      const bf16* b = vp + (t * (D / 16) + e / 16) * kTile;
      if (lo) {
        _tile_loadd(5, lo + t * kStep, width * sizeof(bf16));
        _tile_loadd(7, b, 64); _tile_dpbf16ps(0, 6, 7); _tile_dpbf16ps(0, 5, 7);
        _tile_loadd(7, b + kTile, 64); _tile_dpbf16ps(1, 6, 7); _tile_dpbf16ps(1, 5, 7);
        _tile_loadd(7, b + 2 * kTile, 64); _tile_dpbf16ps(2, 6, 7); _tile_dpbf16ps(2, 5, 7);
        _tile_loadd(7, b + 3 * kTile, 64); _tile_dpbf16ps(3, 6, 7); _tile_dpbf16ps(3, 5, 7);
      } else {
        _tile_loadd(7, b, 64); _tile_dpbf16ps(0, 6, 7);
        _tile_loadd(7, b + kTile, 64); _tile_dpbf16ps(1, 6, 7);
        _tile_loadd(7, b + 2 * kTile, 64); _tile_dpbf16ps(2, 6, 7);
        _tile_loadd(7, b + 3 * kTile, 64); _tile_dpbf16ps(3, 6, 7);
      }
    }
    _tile_stored(0, o, 256); _tile_stored(1, o + 16, 256);
    _tile_stored(2, o + 32, 256); _tile_stored(3, o + 48, 256);
    for (int64_t r = 0; r < m; ++r) {
      const V::F inv = V::set1(1.0f / sum[r]);
      for (int64_t j = 0; j < 64; j += 16)
        V::store(out + r * out_ts + e + j, V::mul(V::loadf(o + r * 64 + j), inv));
    }
  }
}

// the queries [i0, i0 + 16) of sequence s at head h
void block(const Args& a, int64_t s, int64_t h, int64_t i0, const bf16* kp, const bf16* vp,
           Scratch& w) {
  const int64_t n = a.lens[s], m_all = a.cu[s + 1] - a.cu[s], prefix = n - m_all, D = a.D;
  const int64_t m = std::min(kRows, m_all - i0), width = padded(n);
  const int64_t nk = std::min(n, prefix + i0 + kRows);  // keys the block's last row sees
  const int64_t nk64 = padded(nk), nk32 = (nk + kStep - 1) / kStep * kStep;
  const bf16* q = static_cast<const bf16*>(a.q) + (a.cu[s] + i0) * a.q_ts + h * a.q_hs;
  for (int64_t r = 0; r < kRows; ++r) {
    if (r < m) std::memcpy(w.q.data() + r * D, q + r * a.q_ts, D * sizeof(bf16));
    else std::memset(w.q.data() + r * D, 0, D * sizeof(bf16));
  }
  scores(w.q.data(), kp, D, nk64, w.s.data(), width);
  bf16* lo = a.coarse_p ? nullptr : w.lo.data();
  for (int64_t r = 0; r < kRows; ++r) {
    bf16* pr = w.p.data() + r * width;
    bf16* lr = lo ? lo + r * width : nullptr;
    if (r < m) {
      w.sum[r] = softmax_row(w.s.data() + r * width, pr, lr, prefix + i0 + r + 1, nk32,
                             a.scale);
    } else {
      std::memset(pr, 0, nk32 * sizeof(bf16));
      if (lr) std::memset(lr, 0, nk32 * sizeof(bf16));
    }
  }
  bf16* out = static_cast<bf16*>(a.out) + ((a.cu[s] + i0) * a.H + h) * D;
  weighted(w.p.data(), lo, vp, D, nk32, width, w.sum.data(), m, w.o.data(), out, a.H * D);
}

}  // namespace

void pipellm::prefill::run_amx(const Args& a) {
  const int64_t G = a.H / a.Hkv;
  std::vector<int64_t> offset(a.S + 1, 0);  // packed elements before sequence s's
  int64_t widest = 0;
  for (int64_t s = 0; s < a.S; ++s) {
    offset[s + 1] = offset[s] + padded(a.lens[s]) * a.D * a.Hkv;
    widest = std::max(widest, padded(a.lens[s]));
  }
  // (not value-initialized: pack writes every element)
  const std::unique_ptr<bf16[]> kp(new bf16[offset[a.S]]), vp(new bf16[offset[a.S]]);
  Work work = work_of(a, kRows);
  auto at_of = [&](const Item& it, int64_t g) {  // sequence it.s's packed KV head g
    return offset[it.s] + g * padded(a.lens[it.s]) * a.D;
  };
  for_each_item<bool>(work.packs, [&](const Item& it, bool&) {
    pack(a, it.s, it.h, kp.get() + at_of(it, it.h), vp.get() + at_of(it, it.h));
  });
  for_each_item<Scratch>(work.blocks, [&](const Item& it, Scratch& w) {
    if (w.s.empty()) {  // a thread's first block: its tiles and buffers
      configure_tiles();
      w = Scratch{std::vector<float>(kRows * widest), std::vector<bf16>(kRows * widest),
                  std::vector<bf16>(a.coarse_p ? 0 : kRows * widest),
                  std::vector<bf16>(kRows * a.D),
                  std::vector<float>(kRows * 64), std::vector<float>(kRows)};
    }
    const int64_t g = it.h / G;
    block(a, it.s, it.h, it.i0, kp.get() + at_of(it, g), vp.get() + at_of(it, g), w);
  }, [](Scratch& w) { if (!w.s.empty()) _tile_release(); });
}
PIPELLM_TARGET_END

#else
void pipellm::prefill::run_amx(const Args&) {
  throw std::runtime_error("not an x86 Linux build");
}
#endif
