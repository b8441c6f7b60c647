// AMX tiles emulated in plain C++, so that the AMX kernels' logic runs where the tiles are
// absent (pipellm/kernels/cpu/emulated.py builds those kernels with -DPIPELLM_AMX_EMULATE, for tests on
// any CPU with AVX512-BF16; the product never runs it). Eight tile registers a thread, and the
// intrinsics the kernels call, as macros over them:
//   _tile_loadconfig  rows and bytes a row of each tile (palette 1's layout)
//   _tile_zero, _tile_loadd, _tile_stored, _tile_release
//   _tile_dpbf16ps    C[m][n] += sum_k A[m][k].lo * B[k][n].lo + A[m][k].hi * B[k][n].hi
//                     (A: M rows of K bf16 pairs; B: K rows of N pairs; C: M x N floats), the
//                     products and sums in float32
// Speed means nothing here; the sums' rounding may differ from the hardware's in the last bits.
// Included after <immintrin.h>, whose tile macros it replaces.
#pragma once

#include <cstdint>
#include <cstring>

namespace pipellm::amx_emu {

struct Tile {
  alignas(64) uint8_t data[16][64];
  int rows = 16, colsb = 64;  // what the last _tile_loadconfig gave it
};

inline thread_local Tile tiles[8];

inline void loadconfig(const void* config) {  // palette 1: bytes 16-47 colsb, 48-63 rows
  const auto* c = static_cast<const uint8_t*>(config);
  for (int t = 0; t < 8; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, c + 16 + 2 * t, 2);
    tiles[t].colsb = colsb;
    tiles[t].rows = c[48 + t];
  }
}

inline void zero(int t) { std::memset(tiles[t].data, 0, sizeof(tiles[t].data)); }

inline void loadd(int t, const void* base, int64_t stride) {
  for (int r = 0; r < tiles[t].rows; ++r)
    std::memcpy(tiles[t].data[r], static_cast<const uint8_t*>(base) + r * stride,
                tiles[t].colsb);
}

inline void stored(int t, void* base, int64_t stride) {
  for (int r = 0; r < tiles[t].rows; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, tiles[t].data[r], tiles[t].colsb);
}

inline float bf16_at(const uint8_t* row, int i) {  // the i-th bf16 of a row, as a float
  uint16_t h;
  std::memcpy(&h, row + 2 * i, 2);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void dpbf16ps(int c, int a, int b) {
  Tile &C = tiles[c], &A = tiles[a], &B = tiles[b];
  const int pairs = A.colsb / 4, n_cols = C.colsb / 4;
  for (int m = 0; m < C.rows; ++m)
    for (int n = 0; n < n_cols; ++n) {
      float acc;
      std::memcpy(&acc, C.data[m] + 4 * n, 4);
      for (int k = 0; k < pairs; ++k)
        acc += bf16_at(A.data[m], 2 * k) * bf16_at(B.data[k], 2 * n) +
               bf16_at(A.data[m], 2 * k + 1) * bf16_at(B.data[k], 2 * n + 1);
      std::memcpy(C.data[m] + 4 * n, &acc, 4);
    }
}

}  // namespace pipellm::amx_emu

#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) pipellm::amx_emu::loadconfig(config)
#define _tile_zero(t) pipellm::amx_emu::zero(t)
#define _tile_loadd(t, base, stride) pipellm::amx_emu::loadd(t, base, stride)
#define _tile_stored(t, base, stride) pipellm::amx_emu::stored(t, base, stride)
#define _tile_dpbf16ps(c, a, b) pipellm::amx_emu::dpbf16ps(c, a, b)
#define _tile_release() static_cast<void>(0)
