// 4- or 8-bit weight x 8-bit activation matmul for CPU decode and prefill: the activations of
// each row are quantized to int8 per weight group on the fly, and each group's integer dot
// product runs on VNNI (AVX512-VNNI: 64 multiply-adds per instruction; AVX-VNNI: 32) or,
// without it, AVX2's maddubs, a few rows per pass over the weights, or many as a GEMM (gemm
// below); where the CPU has AMX, 16 rows at a time on its int8 tiles (wxa8_amx_matmul), which
// costs a few rows no more than one. A group contributes
// x_scale * (w_scale * dot(q, xq) - w_scale * zero * sum(xq)) to the output.
//
// Weight layout, per block of 64 input channels: 4 bits, 32 bytes where byte j holds channel j
// in its low nibble and channel j + 32 in its high one; 8 bits, 64 bytes in channel order.
#include "kvserve_cpu.h"
#include "amx.h"
#include "dequantize.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

namespace simd = kvserve::simd;

constexpr int64_t kBlock = 64;  // input channels per packed block
constexpr int64_t kPair = 2 * kBlock;  // input channels per pair of blocks (paired:: below)
constexpr int64_t kRows = 4;    // activation rows served by one pass over a weight row
// How far ahead of each block the weights (the outputs' rows lie end to end) are fetched into
// L1: with the hardware prefetcher alone, one row streamed 4-bit weights at 0.75-0.9x the rate
// it does with this on a 2-core AVX2 EPYC, and at 0.75-0.85x on a 2-core AVX-512 one (8-bit:
// 0.9x), where the kernel's integer work kept too few reads in flight.
constexpr int64_t kPrefetchBytes = 4096;
// The lead in each of four weight runs read side by side far apart (streams::, one_row:: over
// long rows). With 4 KiB in each, the four runs' prefetched lines outgrew what L1 kept until
// they were read: on a 2-core AVX2 EPYC, one-row calls over cold weights took 1.08-1.23x the
// time they take with 2 KiB (4-bit rows of 2,048-8,192 channels; 8-bit rows of 768-8,192:
// 1.04-1.08x).
constexpr int64_t kRunPrefetchBytes = 2048;

// Where a call reads its weights once (one pass of at most kRows activation rows) over rows of
// at least kL2PrefetchRowBytes, the AVX-512 kernels fetch them kL2PrefetchBytes ahead into L2
// (prefetcht1) rather than into L1. On a 2-core Zen 4 EPYC, from DRAM, that took one row over
// 4-bit rows of 1,024-8,192 channels from 1x to 0.75-0.92x the time, and 4 rows to 0.88-1.0x;
// over 8-bit rows of 512-8,192, 0.74-0.89x at 1 row (one run of 512: 1.03x). Calls of 5 rows
// or more, which pass over each weight row again, keep L1 (8 rows of 8-bit rows of 512-1,024
// channels: 1.08-1.18x, within the noise of runs whose code did not change).
constexpr int64_t kL2PrefetchRowBytes = 512;
constexpr int64_t kL2PrefetchBytes = 8192;
// Shorter 4-bit rows (paired::) go to L2 too on one or two rows, where they are whole cache
// lines (channels a multiple of 128). There, 4-bit rows of 640, 768 and 896 channels took
// 0.70-0.93x the time at 1 row and 0.87-0.96x at 2, but 1.05-1.11x at 4; rows of 576, 704
// and 832 channels (an odd number of 64-channel groups, so every other row starts mid-line)
// took 1.04-1.58x at 1-2 rows; 8-bit rows of 384 and 448 channels, 1.08-1.28x.
constexpr int64_t kShortL2PrefetchRowBytes = 256;
constexpr int64_t kShortL2PrefetchRows = 2;

// Fetches what a pass over the weights reads some way past `block`: into L2 where `L2`, else
// into L1. A template argument, chosen once per call by with_prefetch: a branch on the row
// length in paired::tile's loop took 4 and 8 rows to 1.09-1.15x the time.
template <bool L2>
inline void prefetch_weights(const uint8_t* block) {
  if constexpr (L2)
    simd::prefetch_into_l2(block + kL2PrefetchBytes);
  else
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes), _MM_HINT_T0);
}

// fn(std::bool_constant<L2>{}) with L2 as prefetch_weights takes it for a call of `rows`
// activation rows over weight rows of `row_bytes` (run by paired:: where `paired`); always
// false off AVX512-VNNI.
template <typename Fn>
inline void with_prefetch(int64_t row_bytes, int64_t rows, bool paired, const Fn& fn) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const bool short_rows = paired && rows <= kShortL2PrefetchRows &&
                          row_bytes >= kShortL2PrefetchRowBytes &&
                          row_bytes % simd::kCacheLineBytes == 0;
  if ((row_bytes >= kL2PrefetchRowBytes && rows <= kRows) || short_rows)
    return fn(std::true_type{});
#endif
  fn(std::false_type{});
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// One block's 64 weights as unsigned bytes.
template <int BITS>
inline __m512i block_weights(const uint8_t* w) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(w);
  } else {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i lo = _mm256_and_si256(packed, nibble);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}
#elif defined(__AVX2__)
#ifndef __AVXVNNI__
// Blocks whose u8 x s8 pair sums add up in int16 lanes: a pair of 4-bit values (or nibbles)
// times int8 is at most 2 * 15 * 127 = 3,810, and each block adds two such sums to a lane, so
// four blocks stay within 32,767.
constexpr int64_t kInt16Blocks = 4;

inline __m256i pair_sums(__m256i q, const int8_t* x) {
  return _mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// A 4-bit block's 32 bytes as its low nibbles (channels 0-31) and its high ones (32-63).
inline void nibble_halves(const uint8_t* block, __m256i& lo, __m256i& hi) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
  lo = _mm256_and_si256(v, nibble);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
}
#endif

// The integer dot products of one group's blocks, from b0 on, for ROWS rows `k` apart, as 8
// int32 lanes each; BLOCKS blocks to a group (0: `blocks`, known at run time only). With
// AVX-VNNI (256-bit `vpdpbusd`: 4 products to an int32 lane), 8-bit weights go whole; with
// maddubs alone, as their two nibbles, the high ones' sums worth 16.
template <int BITS, int ROWS, int BLOCKS>
inline void group_dots(const uint8_t* w, const int8_t* xq, int64_t k, int64_t b0,
                       int64_t blocks, __m256i* dots) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const int64_t count = BLOCKS > 0 ? BLOCKS : blocks;
  w += b0 * kBlock * BITS / 8;
  xq += b0 * kBlock;
  for (int r = 0; r < ROWS; ++r) dots[r] = _mm256_setzero_si256();
#ifdef __AVXVNNI__
  for (int64_t b = 0; b < count; ++b) {
    const uint8_t* block = w + b * kBlock * BITS / 8;
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
    const __m256i halves[2] = {  // channels 0-31 and 32-63 of the block
        BITS == 4 ? _mm256_and_si256(v, nibble) : v,
        BITS == 4 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble)
                  : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32))};
    for (int r = 0; r < ROWS; ++r)
      for (int h = 0; h < 2; ++h)
        dots[r] = _mm256_dpbusd_avx_epi32(dots[r], halves[h],
                                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                              xq + r * k + b * kBlock + 32 * h)));
  }
#else
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t s = 0; s < count; s += kInt16Blocks) {
    __m256i low[ROWS], high[ROWS];
    for (int r = 0; r < ROWS; ++r) low[r] = high[r] = _mm256_setzero_si256();
    for (int64_t b = s; b < std::min(s + kInt16Blocks, count); ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(w + b * kBlock * BITS / 8 + kPrefetchBytes),
                   _MM_HINT_T0);
      if constexpr (BITS == 4) {
        __m256i lo, hi;
        nibble_halves(w + b * 32, lo, hi);
        for (int r = 0; r < ROWS; ++r) {
          const int8_t* x = xq + r * k + b * kBlock;
          low[r] = _mm256_add_epi16(low[r],
                                    _mm256_add_epi16(pair_sums(lo, x), pair_sums(hi, x + 32)));
        }
      } else {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 64));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 64 + 32));
        const __m256i lo0 = _mm256_and_si256(v0, nibble), lo1 = _mm256_and_si256(v1, nibble);
        const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
        const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
        for (int r = 0; r < ROWS; ++r) {
          const int8_t* x = xq + r * k + b * kBlock;
          low[r] = _mm256_add_epi16(low[r],
                                    _mm256_add_epi16(pair_sums(lo0, x), pair_sums(lo1, x + 32)));
          high[r] = _mm256_add_epi16(
              high[r], _mm256_add_epi16(pair_sums(hi0, x), pair_sums(hi1, x + 32)));
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(low[r], ones));
      if constexpr (BITS == 8)
        dots[r] = _mm256_add_epi32(dots[r],
                                   _mm256_slli_epi32(_mm256_madd_epi16(high[r], ones), 4));
    }
  }
#endif
}

// The sum of v's 8 lanes, from lane 0 up.
inline float lane_sum(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float total = 0.f;
  for (float lane : lanes) total += lane;
  return total;
}

// Lane i: the sum of the 8 lanes of d[i], from q0 = hadd(hadd(d0, d1), hadd(d2, d3)) and q1
// the same of d4-d7.
inline __m256i joined_quads(__m256i q0, __m256i q1) {
  return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20),
                          _mm256_permute2x128_si256(q0, q1, 0x31));
}

// Lane i: the sum of the 8 lanes of d[i].
inline __m256i lane_totals(const __m256i d[8]) {
  return joined_quads(
      _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3])),
      _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7])));
}

// acc plus x_scale * scale * dot - scale * zero * x_zero for 8 groups' integer dot products,
// given scale, scale * zero, x_scale and x_zero: the one order every AVX2 one-row output takes.
inline __m256 scaled_groups(__m256 acc, __m256i dots, __m256 s, __m256 zs, __m256 xs,
                            __m256 xz) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(s, xs),
                         _mm256_fnmadd_ps(zs, xz, acc));
}

// weight_row (below) on AVX2, eight groups at a time: their dot products as the lanes of one
// vector, scaled by eight groups' scales at once.
template <int BITS, int ROWS, int BLOCKS>
inline void avx2_weight_row(const uint8_t* w, const int8_t* xq, const float* x_scale,
                            const float* x_zero, const float* scale, const float* zero,
                            int64_t k, int64_t groups, int64_t blocks, float* out) {
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
    const int64_t count = std::min<int64_t>(8, groups - g0);
    __m256i dots[8][ROWS];
    if (count == 8) {  // unrolled: the dot products stay in registers
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        group_dots<BITS, ROWS, BLOCKS>(w, xq, k, (g0 + i) * blocks, blocks, dots[i]);
    } else {
      for (int64_t i = 0; i < 8; ++i) {
        if (i < count)
          group_dots<BITS, ROWS, BLOCKS>(w, xq, k, (g0 + i) * blocks, blocks, dots[i]);
        else
          for (int r = 0; r < ROWS; ++r) dots[i][r] = _mm256_setzero_si256();
      }
    }
    const __m256i lanes = simd::first_avx2_lanes(count);
    const __m256 s = _mm256_maskload_ps(scale + g0, lanes);
    const __m256 zs = _mm256_mul_ps(_mm256_maskload_ps(zero + g0, lanes), s);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xs = _mm256_maskload_ps(x_scale + r * groups + g0, lanes);
      const __m256 xz = _mm256_maskload_ps(x_zero + r * groups + g0, lanes);
      const __m256i row_dots[8] = {dots[0][r], dots[1][r], dots[2][r], dots[3][r],
                                   dots[4][r], dots[5][r], dots[6][r], dots[7][r]};
      acc[r] = scaled_groups(acc[r], lane_totals(row_dots), s, zs, xs, xz);
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = lane_sum(acc[r]);
}
#endif

// out[r] = sum over groups g of x_scale[r, g] * scale[g] * dot(q_g, xq[r]_g)
//                               - scale[g] * zero[g] * x_zero[r, g]
// for ROWS activation rows `k` apart, over one weight row: each block of 64 weights is
// loaded once for all rows, and a group's integer sums are scaled into float lanes, so
// lanes are summed once per output. Inlined: with two prefetch choices, GCC called it once per
// output and tile, which took 8 rows of 8-bit rows of 512-1,024 channels to 1.16-1.2x the time.
template <int BITS, int ROWS, bool L2>
__attribute__((always_inline)) inline void weight_row(
    const uint8_t* w, const int8_t* xq, const float* x_scale, const float* x_zero,
    const float* scale, const float* zero, int64_t k, int64_t groups, int64_t blocks,
    float* out) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  constexpr int64_t kBytes = kBlock * BITS / 8;
  float zero_terms[ROWS] = {};
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dots[ROWS];
    for (int r = 0; r < ROWS; ++r) dots[r] = _mm512_setzero_si512();
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      prefetch_weights<L2>(w + b * kBytes);
      const __m512i q = block_weights<BITS>(w + b * kBytes);
      for (int r = 0; r < ROWS; ++r)
        dots[r] = _mm512_dpbusd_epi32(dots[r], q, _mm512_loadu_si512(xq + r * k + b * kBlock));
    }
    for (int r = 0; r < ROWS; ++r) {
      const float xs = x_scale[r * groups + g];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_set1_ps(xs * scale[g]),
                               acc[r]);
      zero_terms[r] += (zero[g] * scale[g]) * x_zero[r * groups + g];
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) - zero_terms[r];
#elif defined(__AVX2__)
  switch (blocks) {  // the common group sizes, 64 and 128 channels, with unrolled loops
    case 1: return avx2_weight_row<BITS, ROWS, 1>(w, xq, x_scale, x_zero, scale, zero, k, groups,
                                                  blocks, out);
    case 2: return avx2_weight_row<BITS, ROWS, 2>(w, xq, x_scale, x_zero, scale, zero, k, groups,
                                                  blocks, out);
    default: return avx2_weight_row<BITS, ROWS, 0>(w, xq, x_scale, x_zero, scale, zero, k,
                                                   groups, blocks, out);
  }
#else
  for (int r = 0; r < ROWS; ++r) {
    float total = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      for (int64_t c = g * blocks * kBlock; c < (g + 1) * blocks * kBlock; ++c) {
        const int64_t b = c / kBlock, j = c % kBlock;
        const int32_t q = BITS == 8 ? w[c]
                                    : (w[b * 32 + j % 32] >> (j < 32 ? 0 : 4)) & 0x0F;
        dot += q * xq[r * k + c];
      }
      const float xs = x_scale[r * groups + g];
      total += xs * scale[g] * static_cast<float>(dot) -
               (zero[g] * scale[g]) * x_zero[r * groups + g];
    }
    out[r] = total;
  }
#endif
}

// Calls fn(std::integral_constant<int, ROWS>{}, r0) for each tile [r0, r0 + ROWS) of m rows,
// ROWS at most kRows.
template <typename Fn>
inline void row_tiles(int64_t m, const Fn& fn) {
  for (int64_t r0 = 0; r0 < m; r0 += kRows) {
    switch (std::min(kRows, m - r0)) {
      case 4: fn(std::integral_constant<int, 4>{}, r0); break;
      case 3: fn(std::integral_constant<int, 3>{}, r0); break;
      case 2: fn(std::integral_constant<int, 2>{}, r0); break;
      default: fn(std::integral_constant<int, 1>{}, r0);
    }
  }
}

template <int BITS>
void weight_rows(const uint8_t* w, const int8_t* xq, const float* xs, const float* xz,
                 const float* scale, const float* zero, int64_t m, int64_t k, int64_t groups,
                 int64_t blocks, float* out, int64_t n) {
  with_prefetch(k * BITS / 8, m, false, [&](auto l2) {
    row_tiles(m, [&](auto tile, int64_t r0) {
      constexpr int rows = decltype(tile)::value;
      float row_out[rows];
      weight_row<BITS, rows, decltype(l2)::value>(w, xq + r0 * k, xs + r0 * groups,
                                                  xz + r0 * groups, scale, zero, k, groups,
                                                  blocks, row_out);
      for (int64_t r = 0; r < rows; ++r) out[(r0 + r) * n] = row_out[r];
    });
  });
}

#if defined(__AVX2__) && !defined(__AVXVNNI__) && \
    !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
#define KVSERVE_WXA8_STREAMS 1
// 8-bit weights on one or two rows with maddubs (AVX2 without VNNI), over several outputs at
// once that lie far apart: a thread splits its outputs into kStreams runs and reads one
// weight row of each in step, as the float32 GEMV reads four blocks. On a 2-core AVX2 EPYC,
// one weight row at a time streamed at 18-25 GB/s where the float32 GEMV streamed 28-40;
// four rows side by side but adjacent gained nothing, four runs apart streamed at 27-36.
// 4-bit weights on one row have one_row:: below.
namespace streams {

constexpr int64_t kStreams = 4;

// out[r * n + o * spread] for ROWS rows (`k` apart in xq) and OUTS outputs, output o's weight
// row at w + o * spread * k, its scales at o * spread * groups and its zeros at
// o * spread * zero_row. The weights are read as signed bytes (q - 128, so their zeros count
// 128 less), which maddubs takes as their magnitude (at most 128) times the activation given
// their sign (at most 127 in size): a pair of products sums to at most 32,512 in an int16
// lane, where the unsigned byte times 127 would overflow it, and the per-row kernel does twice
// the integer work on two nibble planes.
template <int ROWS, int OUTS>
inline void tile(const uint8_t* w, int64_t spread, const int8_t* xq, const float* x_scale,
                 const float* x_zero, const float* scale, const float* zero, int64_t zero_row,
                 int64_t k, int64_t groups, int64_t blocks, float* out, int64_t n) {
  const __m256i flip = _mm256_set1_epi8(-128), ones = _mm256_set1_epi16(1);
  constexpr int64_t kAhead = OUTS == kStreams ? kRunPrefetchBytes : kPrefetchBytes;
  __m256 acc[ROWS][OUTS];
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dots[ROWS][OUTS];
    for (int r = 0; r < ROWS; ++r)
      for (int o = 0; o < OUTS; ++o) dots[r][o] = _mm256_setzero_si256();
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      __m256i x[ROWS][2];
      for (int r = 0; r < ROWS; ++r)
        for (int h = 0; h < 2; ++h)
          x[r][h] = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(xq + r * k + b * kBlock + 32 * h));
      for (int o = 0; o < OUTS; ++o) {
        const uint8_t* block = w + o * spread * k + b * kBlock;
        _mm_prefetch(reinterpret_cast<const char*>(block + kAhead), _MM_HINT_T0);
        __m256i v[2];
        for (int h = 0; h < 2; ++h)
          v[h] = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * h)), flip);
        for (int r = 0; r < ROWS; ++r)
          for (int h = 0; h < 2; ++h)
            dots[r][o] = _mm256_add_epi32(
                dots[r][o],
                _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v[h]),
                                                       _mm256_sign_epi8(x[r][h], v[h])),
                                  ones));
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int o = 0; o < OUTS; ++o)
        acc[r][o] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(dots[r][o]),
            _mm256_set1_ps(x_scale[r * groups + g] * scale[o * spread * groups + g]),
            acc[r][o]);
  }
  // less scale * (zero - 128) * x_zero, 8 groups at a time
  for (int64_t g = 0; g < groups; g += 8) {
    const __m256i lanes = simd::first_avx2_lanes(groups - g);
    for (int o = 0; o < OUTS; ++o) {
      const __m256 scaled_zero = _mm256_mul_ps(
          _mm256_maskload_ps(scale + o * spread * groups + g, lanes),
          _mm256_sub_ps(_mm256_maskload_ps(zero + o * spread * zero_row + g, lanes),
                        _mm256_set1_ps(128.f)));
      for (int r = 0; r < ROWS; ++r)
        acc[r][o] = _mm256_fnmadd_ps(
            scaled_zero, _mm256_maskload_ps(x_zero + r * groups + g, lanes), acc[r][o]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o) out[r * n + o * spread] = lane_sum(acc[r][o]);
}

// Outputs [begin, end) of ROWS rows of out [m, n]: kStreams runs (two for two rows, for the
// registers) read side by side, then what is left one by one.
template <int ROWS>
void outputs(const uint8_t* w, const int8_t* xq, const float* x_scale, const float* x_zero,
             const float* scale, const float* zero, int64_t zero_row, int64_t k, int64_t groups,
             int64_t blocks, float* out, int64_t n, int64_t begin, int64_t end) {
  constexpr int kOuts = ROWS == 1 ? kStreams : 2;
  const int64_t spread = (end - begin) / kOuts;
  for (int64_t o = begin; o < begin + spread; ++o)
    tile<ROWS, kOuts>(w + o * k, spread, xq, x_scale, x_zero, scale + o * groups,
                      zero + o * zero_row, zero_row, k, groups, blocks, out + o, n);
  for (int64_t o = begin + kOuts * spread; o < end; ++o)
    tile<ROWS, 1>(w + o * k, 0, xq, x_scale, x_zero, scale + o * groups, zero + o * zero_row,
                  zero_row, k, groups, blocks, out + o, n);
}

}  // namespace streams

// 4-bit weights on one row with maddubs (AVX2 without VNNI), kOuts outputs at a time: each
// activation vector is loaded once for all of them, their integer sums are reduced side by
// side, and each output's float work is avx2_weight_row's (scaled_groups, lane_sum), so an
// output has the bits it has on the per-row kernel, whatever rows share the call. One output
// at a time, each row waited on its reductions after every 8 groups and on its final lane
// sum, a fixed cost that decided short rows: on a 2-core AVX2 EPYC, weights streamed from
// memory, one-row calls took 0.71x the time at 256 channels (6,144 outputs), 0.86-0.91x at
// 576-768. Short rows are read 4 adjacent ones at a time; rows over kAdjacentRowBytes as 4
// runs far apart, as streams:: reads 8-bit ones: 4 adjacent rows of 1,536-8,192 channels
// read 1.2-1.37x slower than one by one, 4 runs 0.92-1.01x.
namespace one_row {

constexpr int kOuts = 4;
constexpr int64_t kAdjacentRowBytes = 512;

// hadd(hadd(d0, d1), hadd(d2, d3)) of 4 groups' dot products (joined_quads' q0 or q1), for
// each output, built as the group pairs arrive so that no more than two groups' sums of each
// output are held at once.
template <int OUTS, int BLOCKS>
inline void quad_totals(const uint8_t* w, int64_t row_bytes, int64_t ahead, const int8_t* xq,
                        int64_t g0, int64_t count, int64_t blocks, __m256i* quads) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t per_group = BLOCKS > 0 ? BLOCKS : blocks;
  __m256i first[OUTS];  // of a pair of groups
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    __m256i dots[OUTS];
    for (int o = 0; o < OUTS; ++o) dots[o] = _mm256_setzero_si256();
    if (i < count) {
      const int64_t b0 = (g0 + i) * per_group;
      for (int64_t s = 0; s < per_group; s += kInt16Blocks) {
        __m256i low[OUTS];
        for (int o = 0; o < OUTS; ++o) low[o] = _mm256_setzero_si256();
        for (int64_t b = b0 + s; b < b0 + std::min(s + kInt16Blocks, per_group); ++b) {
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
          const __m256i x1 =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock + 32));
          for (int o = 0; o < OUTS; ++o) {
            const uint8_t* block = w + o * row_bytes + b * 32;
            _mm_prefetch(reinterpret_cast<const char*>(block + ahead), _MM_HINT_T0);
            __m256i lo, hi;
            nibble_halves(block, lo, hi);
            low[o] = _mm256_add_epi16(
                low[o], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0),
                                         _mm256_maddubs_epi16(hi, x1)));
          }
        }
        for (int o = 0; o < OUTS; ++o)
          dots[o] = _mm256_add_epi32(dots[o], _mm256_madd_epi16(low[o], ones));
      }
    }
    if (i % 2 == 0) {
      for (int o = 0; o < OUTS; ++o) first[o] = dots[o];
    } else {
      for (int o = 0; o < OUTS; ++o) {
        const __m256i pair = _mm256_hadd_epi32(first[o], dots[o]);
        quads[o] = i == 1 ? pair : _mm256_hadd_epi32(quads[o], pair);
      }
    }
  }
}

// out[o * spread] for OUTS outputs `spread` apart (their weight rows spread * row_bytes,
// their scales spread * groups, their zeros spread * zero_row), of one row quantized into xq,
// x_scale and x_zero.
template <int OUTS, int BLOCKS>
inline void tile(const uint8_t* w, int64_t row_bytes, int64_t spread, const int8_t* xq,
                 const float* x_scale, const float* x_zero, const float* scale,
                 const float* zero, int64_t zero_row, int64_t groups, int64_t blocks,
                 float* out) {
  const int64_t ahead = spread == 1 ? kPrefetchBytes : kRunPrefetchBytes;
  __m256 acc[OUTS];
  for (int o = 0; o < OUTS; ++o) acc[o] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
    const int64_t count = std::min<int64_t>(8, groups - g0);
    __m256i q0[OUTS], q1[OUTS];
    quad_totals<OUTS, BLOCKS>(w, spread * row_bytes, ahead, xq, g0, count, blocks, q0);
    quad_totals<OUTS, BLOCKS>(w, spread * row_bytes, ahead, xq, g0 + 4, count - 4, blocks, q1);
    const __m256i lanes = simd::first_avx2_lanes(count);
    const __m256 xs = _mm256_maskload_ps(x_scale + g0, lanes);
    const __m256 xz = _mm256_maskload_ps(x_zero + g0, lanes);
    for (int o = 0; o < OUTS; ++o) {
      const __m256 s = _mm256_maskload_ps(scale + o * spread * groups + g0, lanes);
      const __m256 zs =
          _mm256_mul_ps(_mm256_maskload_ps(zero + o * spread * zero_row + g0, lanes), s);
      acc[o] = scaled_groups(acc[o], joined_quads(q0[o], q1[o]), s, zs, xs, xz);
    }
  }
  for (int o = 0; o < OUTS; ++o) out[o * spread] = lane_sum(acc[o]);
}

template <int BLOCKS>
void outputs_of(const uint8_t* w, const int8_t* xq, const float* x_scale, const float* x_zero,
                const float* scale, const float* zero, int64_t zero_row, int64_t k,
                int64_t groups, int64_t blocks, float* out, int64_t begin, int64_t end) {
  const int64_t row_bytes = k / 2;
  const int64_t tiles = (end - begin) / kOuts;
  const int64_t spread = row_bytes <= kAdjacentRowBytes ? 1 : tiles;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t o = begin + (spread == 1 ? kOuts * t : t);
    tile<kOuts, BLOCKS>(w + o * row_bytes, row_bytes, spread, xq, x_scale, x_zero,
                        scale + o * groups, zero + o * zero_row, zero_row, groups, blocks,
                        out + o);
  }
  int64_t o = begin + kOuts * tiles;
  for (; o < end; ++o)
    tile<1, BLOCKS>(w + o * row_bytes, row_bytes, 1, xq, x_scale, x_zero, scale + o * groups,
                    zero + o * zero_row, zero_row, groups, blocks, out + o);
}

// Outputs [begin, end) of out [1, n]: kOuts at a time, then what is left one by one.
void outputs(const uint8_t* w, const int8_t* xq, const float* x_scale, const float* x_zero,
             const float* scale, const float* zero, int64_t zero_row, int64_t k, int64_t groups,
             int64_t blocks, float* out, int64_t begin, int64_t end) {
  switch (blocks) {  // the common group sizes, 64 and 128 channels, with unrolled loops
    case 1: return outputs_of<1>(w, xq, x_scale, x_zero, scale, zero, zero_row, k, groups,
                                 blocks, out, begin, end);
    case 2: return outputs_of<2>(w, xq, x_scale, x_zero, scale, zero, zero_row, k, groups,
                                 blocks, out, begin, end);
    default: return outputs_of<0>(w, xq, x_scale, x_zero, scale, zero, zero_row, k, groups,
                                  blocks, out, begin, end);
  }
}

}  // namespace one_row
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 4-bit weights on a few rows, over blocks in pairs: one 64-byte load holds blocks 2u and
// 2u + 1, whose low nibbles (each block's channels 0-31) and high ones (32-63) are two
// `vpdpbusd` operands as they lie, against activations laid out in that order (paired_position).
// That is a load, three bit operations and two multiply-adds per 128 weights, where
// weight_row widens each block on its own; with groups of 64 channels, a pair's two groups
// are scaled in one vector, each half by its group's scale; and the zero terms are summed
// 16 groups at a time, apart from the integer work.
namespace paired {

// out[r * n + o] for ROWS rows (`k` apart in xp, in paired_position's order) and OUTS outputs
// (`row_bytes` apart in w, `groups` apart in scale, `zero_row` in zero): x_scale and x_zero
// (x_scale * the sum of a group's integers) are the rows' [ROWS, groups]. A weight vector
// serves every row, an activation vector every output, and the ROWS * OUTS multiply-add
// chains run side by side.
template <int ROWS, int OUTS, bool L2>
inline void tile(const uint8_t* w, int64_t row_bytes, const int8_t* xp, const float* x_scale,
                 const float* x_zero, const float* scale, const float* zero, int64_t zero_row,
                 int64_t k, int64_t groups, int64_t blocks, float* out, int64_t n) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // Lanes 0-7 of a pair's sums are block 2u's, lanes 8-15 block 2u + 1's.
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const int64_t pairs = k / kPair, per_sum = std::max<int64_t>(1, blocks / 2);
  __m512 acc[ROWS][OUTS];
  __m512i dots[ROWS][OUTS];
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o) {
      acc[r][o] = _mm512_setzero_ps();
      dots[r][o] = _mm512_setzero_si512();
    }
  // A sum runs over per_sum pairs; groups of 64 channels split each pair's between two.
  const int64_t split = blocks == 1 ? 1 : 0;
  for (int64_t i = 0; i < pairs / per_sum; ++i) {
    for (int64_t u = i * per_sum; u < (i + 1) * per_sum; ++u) {
      __m512i x[ROWS][2];
      for (int r = 0; r < ROWS; ++r)
        for (int h = 0; h < 2; ++h)
          x[r][h] = _mm512_loadu_si512(xp + r * k + u * kPair + 64 * h);
      for (int o = 0; o < OUTS; ++o) {
        const uint8_t* wo = w + o * row_bytes + u * 64;
        prefetch_weights<L2>(wo);
        const __m512i v = _mm512_loadu_si512(wo);
        const __m512i lo = _mm512_and_si512(v, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int r = 0; r < ROWS; ++r)
          dots[r][o] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dots[r][o], lo, x[r][0]), hi,
                                           x[r][1]);
      }
    }
    // The sums, scaled: each half by its group's scale, or both by their one group's.
    const int64_t low = i * (1 + split);
    const auto pair_of = [&](const float* v) {
      return split ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(v + low)))
                   : _mm_broadcast_ss(v + low);
    };
    __m128 xs[ROWS];
    for (int r = 0; r < ROWS; ++r) xs[r] = pair_of(x_scale + r * groups);
    for (int o = 0; o < OUTS; ++o) {
      const __m128 s = pair_of(scale + o * groups);
      for (int r = 0; r < ROWS; ++r) {
        const __m512 both =
            _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_mul_ps(s, xs[r])));
        acc[r][o] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][o]), both, acc[r][o]);
        dots[r][o] = _mm512_setzero_si512();
      }
    }
  }
  if (pairs * kPair < k) {  // a last group of 64 channels, alone: half a pair
    const int64_t g = groups - 1;
    const __m256i nibbles = _mm256_set1_epi8(0x0F);
    for (int o = 0; o < OUTS; ++o) {
      const __m256i v =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + o * row_bytes + pairs * 64));
      const __m256i lo = _mm256_and_si256(v, nibbles);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibbles);
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* xr = xp + r * k + pairs * kPair;
        __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo,
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr)));
        d = _mm256_dpbusd_epi32(d, hi,
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32)));
        const __m256 part = _mm256_mul_ps(
            _mm256_cvtepi32_ps(d),
            _mm256_set1_ps(scale[o * groups + g] * x_scale[r * groups + g]));
        acc[r][o] = _mm512_add_ps(acc[r][o], _mm512_zextps256_ps512(part));
      }
    }
  }
  for (int64_t g = 0; g < groups; g += 16) {  // less scale * zero * x_zero, 16 groups at a time
    const __mmask16 lanes = groups - g >= 16 ? 0xFFFF : (1u << (groups - g)) - 1;
    for (int o = 0; o < OUTS; ++o) {
      const __m512 scaled_zero =
          _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, scale + o * groups + g),
                        _mm512_maskz_loadu_ps(lanes, zero + o * zero_row + g));
      for (int r = 0; r < ROWS; ++r)
        acc[r][o] = _mm512_fnmadd_ps(
            scaled_zero, _mm512_maskz_loadu_ps(lanes, x_zero + r * groups + g), acc[r][o]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUTS; ++o) out[r * n + o] = _mm512_reduce_add_ps(acc[r][o]);
}

// Outputs [begin, end) of ROWS rows of out [m, n]: kOuts at a time (half as many from 3 rows
// on, for the registers), the rest one by one.
template <int ROWS, bool L2>
void outputs(const uint8_t* w, int64_t row_bytes, const int8_t* xp, const float* x_scale,
             const float* x_zero, const float* scale, const float* zero, int64_t zero_row,
             int64_t k, int64_t groups, int64_t blocks, float* out, int64_t n, int64_t begin,
             int64_t end) {
  constexpr int kOuts = ROWS <= 2 ? 4 : 2;
  int64_t o = begin;
  for (; o + kOuts <= end; o += kOuts)
    tile<ROWS, kOuts, L2>(w + o * row_bytes, row_bytes, xp, x_scale, x_zero, scale + o * groups,
                          zero + o * zero_row, zero_row, k, groups, blocks, out + o, n);
  for (; o < end; ++o)
    tile<ROWS, 1, L2>(w + o * row_bytes, row_bytes, xp, x_scale, x_zero, scale + o * groups,
                      zero + o * zero_row, zero_row, k, groups, blocks, out + o, n);
}

}  // namespace paired
#endif

// Where channel c of a row of k goes in the order paired:: reads: each pair of blocks as
// [2u: 0-31, 2u + 1: 0-31, 2u: 32-63, 2u + 1: 32-63]; a last block without a pair as it is.
inline int64_t paired_position(int64_t c, int64_t k) {
  if (c >= k / kPair * kPair) return c;
  return c / kPair * kPair + (c / 32 % 2) * 64 + (c / kBlock % 2) * 32 + c % 32;
}

// Whether paired:: runs a layer's few rows: 4-bit weights in groups of 64 channels or of a
// multiple of 128, on AVX512-VNNI.
bool paired_runs(int64_t bits, int64_t blocks) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return bits == 4 && (blocks == 1 || blocks % 2 == 0);
#else
  return false;
#endif
}

// Each row's activations as int8, one scale per (row, group), with each group's scale times
// its sum of integers (what a weight's zero point multiplies), in one allocation: one where
// there were three took a one-row 64 x 64 call from 12-17 us to 9 on a 2-core AVX2 EPYC.
struct QuantizedRows {
  int64_t m, k, groups;
  at::Tensor storage;  // holds the three below
  float* scale;           // [m, groups]
  float* scaled_sum;      // [m, groups]
  int8_t* q;              // [m, k]

  QuantizedRows(int64_t m, int64_t k, int64_t groups)
      : m(m), k(k), groups(groups),
        storage(at::empty({2 * m * groups * 4 + m * k}, at::kByte)),
        scale(reinterpret_cast<float*>(storage.data_ptr<uint8_t>())),
        scaled_sum(scale + m * groups),
        q(reinterpret_cast<int8_t*>(scaled_sum + m * groups)) {}
};

// Whether quantize_rows reads bfloat16 rows itself, where the float32 ones would otherwise be
// a conversion apart: its AVX-512 loop widens them through simd.h, where the CPU has
// AVX512-BF16; its plain loop always.
#if !defined(__AVX512F__) || defined(__AVX512BF16__)
constexpr bool kReadsBFloat16 = true;
#else
constexpr bool kReadsBFloat16 = false;
#endif

#if !defined(__AVX512F__) && defined(__AVX2__)
template <typename At>
int32_t avx2_group_levels(const float* v, int64_t group, const At& at, float& amax) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 top = _mm256_setzero_ps();
  for (int64_t j = 0; j < group; j += 8)  // a NaN keeps top, as std::max(amax, NaN) does
    top = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + j), magnitude), top);
  __m128 quads = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  quads = _mm_max_ps(quads, _mm_movehl_ps(quads, quads));
  amax = _mm_cvtss_f32(_mm_max_ss(quads, _mm_movehdup_ps(quads)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i totals = _mm256_setzero_si256();
  for (int64_t j = 0; j < group; j += 16) {
    const __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + j), inv));
    const __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + j + 8), inv));
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at(j)),
                     _mm_packs_epi16(_mm256_castsi256_si128(words),
                                     _mm256_extracti128_si256(words, 1)));
    totals = _mm256_add_epi32(totals, _mm256_add_epi32(low, high));
  }
  __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(totals),
                               _mm256_extracti128_si256(totals, 1));
  sums = _mm_add_epi32(sums, _mm_shuffle_epi32(sums, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(sums, _mm_shuffle_epi32(sums, 0xB1)));
}
#endif

// One group's int8 levels, channel j's stored at at(j), rounded to nearest even, with the
// group's largest magnitude in amax (0 on entry): their sum. 16 channels at a time on AVX-512,
// and float32 groups on AVX2: on a 2-core EPYC, a one-row call of 8,192 channels and 16
// outputs took 7.9 us where the scalar loop's took 18.9 (768 channels: 2.9 and 4.0), the same
// bits.
template <typename T, typename At>
int32_t group_levels(const T* v, int64_t group, const At& at, float& amax) {
#ifdef __AVX512F__
  __m512 top = _mm512_setzero_ps();
  for (int64_t j = 0; j < group; j += 16)
    top = _mm512_max_ps(top, _mm512_abs_ps(simd::Lanes<T>::load(v + j, 0xFFFF)));
  amax = _mm512_reduce_max_ps(top);
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m512i totals = _mm512_setzero_si512();
  for (int64_t j = 0; j < group; j += 16) {
    const __m512i level =
        _mm512_cvtps_epi32(_mm512_mul_ps(simd::Lanes<T>::load(v + j, 0xFFFF), inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at(j)), _mm512_cvtepi32_epi8(level));
    totals = _mm512_add_epi32(totals, level);
  }
  return _mm512_reduce_add_epi32(totals);
#else
#ifdef __AVX2__
  if constexpr (std::is_same_v<T, float>) return avx2_group_levels(v, group, at, amax);
#endif
  for (int64_t j = 0; j < group; ++j) amax = std::max(amax, std::fabs(float(v[j])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total = 0;
  for (int64_t j = 0; j < group; ++j) {
    const int8_t level = static_cast<int8_t>(std::nearbyint(float(v[j]) * inv));
    *at(j) = level;
    total += level;
  }
  return total;
#endif
}

// The rows of x [m, k] quantized, in channel order or (paired) in paired_position's.
template <typename T>
QuantizedRows quantize_rows_of(const at::Tensor& x, int64_t group, bool paired) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / group;
  QuantizedRows rows(m, k, groups);
  const T* xp = x.data_ptr<T>();
  int8_t* xqp = rows.q;
  float* xs = rows.scale;
  float* xz = rows.scaled_sum;
  at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* v = xp + r * group;
      const int64_t c0 = r % groups * group;
      int8_t* q = xqp + r / groups * k;
      // Runs of 16 channels stay together in either order.
      const auto at = [&](int64_t j) { return q + (paired ? paired_position(c0 + j, k) : c0 + j); };
      float amax = 0.f;
      const int32_t total = group_levels(v, group, at, amax);
      xs[r] = amax / 127.f;
      xz[r] = xs[r] * static_cast<float>(total);
    }
  });
  return rows;
}

QuantizedRows quantize_rows(const at::Tensor& x, int64_t group, bool paired) {
#if !defined(__AVX512F__) || defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) return quantize_rows_of<at::BFloat16>(x, group, paired);
#endif
  return quantize_rows_of<float>(x, group, paired);
}

// x as quantize_rows reads it: contiguous, and in float32 unless it reads x's bfloat16.
at::Tensor readable(const at::Tensor& x) {
  return kReadsBFloat16 && x.scalar_type() == at::kBFloat16 ? x.contiguous()
                                                                : x.to(at::kFloat).contiguous();
}

// The float32 output in `dtype`: bfloat16 rounded by simd.h's store where the CPU has
// AVX512-BF16 (to nearest even, as torch rounds it) in one loop of its own, not torch's
// conversion machinery, a few microseconds of a one-row call.
at::Tensor in_dtype(const at::Tensor& out, at::ScalarType dtype) {
#ifdef __AVX512BF16__
  if (dtype == at::kBFloat16) {
    at::Tensor result = at::empty(out.sizes(), dtype);
    const float* src = out.data_ptr<float>();
    at::BFloat16* dst = result.data_ptr<at::BFloat16>();
    const int64_t count = out.numel();
    at::parallel_for(0, (count + 15) / 16, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * 16; i < std::min(end * 16, count); i += 16) {
        const __mmask16 lanes = simd::first_lanes(count - i);
        simd::Lanes<at::BFloat16>::store(dst + i, simd::Lanes<float>::load(src + i, lanes),
                                         lanes);
      }
    });
    return result;
  }
#endif
  return out.to(dtype);
}

#if defined(__AVX2__)
// Many rows as a GEMM: a register tile of ROWS rows x BLOCKS blocks of outputs, where each
// instruction multiplies 4 channels of a block's outputs by the same 4 channels of one row,
// broadcast. The weight rows are transposed into that operand layout (a block's channels
// 4j..4j+3 in vector j) once per chunk of channels, in L1, for every row tile to reuse, so a
// weight byte is widened once per call and each integer sum lasts a whole chunk before it is
// scaled into the output; the per-row kernel above reloads each weight block for every 4 rows
// and reduces every output's lanes. Vnni and Avx2 below are the two instruction sets' tiles.
namespace gemm {

// Channels 4j..4j+3 of a row, as one 32-bit word to broadcast.
inline int32_t quad(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, 4);
  return four;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 16 outputs to a block; `vpdpbusd` sums 4 products into each int32 lane.
struct Vnni {
  using Vector = __m512i;
  static constexpr int kOutputs = 16;
  // A register tile: 16 sums, 4 weight vectors and a broadcast. Tiles of 20 or 24 sums, whose
  // loads would feed more multiply-adds, took 1.7x the time: GCC 12 kept their sums in memory.
  static constexpr int kMaxBlocks = 4;
  static constexpr int kTileRows = 4;
  // With fewer rows, transposing the weights costs more than the per-row kernel's extra passes
  // over them: on a 2-core AVX-512 EPYC, llama3-8b and llama3.2-1b shapes, the GEMM took
  // 0.6-1.6x the per-row kernel's time at 8 rows, 0.3-1.1x at 16 and 0.3-0.65x at 32. A layer
  // timed at load may start lower (wxa8_gemm_runs' gemm_from).
  static constexpr int64_t kFromRows = 16;
  // Channels per transposed chunk (a group's, if smaller). Against 256, on per-channel 8-bit
  // layers of those shapes at 16-256 rows, 512 took 0.70-0.99x the time.
  static constexpr int64_t kChunk = 512;
  template <int BITS>
  static constexpr int kPlanes = 1;  // weight vectors per quad of channels

  // The chunk [c0, c0 + channels) of 16 * blocks output rows (`row_bytes` apart) as
  // [channels / 4][blocks] vectors.
  template <int BITS>
  static void transpose_chunk(const uint8_t* w, int64_t row_bytes, int blocks, int64_t c0,
                              int64_t channels, __m512i* out) {
    for (int b = 0; b < blocks; ++b)
      for (int64_t c = c0; c < c0 + channels; c += kBlock) {
        __m512i r[16];
        for (int o = 0; o < 16; ++o)
          r[o] = block_weights<BITS>(w + (b * 16 + o) * row_bytes + c * BITS / 8);
        kvserve::dequantize::transpose(r);
        for (int j = 0; j < 16; ++j) out[((c - c0) / 4 + j) * blocks + b] = r[j];
      }
  }

  // The tile's integer sums over the chunk's quads `w` (transpose_chunk's layout) and ROWS
  // rows of xq (`k` apart), lane o of sums[r][b] for output 16b + o.
  template <int BITS, int ROWS, int BLOCKS>
  static void sums(const __m512i* w, int64_t quads, const int8_t* xq, int64_t k,
                   __m512i (&sums)[ROWS][BLOCKS]) {
    for (int r = 0; r < ROWS; ++r)
      for (int b = 0; b < BLOCKS; ++b) sums[r][b] = _mm512_setzero_si512();
    for (int64_t j = 0; j < quads; ++j) {
      __m512i q[BLOCKS];
      for (int b = 0; b < BLOCKS; ++b) q[b] = _mm512_load_si512(w + j * BLOCKS + b);
      for (int r = 0; r < ROWS; ++r) {
        const __m512i x = _mm512_set1_epi32(quad(xq + r * k + 4 * j));
        // The instruction itself: for the intrinsic, GCC 12 copied each sum to a scratch
        // register and back around every multiply-add, and loaded the weights once per row
        // (1.5x the time of this loop).
        for (int b = 0; b < BLOCKS; ++b)
          asm("vpdpbusd %2, %1, %0" : "+v"(sums[r][b]) : "v"(q[b]), "v"(x));
      }
    }
  }

  // out[0..16) += the lanes of sums * scale * xs (less scaled_zero * xz, with zero_terms).
  static void scale_into(float* out, __m512i sums, const float* scale, const float* scaled_zero,
                         float xs, float xz, bool zero_terms) {
    __m512 acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_load_ps(scale)),
                                 _mm512_set1_ps(xs), _mm512_loadu_ps(out));
    if (zero_terms) acc = _mm512_fnmadd_ps(_mm512_load_ps(scaled_zero), _mm512_set1_ps(xz), acc);
    _mm512_storeu_ps(out, acc);
  }
};
using Isa = Vnni;
#else
// 8 outputs to a block. With AVX-VNNI, its 256-bit `vpdpbusd` as above. Without it,
// `vpmaddubsw` sums pairs of products into int16 lanes, which add up over kInt16Quads quads
// before `vpmaddwd` widens them into the int32 sums. A 4-bit weight times an int8 is at most
// 15 * 127, so 8 quads' pair sums reach 30,480 at most; an 8-bit weight goes as its two
// nibbles' planes, the high one's sums worth 16.
struct Avx2 {
  using Vector = __m256i;
  static constexpr int kOutputs = 8;
#ifdef __AVXVNNI__
  static constexpr bool kDpbusd = true;  // AVX-VNNI: 4 products to an int32 lane, as VNNI
#else
  static constexpr bool kDpbusd = false;
#endif
  // 8 int16 sums, 4 weight vectors, a broadcast and a product: 14 of the 16 registers. Tiles
  // of 1 x 4, 2 x 3, 3 x 3 and 4 x 2 took 0.98-1.12x its time at 256 rows on 4-bit weights
  // (0.94-1.11x on 8-bit ones), measured on AVX2 alone (-mno-avx512f -mno-avxvnni) on a
  // 2-core AVX-512 EPYC.
  static constexpr int kMaxBlocks = 4;
  static constexpr int kTileRows = 2;
  // There, at 16 rows of llama3-8b and llama3.2-1b shapes, the GEMM took 0.79-1.16x the
  // per-row kernel's time; at 32, 0.68-0.99x; at 256, 0.57-0.75x. With AVX-VNNI kept
  // (-mno-avx512f alone), 0.57-1.08x at 16 rows and 0.49-0.92x at 24. On a 2-core AVX2 EPYC
  // (Zen 3), 4-bit expert and attention shapes with their weights in the caches, it took
  // 0.36-0.59x at 16 rows: each layer is timed at 16 at load (wxa8_gemm_runs' gemm_from).
  static constexpr int64_t kFromRows = kDpbusd ? 16 : 32;
  // Against 256 channels, on per-channel 8-bit layers, 512 took 0.86-1.00x the time with
  // AVX-VNNI and 0.87-1.12x without (two nibble planes: 32 KB of chunk for 4 blocks).
  static constexpr int64_t kChunk = kDpbusd ? 512 : 256;
  template <int BITS>
  static constexpr int kPlanes = BITS == 8 && !kDpbusd ? 2 : 1;
  static constexpr int64_t kInt16Quads = 8;

  // An 8 x 8 matrix of 32-bit elements, one row per register, transposed in place.
  static void transpose(__m256i (&r)[8]) {
    __m256i t[8];
    for (int i = 0; i < 8; i += 2) {  // rows i, i + 1 interleaved, per 128-bit half
      t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {  // r[i + j]: columns j and 4 + j of rows i..i + 3
      r[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
      r[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
      r[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
      r[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; ++j) {
      t[j] = _mm256_permute2x128_si256(r[j], r[4 + j], 0x20);
      t[4 + j] = _mm256_permute2x128_si256(r[j], r[4 + j], 0x31);
    }
    std::copy(t, t + 8, r);
  }

  // The chunk [c0, c0 + channels) of 8 * blocks output rows (`row_bytes` apart) as
  // [plane][channels / 4][blocks] vectors of nibbles.
  template <int BITS>
  static void transpose_chunk(const uint8_t* w, int64_t row_bytes, int blocks, int64_t c0,
                              int64_t channels, __m256i* out) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const int64_t quads = channels / 4;
    for (int b = 0; b < blocks; ++b)
      for (int64_t c = c0; c < c0 + channels; c += kBlock)
        // 4 bits: the low nibbles are channels c..c + 31, the high ones the next 32; 8 bits:
        // each half of the 64 bytes, low nibbles in plane 0 and high ones in plane 1.
        for (int part = 0; part < 2; ++part) {
          __m256i r[kPlanes<BITS>][8];
          for (int o = 0; o < 8; ++o) {
            const uint8_t* row = w + (b * 8 + o) * row_bytes + c * BITS / 8;
            const __m256i v = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(row + (BITS == 8 ? 32 * part : 0)));
            const __m256i shifted = _mm256_srli_epi16(v, 4);
            if constexpr (BITS == 8 && kPlanes<BITS> == 1) {
              r[0][o] = v;
            } else if constexpr (BITS == 8) {
              r[0][o] = _mm256_and_si256(v, nibble);
              r[1][o] = _mm256_and_si256(shifted, nibble);
            } else {
              r[0][o] = _mm256_and_si256(part ? shifted : v, nibble);
            }
          }
          for (int p = 0; p < kPlanes<BITS>; ++p) {
            transpose(r[p]);
            for (int j = 0; j < 8; ++j)
              out[(p * quads + (c - c0) / 4 + 8 * part + j) * blocks + b] = r[p][j];
          }
        }
  }

  template <int BITS, int ROWS, int BLOCKS>
  static void sums(const __m256i* w, int64_t quads, const int8_t* xq, int64_t k,
                   __m256i (&sums)[ROWS][BLOCKS]) {
    for (int r = 0; r < ROWS; ++r)
      for (int b = 0; b < BLOCKS; ++b) sums[r][b] = _mm256_setzero_si256();
    if constexpr (kDpbusd) {  // Vnni::sums in 8 lanes, the instruction in its VEX form
      for (int64_t j = 0; j < quads; ++j) {
        __m256i q[BLOCKS];
        for (int b = 0; b < BLOCKS; ++b) q[b] = _mm256_load_si256(w + j * BLOCKS + b);
        for (int r = 0; r < ROWS; ++r) {
          const __m256i x = _mm256_set1_epi32(quad(xq + r * k + 4 * j));
          for (int b = 0; b < BLOCKS; ++b)
            asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(sums[r][b]) : "x"(q[b]), "x"(x));
        }
      }
    } else {
      for (int p = 0; p < kPlanes<BITS>; ++p) {
        const __m256i worth = _mm256_set1_epi16(p == 0 ? 1 : 16);
        const __m256i* plane = w + p * quads * BLOCKS;
        for (int64_t j0 = 0; j0 < quads; j0 += kInt16Quads) {
          __m256i pairs[ROWS][BLOCKS];
          for (int r = 0; r < ROWS; ++r)
            for (int b = 0; b < BLOCKS; ++b) pairs[r][b] = _mm256_setzero_si256();
          for (int64_t j = j0; j < j0 + kInt16Quads; ++j) {
            __m256i q[BLOCKS];
            for (int b = 0; b < BLOCKS; ++b) q[b] = _mm256_load_si256(plane + j * BLOCKS + b);
            for (int r = 0; r < ROWS; ++r) {
              const __m256i x = _mm256_set1_epi32(quad(xq + r * k + 4 * j));
              // The instructions themselves: for the intrinsics, GCC 12 moved each sum between
              // registers around every add and kept one in memory (1.2x the time of this loop).
              for (int b = 0; b < BLOCKS; ++b) {
                __m256i product;
                asm("vpmaddubsw %3, %2, %1\n\tvpaddw %1, %0, %0"
                    : "+x"(pairs[r][b]), "=&x"(product) : "x"(q[b]), "x"(x));
              }
            }
          }
          for (int r = 0; r < ROWS; ++r)
            for (int b = 0; b < BLOCKS; ++b)
              sums[r][b] = _mm256_add_epi32(sums[r][b], _mm256_madd_epi16(pairs[r][b], worth));
        }
      }
    }
  }

  static void scale_into(float* out, __m256i sums, const float* scale, const float* scaled_zero,
                         float xs, float xz, bool zero_terms) {
    __m256 acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_load_ps(scale)),
                                 _mm256_set1_ps(xs), _mm256_loadu_ps(out));
    if (zero_terms) acc = _mm256_fnmadd_ps(_mm256_load_ps(scaled_zero), _mm256_set1_ps(xz), acc);
    _mm256_storeu_ps(out, acc);
  }
};
using Isa = Avx2;
#endif

// out[r, kOutputs * b + lane] += x_scale[r] * scale[b] * sum over the chunk of w * xq, and with
// `zero_terms`, -= x_scale[r] * x_sum[r] * (scale * zero)[b]: ROWS rows from xq (rows `k`
// apart), the chunk's quads `w` (transpose_chunk's layout).
template <int BITS, int ROWS, int BLOCKS>
inline void tile(const Isa::Vector* w, int64_t quads, const int8_t* xq, int64_t k,
                 const float* x_scale, const float* x_scaled_sum, int64_t groups,
                 const float* scale, const float* scaled_zero, bool zero_terms, float* out,
                 int64_t n) {
  Isa::Vector sums[ROWS][BLOCKS];
  Isa::sums<BITS, ROWS, BLOCKS>(w, quads, xq, k, sums);
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b)
      Isa::scale_into(out + r * n + Isa::kOutputs * b, sums[r][b], scale + Isa::kOutputs * b,
                      scaled_zero + Isa::kOutputs * b, x_scale[r * groups],
                      x_scaled_sum[r * groups], zero_terms);
}

// tile<BITS, rows, blocks> for run-time rows <= ROWS and blocks <= BLOCKS.
template <int BITS, int ROWS, int BLOCKS>
inline void any_tile(int rows, int blocks, const Isa::Vector* w, int64_t quads,
                     const int8_t* xq, int64_t k, const float* xs, const float* xz,
                     int64_t groups, const float* scale, const float* scaled_zero,
                     bool zero_terms, float* out, int64_t n) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS)
      return any_tile<BITS, ROWS - 1, BLOCKS>(rows, blocks, w, quads, xq, k, xs, xz, groups,
                                              scale, scaled_zero, zero_terms, out, n);
  }
  if constexpr (BLOCKS > 1) {
    if (blocks < BLOCKS)
      return any_tile<BITS, ROWS, BLOCKS - 1>(rows, blocks, w, quads, xq, k, xs, xz, groups,
                                              scale, scaled_zero, zero_terms, out, n);
  }
  tile<BITS, ROWS, BLOCKS>(w, quads, xq, k, xs, xz, groups, scale, scaled_zero, zero_terms, out,
                           n);
}

// out [m, n] (n a multiple of kOutputs) = the W4A8/W8A8 product of `rows`: threads split the
// tiles of kOutputs * kMaxBlocks outputs; each transposes a chunk of their weights, then runs
// every row tile over it.
template <int BITS>
void matmul(const QuantizedRows& rows, const uint8_t* packed, const float* scales,
            const float* zeros, int64_t zero_row, int64_t n, int64_t group, float* out) {
  constexpr int kOutputs = Isa::kOutputs, kMaxBlocks = Isa::kMaxBlocks;
  const int64_t m = rows.m, k = rows.k, groups = rows.groups;
  // A whole number of chunks to a group: 64-channel blocks, at most kChunk channels.
  const int64_t chunk = kBlock * std::gcd(group / kBlock, Isa::kChunk / kBlock);
  const int64_t row_bytes = k * BITS / 8;
  const int8_t* xq = rows.q;
  const float* x_scale = rows.scale;
  const float* x_scaled_sum = rows.scaled_sum;
  std::fill(out, out + m * n, 0.f);
  const int64_t tiles = (n / kOutputs + kMaxBlocks - 1) / kMaxBlocks;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<Isa::Vector> chunk_weights(Isa::kPlanes<BITS> * chunk / 4 * kMaxBlocks);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * kMaxBlocks * kOutputs;
      const int blocks =
          static_cast<int>(std::min<int64_t>(kMaxBlocks, (n - first) / kOutputs));
      for (int64_t c0 = 0; c0 < k; c0 += chunk) {
        const int64_t g = c0 / group;
        Isa::transpose_chunk<BITS>(packed + first * row_bytes, row_bytes, blocks, c0, chunk,
                                   chunk_weights.data());
        alignas(64) float scale[kMaxBlocks * kOutputs], scaled_zero[kMaxBlocks * kOutputs];
        for (int o = 0; o < blocks * kOutputs; ++o) {
          scale[o] = scales[(first + o) * groups + g];
          scaled_zero[o] = scale[o] * zeros[(first + o) * zero_row + g];
        }
        const bool zero_terms = c0 % group == 0;  // once per group
        for (int64_t r0 = 0; r0 < m; r0 += Isa::kTileRows) {
          const int r = static_cast<int>(std::min<int64_t>(Isa::kTileRows, m - r0));
          any_tile<BITS, Isa::kTileRows, kMaxBlocks>(
              r, blocks, chunk_weights.data(), chunk / 4, xq + r0 * k + c0, k,
              x_scale + r0 * groups + g, x_scaled_sum + r0 * groups + g, groups, scale,
              scaled_zero, zero_terms, out + r0 * n + first, n);
        }
      }
    }
  });
}

}  // namespace gemm
#endif

// fn(std::integral_constant<int, bits>) for a layer of 4 or 8 bits: the kernels' templates
// take the width at compile time.
template <typename Fn>
void with_bits(int64_t bits, Fn fn) {
  if (bits == 4) fn(std::integral_constant<int, 4>{});
  else fn(std::integral_constant<int, 8>{});
}

// x [M, K] float32; packed [N, K * bits / 8] uint8; scales [N, K / group] float32, and zeros
// as kvserve::wxa8_zero_row takes them, whose result it returns.
int64_t check_inputs(const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scales, const at::Tensor& zeros, int64_t group,
                     int64_t bits) {
  TORCH_CHECK((x.dtype() == at::kFloat ||
               (kReadsBFloat16 && x.dtype() == at::kBFloat16)) &&
                  x.is_contiguous() && x.dim() == 2,
              "wxa8: contiguous 2-D float32 input", kReadsBFloat16 ? " (or bfloat16)" : "");
  TORCH_CHECK(bits == 4 || bits == 8, "wxa8: 4 or 8 bits, got ", bits);
  const int64_t k = x.size(1), n = packed.size(0);
  TORCH_CHECK(group % kBlock == 0 && k % group == 0 && packed.size(1) * 8 == k * bits &&
                  packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "wxa8: a [n, k * bits / 8] uint8 weight in groups of a multiple of 64 channels "
              "for input width ", k);
  TORCH_CHECK(scales.numel() == n * (k / group) && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat,
              "wxa8: float32 scales of [n, k / group]");
  return kvserve::wxa8_zero_row(zeros, n, k / group, "wxa8");
}

// Outputs [begin, end) of out [m, n] for a few rows quantized into xq, xs and xz (in
// paired_position's order where `paired`): the paired, stream, one-row or per-row kernels. An
// output's value does not depend on the range it is computed in, so any split gives the same
// result.
void few_rows(const int8_t* xq, const float* xs, const float* xz, int64_t m, bool paired,
              const uint8_t* wp, const float* sp, const float* zp, int64_t zero_row, int64_t k,
              int64_t group, int64_t bits, float* op, int64_t n, int64_t begin, int64_t end) {
  const int64_t groups = k / group, blocks = group / kBlock;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (paired) {
    with_prefetch(k * bits / 8, m, true, [&](auto l2) {
      row_tiles(m, [&](auto tile, int64_t r0) {
        paired::outputs<decltype(tile)::value, decltype(l2)::value>(
            wp, k * bits / 8, xq + r0 * k, xs + r0 * groups, xz + r0 * groups, sp, zp,
            zero_row, k, groups, blocks, op + r0 * n, n, begin, end);
      });
    });
    return;
  }
#endif
#ifdef KVSERVE_WXA8_STREAMS
  if (bits == 8 && (m == 1 || m == 2)) {
    if (m == 2)
      streams::outputs<2>(wp, xq, xs, xz, sp, zp, zero_row, k, groups, blocks, op, n, begin,
                          end);
    else
      streams::outputs<1>(wp, xq, xs, xz, sp, zp, zero_row, k, groups, blocks, op, n, begin,
                          end);
    return;
  }
  if (bits == 4 && m == 1) {
    one_row::outputs(wp, xq, xs, xz, sp, zp, zero_row, k, groups, blocks, op, begin, end);
    return;
  }
#endif
  for (int64_t o = begin; o < end; ++o) {
    with_bits(bits, [&](auto b) {
      weight_rows<decltype(b)::value>(wp + o * k * bits / 8, xq, xs, xz, sp + o * groups,
                                      zp + o * zero_row, m, k, groups, blocks, op + o, n);
    });
  }
}

#if defined(KVSERVE_AMX) && defined(__AMX_INT8__)
// W4A8/W8A8 on AMX's int8 tiles: 16 outputs' weights as the left tile (one output per row,
// 64 channels), 16 activation rows as the right one, so a 4-bit weight is widened by masking
// its nibbles, with no transposes: the low nibbles of a 128-channel unit's 64 bytes per output
// are one tile, the high ones another, and the activations are laid out in the channel order
// those tiles give. Each group's integer sums are scaled into float32 accumulators.
namespace amx_int8 {

constexpr int64_t kUnit = 128;            // input channels per pair of tiles
constexpr int64_t kTileBytes = 16 * 64;   // one tile: 16 rows of 64 bytes
constexpr int64_t kChunkBytes = 1 << 19;  // activations kept in L2 while the weights pass

// The input channel at byte p (0-63) of half h of unit u's left-hand tile rows.
template <int BITS>
inline int64_t channel(int64_t u, int h, int p) {
  if constexpr (BITS == 4) return (2 * u + p / 32) * kBlock + 32 * h + p % 32;
  else return u * kUnit + 64 * h + p;
}

// Quantized rows as right-hand tiles: [slab of 16 rows][unit][half][16 channel quads][16 rows]
// [4 channels], rows past m zero; and per slab and group, the 16 rows' scales and their
// scale * sum of integers.
template <int BITS>
void lay_out(const QuantizedRows& rows, int64_t slabs, int8_t* tiles, float* scale,
             float* scaled_sum) {
  const int64_t m = rows.m, k = rows.k, groups = rows.groups;
  const int64_t units = k / kUnit;
  const int8_t* q = rows.q;
  const float* xs = rows.scale;
  const float* xz = rows.scaled_sum;
  // A tile's row q holds channels 4q..4q+3 of each of the 16 rows: the rows' 64 bytes, as 16
  // 32-bit words each, transposed.
  at::parallel_for(0, slabs * units, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / units, u = i % units;
      for (int h = 0; h < 2; ++h) {
        __m512i words[16];
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t row = s * 16 + r;
          const int8_t* x = q + row * k;
          if (row >= m)
            words[r] = _mm512_setzero_si512();
          else if constexpr (BITS == 4)
            words[r] = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256(
                    reinterpret_cast<const __m256i*>(x + channel<4>(u, h, 0)))),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + channel<4>(u, h, 32))),
                1);
          else
            words[r] = _mm512_loadu_si512(x + channel<8>(u, h, 0));
        }
        kvserve::dequantize::transpose(words);
        int8_t* tile = tiles + (i * 2 + h) * kTileBytes;
        for (int quad = 0; quad < 16; ++quad) _mm512_store_si512(tile + quad * 64, words[quad]);
      }
    }
  });
  for (int64_t s = 0; s < slabs; ++s)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t row = s * 16 + r;
        scale[(s * groups + g) * 16 + r] = row < m ? xs[row * groups + g] : 0.f;
        scaled_sum[(s * groups + g) * 16 + r] = row < m ? xz[row * groups + g] : 0.f;
      }
}

// The two tile sets a step alternates between (the intrinsics take literal tile numbers): set
// S sums in tile S from weight tiles 2 + 2S and 3 + 2S; activations always in 6 and 7.
template <int SET>
struct TileSet;

template <>
struct TileSet<0> {
  static void zero() { _tile_zero(0); }
  static void load_weights(const void* lo, const void* hi, int64_t stride) {
    _tile_loadd(2, lo, stride);
    _tile_loadd(3, hi, stride);
  }
  static void multiply() {
    _tile_dpbusd(0, 2, 6);
    _tile_dpbusd(0, 3, 7);
  }
  static void store(int32_t* sums) { _tile_stored(0, sums, 64); }
};

template <>
struct TileSet<1> {
  static void zero() { _tile_zero(1); }
  static void load_weights(const void* lo, const void* hi, int64_t stride) {
    _tile_loadd(4, lo, stride);
    _tile_loadd(5, hi, stride);
  }
  static void multiply() {
    _tile_dpbusd(1, 4, 6);
    _tile_dpbusd(1, 5, 7);
  }
  static void store(int32_t* sums) { _tile_stored(1, sums, 64); }
};

// out [m, n] for n a multiple of 16: threads split the 16-output blocks; each runs chunks of
// rows whose tiles fit in L2, and per block, group by group, every slab of the chunk. A step
// (one group of one slab) sums into one of two tile sets while the last step's sums are
// scaled into the float32 accumulators, so the vector work runs while the tiles multiply.
template <int BITS>
void matmul(const QuantizedRows& rows, const uint8_t* packed, const float* scales,
            const float* zeros, int64_t zero_row, int64_t n, int64_t group, float* out) {
  const int64_t m = rows.m, k = rows.k, groups = rows.groups;
  const int64_t units = k / kUnit, units_per_group = group / kUnit;
  const int64_t slabs = (m + 15) / 16, row_bytes = k * BITS / 8;
  // torch's CPU allocator aligns to 64 bytes, as the tiles' stores need.
  const at::Tensor tile_buffer = at::empty({slabs * units * 2 * kTileBytes}, at::kChar);
  const at::Tensor row_scales = at::empty({2, slabs * groups * 16}, at::kFloat);
  const int8_t* tiles = tile_buffer.data_ptr<int8_t>();
  const float* x_scale = row_scales.data_ptr<float>();
  const float* x_scaled_sum = x_scale + slabs * groups * 16;
  lay_out<BITS>(rows, slabs, tile_buffer.data_ptr<int8_t>(), row_scales.data_ptr<float>(),
                row_scales.data_ptr<float>() + slabs * groups * 16);
  const int64_t chunk = std::clamp<int64_t>(kChunkBytes / (16 * k), 1, slabs);
  at::parallel_for(0, n / 16, 1, [&](int64_t begin, int64_t end) {
    kvserve::amx::configure_tiles({16, 16, 16, 16, 16, 16, 16, 16});
    // 4 bits: a group's units as bytes, two tiles each (a __m512i per tile row), for this
    // group and the last one.
    std::vector<__m512i> widened(BITS == 4 ? 2 * units_per_group * 32 : 0);
    alignas(64) int32_t sums[16 * 16];
    std::vector<__m512> acc_buffer(chunk * 16);  // per slab, 16 outputs x 16 rows
    float* acc = reinterpret_cast<float*>(acc_buffer.data());
    for (int64_t s0 = 0; s0 < slabs; s0 += chunk) {
      const int64_t s1 = std::min(slabs, s0 + chunk);
      for (int64_t b = begin; b < end; ++b) {
        const uint8_t* w = packed + b * 16 * row_bytes;
        const float* w_scale = scales + b * 16 * groups;
        const float* w_zero = zeros + b * 16 * zero_row;
        std::fill(acc, acc + (s1 - s0) * 256, 0.f);
        // Step (g, s)'s sums, in tile set `set`, into the accumulators.
        const auto scale_sums = [&](int64_t g, int64_t s, int set) {
          if (set == 0) TileSet<0>::store(sums);
          else TileSet<1>::store(sums);
          const __m512 xs = _mm512_loadu_ps(x_scale + (s * groups + g) * 16);
          const __m512 xz = _mm512_loadu_ps(x_scaled_sum + (s * groups + g) * 16);
          float* a = acc + (s - s0) * 256;
          for (int o = 0; o < 16; ++o) {
            // scale * (sums * x_scale - zero * x_scale * x_sum)
            const __m512 c = _mm512_cvtepi32_ps(_mm512_load_si512(sums + o * 16));
            const __m512 v = _mm512_fmsub_ps(
                c, xs, _mm512_mul_ps(xz, _mm512_set1_ps(w_zero[o * zero_row + g])));
            _mm512_store_ps(a + o * 16,
                            _mm512_fmadd_ps(v, _mm512_set1_ps(w_scale[o * groups + g]),
                                            _mm512_load_ps(a + o * 16)));
          }
        };
        // Step (g, s) on a tile set.
        const auto multiply = [&](auto set, int64_t g, int64_t s) {
          using Tiles = TileSet<decltype(set)::value>;
          Tiles::zero();
          for (int64_t u = g * units_per_group; u < (g + 1) * units_per_group; ++u) {
            if constexpr (BITS == 4) {
              __m512i* wide =
                  widened.data() + ((g % 2) * units_per_group + u % units_per_group) * 32;
              if (s == s0) {
                const __m512i nibble = _mm512_set1_epi8(0x0F);
                for (int o = 0; o < 16; ++o) {
                  const __m512i v = _mm512_loadu_si512(w + o * row_bytes + u * 64);
                  wide[o] = _mm512_and_si512(v, nibble);
                  wide[16 + o] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                }
              }
              Tiles::load_weights(wide, wide + 16, 64);
            } else {
              Tiles::load_weights(w + u * kUnit, w + u * kUnit + 64, row_bytes);
            }
            const int8_t* x = tiles + (s * units + u) * 2 * kTileBytes;
            _tile_loadd(6, x, 64);
            _tile_loadd(7, x + kTileBytes, 64);
            Tiles::multiply();
          }
        };
        int64_t last_g = -1, last_s = 0;
        int set = 0;
        for (int64_t g = 0; g < groups; ++g)
          for (int64_t s = s0; s < s1; ++s) {
            if (set == 0) multiply(std::integral_constant<int, 0>{}, g, s);
            else multiply(std::integral_constant<int, 1>{}, g, s);
            if (last_g >= 0) scale_sums(last_g, last_s, 1 - set);
            last_g = g, last_s = s, set = 1 - set;
          }
        scale_sums(last_g, last_s, 1 - set);
        for (int64_t s = s0; s < s1; ++s) {
          __m512i t[16];
          for (int o = 0; o < 16; ++o)
            t[o] = _mm512_castps_si512(_mm512_load_ps(acc + (s - s0) * 256 + o * 16));
          kvserve::dequantize::transpose(t);
          for (int64_t r = 0; r < 16 && s * 16 + r < m; ++r)
            _mm512_storeu_ps(out + (s * 16 + r) * n + b * 16, _mm512_castsi512_ps(t[r]));
        }
      }
    }
    _tile_release();
  });
}

}  // namespace amx_int8
#endif

}  // namespace

namespace kvserve {

int64_t wxa8_zero_row(const at::Tensor& zeros, int64_t n, int64_t groups, const char* who) {
  TORCH_CHECK(zeros.dim() == 2 && (zeros.size(0) == n || zeros.size(0) == 1) &&
                  zeros.size(1) == groups && zeros.is_contiguous() &&
                  zeros.scalar_type() == at::kFloat,
              who, ": float32 zeros of [n, k / group], or of [1, k / group] for all outputs: ",
              "[", n, " or 1, ", groups, "], got ", zeros.sizes(), " ", zeros.scalar_type());
  return zeros.size(0) == 1 ? 0 : groups;
}

bool wxa8_gemm_runs(int64_t rows, int64_t n, int64_t gemm_from) {
#if defined(__AVX2__)
  return rows >= (gemm_from > 0 ? gemm_from : gemm::Isa::kFromRows) &&
         n % gemm::Isa::kOutputs == 0;
#else
  return false;
#endif
}

bool wxa8_amx_runs(int64_t k, int64_t n, int64_t group) {
#if defined(KVSERVE_AMX) && defined(__AMX_INT8__)
  return group % amx_int8::kUnit == 0 && k % group == 0 && n % 16 == 0 && amx::ready();
#else
  return false;
#endif
}

at::Tensor wxa8_amx_matmul(at::Tensor x, at::Tensor packed, at::Tensor scales,
                           at::Tensor zeros, int64_t group, int64_t bits) {
  const int64_t zero_row = check_inputs(x, packed, scales, zeros, group, bits);
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(wxa8_amx_runs(k, n, group), "wxa8_amx_matmul: no AMX int8 tiles, or groups not "
              "of a multiple of 128 channels, or outputs not a multiple of 16");
  auto out = at::empty({m, n}, at::kFloat);
#if defined(KVSERVE_AMX) && defined(__AMX_INT8__)
  if (m == 0) return out;
  const QuantizedRows rows = quantize_rows(x, group, false);
  with_bits(bits, [&](auto b) {
    amx_int8::matmul<decltype(b)::value>(rows, packed.data_ptr<uint8_t>(),
                                         scales.data_ptr<float>(), zeros.data_ptr<float>(),
                                         zero_row, n, group, out.data_ptr<float>());
  });
#endif
  return out;
}

at::Tensor wxa8_matmul(at::Tensor x, at::Tensor packed, at::Tensor scales,
                       at::Tensor zeros, int64_t group, int64_t bits, int64_t gemm_from) {
  const int64_t zero_row = check_inputs(x, packed, scales, zeros, group, bits);
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  const bool many_rows = wxa8_gemm_runs(m, n, gemm_from),
             paired = !many_rows && paired_runs(bits, group / kBlock);
  const QuantizedRows rows = quantize_rows(x, group, paired);
  auto out = at::empty({m, n}, at::kFloat);
#if defined(__AVX2__)
  if (many_rows) {
    with_bits(bits, [&](auto b) {
      gemm::matmul<decltype(b)::value>(rows, packed.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                       zeros.data_ptr<float>(), zero_row, n, group,
                                       out.data_ptr<float>());
    });
    return out;
  }
#endif
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    few_rows(rows.q, rows.scale, rows.scaled_sum, m, paired, packed.data_ptr<uint8_t>(),
             scales.data_ptr<float>(), zeros.data_ptr<float>(), zero_row, k, group, bits,
             out.data_ptr<float>(), n, begin, end);
  });
  return out;
}

namespace {

// The kernel wxa8_linear runs `rows` rows of a layer of n outputs on.
enum class Route { kDequantized, kAmx, kGemm, kFewRows };

Route route(int64_t rows, int64_t n, int64_t amx_from, int64_t dequantized_from,
            int64_t gemm_from) {
  if (dequantized_from > 0 && rows >= dequantized_from) return Route::kDequantized;
  if (amx_from > 0 && rows >= amx_from) return Route::kAmx;
  return wxa8_gemm_runs(rows, n, gemm_from) ? Route::kGemm : Route::kFewRows;
}

}  // namespace

at::Tensor wxa8_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& scales, const at::Tensor& zeros,
                       const c10::optional<at::Tensor>& input_order, int64_t group,
                       int64_t bits, int64_t amx_from, int64_t dequantized_from,
                       int64_t gemm_from) {
  const at::Tensor rows = input_order ? x.index_select(1, *input_order) : x;
  const Route to = route(rows.size(0), packed.size(0), amx_from, dequantized_from, gemm_from);
  if (to == Route::kDequantized)
    return dequantized_linear(rows.contiguous(), packed, scales, zeros, group, bits)
        .to(x.scalar_type());
  const at::Tensor input = readable(rows);
  const at::Tensor out = to == Route::kAmx
                                ? wxa8_amx_matmul(input, packed, scales, zeros, group, bits)
                                : wxa8_matmul(input, packed, scales, zeros, group, bits,
                                              gemm_from);
  return in_dtype(out, x.scalar_type());
}

bool wxa8_few_rows_run(const LinearWeights& layer, int64_t rows) {
  return layer.kind == LinearWeights::Kind::kWxA8 && !layer.input_order &&
         route(rows, layer.weight.size(0), layer.amx_from, layer.dequantized_from,
               layer.gemm_from) == Route::kFewRows;
}

bool wxa8_experts_run(const std::vector<const LinearWeights*>& layers,
                      const std::vector<int64_t>& counts) {
  if (layers.empty() || counts.size() != layers.size()) return false;
  const LinearWeights& first = *layers.front();
  for (size_t e = 0; e < layers.size(); ++e) {
    const LinearWeights& layer = *layers[e];
    if (!wxa8_few_rows_run(layer, counts[e]) || layer.group != first.group ||
        layer.bits != first.bits || layer.weight.sizes() != first.weight.sizes())
      return false;
  }
  return true;
}

at::Tensor wxa8_experts(const at::Tensor& x, const std::vector<const LinearWeights*>& layers,
                        const std::vector<int64_t>& starts, const std::vector<int64_t>& counts) {
  TORCH_CHECK(wxa8_experts_run(layers, counts) && starts.size() == counts.size(),
              "wxa8_experts: W4A8/W8A8 layers of one shape, group and width, without "
              "act-order, each of whose rows go to the few-rows kernel, with a start and a "
              "count of rows each");
  const LinearWeights& first = *layers.front();
  const int64_t count = static_cast<int64_t>(layers.size()), m = x.size(0), k = x.size(1);
  const int64_t n = first.weight.size(0), group = first.group, bits = first.bits;
  std::vector<int64_t> out_starts(count + 1, 0);
  for (int64_t e = 0; e < count; ++e) {
    TORCH_CHECK(counts[e] >= 1 && starts[e] >= 0 && starts[e] + counts[e] <= m,
                "wxa8_experts: layer ", e, "'s rows [", starts[e], ", ",
                starts[e] + counts[e], ") outside x's ", m);
    out_starts[e + 1] = out_starts[e] + counts[e];
  }
  const at::Tensor input = readable(x);
  std::vector<int64_t> zero_rows;
  for (const LinearWeights* layer : layers)
    zero_rows.push_back(check_inputs(input, layer->weight, *layer->scales, *layer->zeros, group,
                                     bits));
  const int64_t groups = k / group;
  const bool paired = paired_runs(bits, group / kBlock);
  const QuantizedRows rows = quantize_rows(input, group, paired);
  at::Tensor out = at::empty({out_starts[count], n}, at::kFloat);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count * n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin / n; e * n < end; ++e) {
      const LinearWeights& layer = *layers[e];
      const int64_t r = starts[e];
      few_rows(rows.q + r * k, rows.scale + r * groups, rows.scaled_sum + r * groups, counts[e],
               paired, layer.weight.data_ptr<uint8_t>(), layer.scales->data_ptr<float>(),
               layer.zeros->data_ptr<float>(), zero_rows[e], k, group, bits,
               op + out_starts[e] * n, n, std::max<int64_t>(begin - e * n, 0),
               std::min(end - e * n, n));
    }
  });
  return in_dtype(out, x.scalar_type());
}

}  // namespace kvserve
