// The segmented LoRA delta on AMX tiles (BF16): x, a and b in bfloat16, a and b packed in pairs
// of rows (VNNI: pipellm/kernels/lora.py's vnni_pack), the products summed in float32 tiles. Two passes,
// each a set of equal work items shared by the threads (each thread configures its tiles):
//   shrink: per group and block of 16 of its rows, h[rows] = x[rows] @ a[slot] rounded to
//           bf16 (as vLLM's punica expand takes it): x's rows gathered (zero rows past the
//           group's end), K in steps of 32, R in tiles of 16;
//   expand: per group, block of 16 rows and block of 64 columns of out, y[rows] += h[rows] @
//           b[slot]: K in steps of 16 over only the rows of b of the parts the columns are in,
//           y read and written once.
// Tiles: 0-3 C (16 x 16 float32), 4 and 5 the shrink's A and B (K 32), 6 and 7 the expand's
// (K 16).
#include "lora.h"
#include "isa_target.h"

#include <array>
#include <type_traits>

#if defined(PIPELLM_X86) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
#include "simd_avx512.h"
#ifdef PIPELLM_AMX_EMULATE
#include "amx_emulate.h"
#endif

namespace {

using pipellm::lora::Args;
using pipellm::lora::DType;
using pipellm::lora::part_rows;
using pipellm::lora::row_blocks;
using bf16 = c10::BFloat16;

constexpr int64_t kRows = 16, kCols = 16, kShrinkK = 32, kExpandK = 16, kOutBlock = 64;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = kRows, c.colsb[t] = kCols * 4;
  c.rows[4] = kRows, c.colsb[4] = kShrinkK * 2;      // A: 16 rows x 32 bf16
  c.rows[5] = kShrinkK / 2, c.colsb[5] = kCols * 4;  // B: 16 pairs x 16 columns
  c.rows[6] = kRows, c.colsb[6] = kExpandK * 2;
  c.rows[7] = kExpandK / 2, c.colsb[7] = kCols * 4;
  _tile_loadconfig(&c);
}

// C tile T (0..3) += A x B: the shrink's (tiles 4, 5) or the expand's (6, 7); the tile
// numbers must be literals (they are registers in the instruction)
#define PIPELLM_SHRINK_TILE(T, b, stride) \
  do { _tile_loadd(5, b, stride); _tile_dpbf16ps(T, 4, 5); } while (0)
#define PIPELLM_EXPAND_TILE(T, b, stride) \
  do { _tile_loadd(7, b, stride); _tile_dpbf16ps(T, 6, 7); } while (0)

void zero_tiles() { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }

void store_tiles(int n, float* c, int64_t stride) {  // the first n C tiles, side by side
  if (n > 0) _tile_stored(0, c, stride);
  if (n > 1) _tile_stored(1, c + kCols, stride);
  if (n > 2) _tile_stored(2, c + 2 * kCols, stride);
  if (n > 3) _tile_stored(3, c + 3 * kCols, stride);
}

// hb[i0 .. i0 + m) = x[rows[those]] @ a_s rounded to bf16; xs [kRows, in] and hs [kRows, R]
// scratch
void shrink_block(const Args& a, const bf16* as, int64_t i0, int64_t m, bf16* xs, float* hs,
                  bf16* hb) {
  const bf16* x = static_cast<const bf16*>(a.x);
  for (int64_t r = 0; r < kRows; ++r) {
    if (r < m) std::memcpy(xs + r * a.in, x + a.rows[i0 + r] * a.x_rs, a.in * sizeof(bf16));
    else std::memset(xs + r * a.in, 0, a.in * sizeof(bf16));
  }
  const int64_t b_stride = a.R * 2 * sizeof(bf16);  // a pair of a's rows
  for (int64_t n0 = 0; n0 < a.R; n0 += 4 * kCols) {
    const int n = static_cast<int>(std::min<int64_t>(4, (a.R - n0) / kCols));
    zero_tiles();
    for (int64_t k0 = 0; k0 < a.in; k0 += kShrinkK) {
      _tile_loadd(4, xs + k0, a.in * sizeof(bf16));
      const bf16* b = as + (k0 / 2 * a.R + n0) * 2;
      PIPELLM_SHRINK_TILE(0, b, b_stride);
      if (n > 1) PIPELLM_SHRINK_TILE(1, b + 2 * kCols, b_stride);
      if (n > 2) PIPELLM_SHRINK_TILE(2, b + 4 * kCols, b_stride);
      if (n > 3) PIPELLM_SHRINK_TILE(3, b + 6 * kCols, b_stride);
    }
    store_tiles(n, hs + n0, a.R * sizeof(float));
  }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < a.R; c += kCols)
      Avx512F::store(hb + (i0 + r) * a.R + c, Avx512F::loadf(hs + r * a.R + c));
}

// y[rows[i0 .. i0 + m)][o0 .. o0 + 16 n) += hb[i0 .. i0 + kRows) @ b_s (rows past m
// computed, not written); ys [kRows, kOutBlock] scratch
template <typename Y>
void expand_block(const Args& a, const bf16* bs, int64_t i0, int64_t m, int64_t o0, int n,
                  const bf16* hb, float* ys) {
  const auto [k0, k1] = part_rows(a, o0, o0 + n * kCols);
  const int64_t b_stride = a.out * 2 * sizeof(bf16);
  zero_tiles();
  for (int64_t k = k0; k < k1; k += kExpandK) {
    _tile_loadd(6, hb + i0 * a.R + k, a.R * sizeof(bf16));
    const bf16* b = bs + (k / 2 * a.out + o0) * 2;
    PIPELLM_EXPAND_TILE(0, b, b_stride);
    if (n > 1) PIPELLM_EXPAND_TILE(1, b + 2 * kCols, b_stride);
    if (n > 2) PIPELLM_EXPAND_TILE(2, b + 4 * kCols, b_stride);
    if (n > 3) PIPELLM_EXPAND_TILE(3, b + 6 * kCols, b_stride);
  }
  store_tiles(n, ys, kOutBlock * sizeof(float));
  for (int64_t r = 0; r < m; ++r) {
    Y* yr = static_cast<Y*>(a.y) + a.rows[i0 + r] * a.y_rs + o0;
    for (int c = 0; c < n; ++c)
      Avx512F::store(yr + c * kCols, Avx512F::add(Avx512F::load(yr + c * kCols),
                                                  Avx512F::loadf(ys + r * kOutBlock + c * kCols)));
  }
}

template <typename Y>
void run_typed(const Args& a, const bf16* a_vnni, const bf16* b_vnni) {
  const auto blocks = row_blocks(a, kRows);
  const int64_t B = static_cast<int64_t>(blocks.size());
  // h in bf16, kRows rows of zeros past the last so that every block reads kRows rows
  std::vector<bf16> hb((a.starts[a.G] + kRows) * a.R, bf16(0.0f));
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    configure_tiles();
    std::vector<bf16> xs(kRows * a.in);
    std::vector<float> hs(kRows * a.R);
    for (int64_t j = lo; j < hi; ++j) {
      const auto& [g, i0, m] = blocks[j];
      shrink_block(a, a_vnni + a.slots[g] * a.in * a.R, i0, m, xs.data(), hs.data(),
                   hb.data());
    }
    _tile_release();
  });
  const int64_t chunks = (a.out + kOutBlock - 1) / kOutBlock;
  at::parallel_for(0, B * chunks, 1, [&](int64_t lo, int64_t hi) {
    configure_tiles();
    std::vector<float> ys(kRows * kOutBlock);
    for (int64_t j = lo; j < hi; ++j) {
      const auto& [g, i0, m] = blocks[j / chunks];
      const int64_t o0 = (j % chunks) * kOutBlock;
      const int n = static_cast<int>(std::min(kOutBlock, a.out - o0) / kCols);
      expand_block<Y>(a, b_vnni + a.slots[g] * a.R * a.out, i0, m, o0, n, hb.data(),
                      ys.data());
    }
    _tile_release();
  });
}

}  // namespace

void pipellm::lora::run_amx(const Args& args, const void* a_vnni, const void* b_vnni) {
  const auto* av = static_cast<const bf16*>(a_vnni);
  const auto* bv = static_cast<const bf16*>(b_vnni);
  switch (args.y_dtype) {
    case DType::kFloat: return run_typed<float>(args, av, bv);
    case DType::kBFloat16: return run_typed<bf16>(args, av, bv);
    case DType::kHalf: return run_typed<c10::Half>(args, av, bv);
  }
}
PIPELLM_TARGET_END

bool pipellm::lora::amx_ready() {
#ifdef PIPELLM_AMX_EMULATE
  return true;  // emulated tiles need no permission
#else
  // Linux hands AMX's tile state to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ready;
#endif
}
#else
void pipellm::lora::run_amx(const Args&, const void*, const void*) {
  throw std::runtime_error("not an x86 Linux build");
}
bool pipellm::lora::amx_ready() { return false; }
#endif
