// A W4A8/W8A8 weight (wxa8.cpp's layout) dequantized 16 outputs at a time
// into the 16-output blocks of simd.h, so the blocked GEMM and its AMX tiles run a quantized
// layer at their own rate once enough input rows share each dequantized block (the MARLIN idea:
// the weight crosses memory in its 4- or 8-bit form and is widened next to the multiply).
//
// The layout: per output row, blocks of 64 input channels; 4 bits: byte j holds channel j in
// its low nibble and channel j + 32 in its high one; 8 bits: 64 bytes in channel order. Each
// weight becomes (q - zero) * scale in float32, rounded to T: the bits of the dequantized
// weight torch computes. Each output row is widened in channel order, and 16 rows are then
// transposed in registers into the block's input steps.
#pragma once

#include "simd.h"

#ifdef __AVX512F__
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace kvserve::dequantize {

using simd::kBlock;
constexpr int64_t kChannels = 64;  // input channels per block of the quantized layout

// A 16 x 16 matrix of 32-bit elements, one row per register, transposed in place.
inline void transpose(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // lane L of t[i], t[i + 1]: rows i, i + 1 interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // lane L of r[i + j]: column 4L + j of rows i..i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // column 4L + j gathers lane L of r[j], r[4 + j], r[8 + j], ...
    const __m512i even_low = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    const __m512i odd_low = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    const __m512i even_high = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    const __m512i odd_high = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
    t[j] = _mm512_shuffle_i32x4(even_low, even_high, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(odd_low, odd_high, 0x88);
    t[8 + j] = _mm512_shuffle_i32x4(even_low, even_high, 0xdd);
    t[12 + j] = _mm512_shuffle_i32x4(odd_low, odd_high, 0xdd);
  }
  std::copy(t, t + 16, r);
}

// Every 4-bit level's weight, (level - zero) * scale.
inline __m512 levels(float scale, float zero) {
  const __m512 level = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_mul_ps(_mm512_sub_ps(level, _mm512_set1_ps(zero)), _mm512_set1_ps(scale));
}

// One output row's 64 channels of a block (q: its bytes) as float32, 16 per register.
template <int BITS>
inline void row_float(const uint8_t* q, float scale, float zero, __m512 (&out)[4]) {
  if constexpr (BITS == 4) {  // each level looked up in a register of all 16 of them
    const __m512 table = levels(scale, zero);
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i halves[2] = {_mm256_and_si256(bytes, nibble),
                               _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)};
    for (int i = 0; i < 4; ++i) {
      const __m128i levels16 = i % 2 ? _mm256_extracti128_si256(halves[i / 2], 1)
                                     : _mm256_castsi256_si128(halves[i / 2]);
      out[i] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(levels16), table);
    }
  } else {
    for (int i = 0; i < 4; ++i) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i));
      const __m512 value = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
      out[i] = _mm512_mul_ps(_mm512_sub_ps(value, _mm512_set1_ps(zero)), _mm512_set1_ps(scale));
    }
  }
}

#ifdef __AVX512BF16__
// One output row's 64 channels as bfloat16, 32 per register (16 channel pairs).
template <int BITS>
inline void row_bf16(const uint8_t* q, float scale, float zero, __m512i (&out)[2]) {
  if constexpr (BITS == 4) {  // the levels rounded once, then looked up 32 at a time
    const __m512i table =
        _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(levels(scale, zero)));
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    out[0] = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(bytes, nibble)),
                                      table);
    out[1] = _mm512_permutexvar_epi16(
        _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)), table);
  } else {
    __m512 value[4];
    row_float<BITS>(q, scale, zero, value);
    out[0] = (__m512i)_mm512_cvtne2ps_pbh(value[1], value[0]);
    out[1] = (__m512i)_mm512_cvtne2ps_pbh(value[3], value[2]);
  }
}
#endif

// Outputs [0, rows) of a block (rows <= 16; the rest zeros) into `out`, the packed block
// ([k / step][16][step] of T). q, scales and zeros start at the block's first output; q has
// rows of k * BITS / 8 bytes, scales rows of k / group, zeros rows `zero_row` apart
// (wxa8_zero_row).
template <typename T, int BITS>
void block(const uint8_t* q, const float* scales, const float* zeros, int64_t zero_row,
           int64_t rows, int64_t k, int64_t group, T* out) {
  constexpr int kRegisters = std::is_same_v<T, float> ? 4 : 2;  // per row of 64 channels
  constexpr int64_t kStep = simd::Lanes<T>::kStep;
  const int64_t row_bytes = k * BITS / 8, groups = k / group;
  for (int64_t c = 0; c < k; c += kChannels) {
    const int64_t g = c / group;
    __m512i parts[kRegisters][16];
    for (int o = 0; o < 16; ++o) {
      if (o >= rows) {
        for (auto& part : parts) part[o] = _mm512_setzero_si512();
        continue;
      }
      const uint8_t* row = q + o * row_bytes + c * BITS / 8;
      const float scale = scales[o * groups + g], zero = zeros[o * zero_row + g];
      if constexpr (std::is_same_v<T, float>) {
        __m512 value[4];
        row_float<BITS>(row, scale, zero, value);
        for (int i = 0; i < 4; ++i) parts[i][o] = _mm512_castps_si512(value[i]);
      } else {
#ifdef __AVX512BF16__
        __m512i value[2];
        row_bf16<BITS>(row, scale, zero, value);
        for (int i = 0; i < 2; ++i) parts[i][o] = value[i];
#endif
      }
    }
    // Part i holds input steps [16i, 16i + 16) of these channels, one output per register;
    // transposed, one step per register.
    for (int i = 0; i < kRegisters; ++i) {
      transpose(parts[i]);
      T* steps = out + (c / kStep + 16 * i) * kBlock * kStep;
      for (int s = 0; s < 16; ++s)
        _mm512_storeu_si512(steps + s * kBlock * kStep, parts[i][s]);
    }
  }
}

// A quantized weight's 16-output blocks as the GEMM asks for them (`load` a range, then
// `block`), dequantized into a buffer of the calling thread's own.
template <typename T, int BITS>
struct Blocks {
  const uint8_t* q;
  const float* scales;
  const float* zeros;
  int64_t zero_row, n, k, group;

  struct Loaded {
    std::vector<T> buffer;
    int64_t first = 0;  // the block at the buffer's start
  };
  static Loaded& loaded() {
    static thread_local Loaded blocks;
    return blocks;
  }

  void load(int64_t begin, int64_t end) const {
    const int64_t block_elems = k * kBlock, groups = k / group;
    Loaded& into = loaded();
    const auto elems = static_cast<size_t>((end - begin) * block_elems);
    if (into.buffer.size() < elems) into.buffer.resize(elems);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t row = b * kBlock;
      dequantize::block<T, BITS>(q + row * (k * BITS / 8), scales + row * groups,
                                 zeros + row * zero_row, zero_row, std::min(kBlock, n - row), k,
                                 group, into.buffer.data() + (b - begin) * block_elems);
    }
    into.first = begin;
  }
  const T* block(int64_t b) const {
    const Loaded& from = loaded();
    return from.buffer.data() + (b - from.first) * k * kBlock;
  }
};

}  // namespace kvserve::dequantize
#endif  // __AVX512F__
