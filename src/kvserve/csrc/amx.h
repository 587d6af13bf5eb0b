// bfloat16 products on AMX tiles (Sapphire Rapids and later Xeons), for the GEMM and the
// prefill attention. The 16-output blocks of simd.h are already AMX's right-hand tile form:
// 16 input pairs of one block are 16 rows of 64 bytes. One multiply takes up to 32 left-hand
// rows (two 16-row tiles) by two blocks (32 outputs) in 32-channel steps, summing in four
// float32 tiles: tmm0-3 the sums, tmm4-5 the left rows, tmm6-7 the blocks.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVSERVE_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/core/TensorBody.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>

namespace kvserve::amx {

using Bf16 = at::BFloat16;
constexpr int kRows = 32;          // left-hand rows per multiply
constexpr int64_t kChannels = 32;  // channels per tile step
using simd::kBlock;                // outputs per block: the packed weights' and K/V's blocks

// Linux hands out the tile state only to processes that ask for it.
inline bool ready() {
  static const bool granted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Whether bfloat16 products over `channels` inputs run on the tiles: whole 32-channel steps,
// and the tile state granted.
inline bool runs(int64_t channels) { return channels % kChannels == 0 && ready(); }

// Configures this thread's tiles: tile t with rows[t] rows of 64 bytes (0: unused).
inline void configure_tiles(const uint8_t (&rows)[8]) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int tile = 0; tile < 8; ++tile) {
    config.rows[tile] = rows[tile];
    config.bytes_per_row[tile] = rows[tile] > 0 ? 64 : 0;
  }
  _tile_loadconfig(&config);
}

// Configures this thread's tiles for multiply() on `rows` (1-32) left-hand rows: the second
// half only where rows > 16.
inline void configure(int rows) {
  const auto top = static_cast<uint8_t>(std::min(rows, 16));
  const auto bottom = static_cast<uint8_t>(rows - top);
  configure_tiles({top, top, bottom, bottom, top, bottom, 16, 16});
}

// Brings `bytes` from `start` into L1 ahead of the tile loads that read them, which otherwise
// wait on L2 or memory. Prefetches do not fault, so addresses past a buffer's end need no
// check.
inline void prefetch(const void* start, int64_t bytes) {
  const char* line = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(line + offset, _MM_HINT_T0);
}

// c[rows x 32] (rows ldc floats apart) = (c if `add_to_c`, else 0) + a[rows x k] (rows lda
// apart) times blocks b0 | b1 ([k / 2, 16, 2] each), for the configured rows; k a multiple
// of 32. TWO_HALVES: rows > 16. PREFETCH: each block's next 32-channel step is prefetched
// while this one multiplies: 0.95x the time of a 2,048 x 576 x 3,072 GEMM, 0.96x at 2,048^3,
// 0.80x at 32 x 576 x 1,536; two steps ahead, 1.04x. `during(step)` runs after each step's
// products are issued: vector work put there runs while the tile unit multiplies, where
// after the multiply the two would take turns.
template <bool TWO_HALVES, bool PREFETCH, typename During>
inline void multiply_halves(const Bf16* a, int64_t lda, int64_t k, const Bf16* b0,
                            const Bf16* b1, float* c, int64_t ldc, bool add_to_c,
                            During during) {
  const int64_t c_stride = ldc * sizeof(float), a_stride = lda * sizeof(Bf16);
  if (add_to_c) {
    _tile_loadd(0, c, c_stride);
    _tile_loadd(1, c + kBlock, c_stride);
    if constexpr (TWO_HALVES) {
      _tile_loadd(2, c + 16 * ldc, c_stride);
      _tile_loadd(3, c + 16 * ldc + kBlock, c_stride);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (TWO_HALVES) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  for (int64_t s = 0; s < k; s += kChannels) {
    if constexpr (PREFETCH) {
      constexpr int64_t kStepBytes = kChannels * kBlock * sizeof(Bf16);
      prefetch(b0 + (s + kChannels) * kBlock, kStepBytes);
      prefetch(b1 + (s + kChannels) * kBlock, kStepBytes);
    }
    _tile_loadd(4, a + s, a_stride);
    _tile_loadd(6, b0 + s * kBlock, 64);
    _tile_loadd(7, b1 + s * kBlock, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO_HALVES) {
      _tile_loadd(5, a + 16 * lda + s, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    during(s / kChannels);
  }
  _tile_stored(0, c, c_stride);
  _tile_stored(1, c + kBlock, c_stride);
  if constexpr (TWO_HALVES) {
    _tile_stored(2, c + 16 * ldc, c_stride);
    _tile_stored(3, c + 16 * ldc + kBlock, c_stride);
  }
}

// No vector work beside a multiply.
struct NoWork {
  void operator()(int64_t) const {}
};

// multiply_halves() for `rows` rows, configured. The GEMM prefetches; the prefill attention's
// 32 rows of head_dim 128 leave no room in L1 for it (1.05x the time at 2,048 tokens).
template <bool PREFETCH, typename During = NoWork>
inline void multiply(int rows, const Bf16* a, int64_t lda, int64_t k, const Bf16* b0,
                     const Bf16* b1, float* c, int64_t ldc, bool add_to_c,
                     During during = {}) {
  if (rows > 16)
    multiply_halves<true, PREFETCH>(a, lda, k, b0, b1, c, ldc, add_to_c, during);
  else
    multiply_halves<false, PREFETCH>(a, lda, k, b0, b1, c, ldc, add_to_c, during);
}

}  // namespace kvserve::amx
#endif  // AMX
