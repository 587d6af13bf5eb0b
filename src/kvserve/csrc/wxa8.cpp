// 4- or 8-bit weight x 8-bit activation matmul for CPU decode: the activations of each row are
// quantized to int8 per weight group on the fly, and each group's integer dot product runs on
// VNNI (AVX512-VNNI: 64 multiply-adds per instruction) or, without it, AVX2's maddubs. A group
// contributes x_scale * (w_scale * dot(q, xq) - w_scale * zero * sum(xq)) to the output.
//
// Weight layout, per block of 64 input channels: 4 bits, 32 bytes where byte j holds channel j
// in its low nibble and channel j + 32 in its high one; 8 bits, 64 bytes in channel order.
#include "kvserve_cpu.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 64;  // input channels per packed block
constexpr int64_t kRows = 4;    // activation rows served by one pass over a weight row

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
// u8 x s8 products of 32 channels summed into 8 int32 lanes: pairs of 4-bit values times
// int8 stay within int16 (2 * 15 * 127), so 8-bit weights go as their two nibbles.
inline __m256i nibble_dot(__m256i q, const int8_t* x) {
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_madd_epi16(
      _mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), ones);
}

template <int BITS>
inline __m256i block_dot(const uint8_t* w, const int8_t* x) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  if constexpr (BITS == 8) {
    __m256i acc = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * half));
      const int8_t* xh = x + 32 * half;
      acc = _mm256_add_epi32(acc, nibble_dot(_mm256_and_si256(v, nibble), xh));
      acc = _mm256_add_epi32(acc, _mm256_slli_epi32(
          nibble_dot(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), xh), 4));
    }
    return acc;
  } else {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    return _mm256_add_epi32(
        nibble_dot(_mm256_and_si256(packed, nibble), x),
        nibble_dot(_mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble), x + 32));
  }
}
#endif

// out[r] = sum over groups g of x_scale[r, g] * (scale[g] * dot(q_g, xq[r]_g)
//                                             - scale[g] * zero[g] * x_sum[r, g])
// for ROWS activation rows `k` apart, over one weight row: each block of 64 weights is
// loaded once for all rows, and a group's integer sums are scaled into float lanes, so
// lanes are summed once per output.
template <int BITS, int ROWS>
inline void weight_row(const uint8_t* w, const int8_t* xq, const float* x_scale,
                       const float* x_sum, const float* scale, const float* zero,
                       int64_t k, int64_t groups, int64_t blocks, float* out) {
  constexpr int64_t kBytes = kBlock * BITS / 8;
  float zero_terms[ROWS] = {};
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dots[ROWS];
    for (int r = 0; r < ROWS; ++r) dots[r] = _mm512_setzero_si512();
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      const __m512i q = block_weights<BITS>(w + b * kBytes);
      for (int r = 0; r < ROWS; ++r)
        dots[r] = _mm512_dpbusd_epi32(dots[r], q, _mm512_loadu_si512(xq + r * k + b * kBlock));
    }
    for (int r = 0; r < ROWS; ++r) {
      const float xs = x_scale[r * groups + g];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_set1_ps(xs * scale[g]),
                               acc[r]);
      zero_terms[r] += xs * (zero[g] * scale[g]) * x_sum[r * groups + g];
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) - zero_terms[r];
#elif defined(__AVX2__)
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dots[ROWS];
    for (int r = 0; r < ROWS; ++r) dots[r] = _mm256_setzero_si256();
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b)
      for (int r = 0; r < ROWS; ++r)
        dots[r] = _mm256_add_epi32(dots[r],
                                   block_dot<BITS>(w + b * kBytes, xq + r * k + b * kBlock));
    for (int r = 0; r < ROWS; ++r) {
      const float xs = x_scale[r * groups + g];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_set1_ps(xs * scale[g]),
                               acc[r]);
      zero_terms[r] += xs * (zero[g] * scale[g]) * x_sum[r * groups + g];
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    float total = 0.f;
    for (float lane : lanes) total += lane;
    out[r] = total - zero_terms[r];
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
      total += xs * (scale[g] * static_cast<float>(dot) -
                     (zero[g] * scale[g]) * x_sum[r * groups + g]);
    }
    out[r] = total;
  }
#endif
}

template <int BITS>
void weight_rows(const uint8_t* w, const int8_t* xq, const float* xs, const float* xsum,
                 const float* scale, const float* zero, int64_t m, int64_t k, int64_t groups,
                 int64_t blocks, float* out, int64_t n) {
  float row_out[kRows];
  for (int64_t r0 = 0; r0 < m; r0 += kRows) {
    const int64_t rows = std::min(kRows, m - r0);
    const int8_t* x = xq + r0 * k;
    const float* s0 = xs + r0 * groups;
    const float* t0 = xsum + r0 * groups;
    switch (rows) {
      case 4: weight_row<BITS, 4>(w, x, s0, t0, scale, zero, k, groups, blocks, row_out); break;
      case 3: weight_row<BITS, 3>(w, x, s0, t0, scale, zero, k, groups, blocks, row_out); break;
      case 2: weight_row<BITS, 2>(w, x, s0, t0, scale, zero, k, groups, blocks, row_out); break;
      default: weight_row<BITS, 1>(w, x, s0, t0, scale, zero, k, groups, blocks, row_out);
    }
    for (int64_t r = 0; r < rows; ++r) out[(r0 + r) * n] = row_out[r];
  }
}

}  // namespace

namespace kvserve {

// x [M, K] float32; packed [N, K * bits / 8] uint8; scales and zeros [N, K / group] float32.
torch::Tensor wxa8_matmul(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          torch::Tensor zeros, int64_t group, int64_t bits) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2);
  TORCH_CHECK(bits == 4 || bits == 8);
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  const int64_t groups = k / group;
  TORCH_CHECK(group % kBlock == 0 && groups * group == k && packed.size(1) * 8 == k * bits);
  // Activations to int8, one scale per (row, group), with each group's sum of integers.
  auto xq = torch::empty({m, k}, torch::kInt8);
  auto x_scale = torch::empty({m, groups}, torch::kFloat32);
  auto x_sum = torch::empty({m, groups}, torch::kFloat32);
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* xs = x_scale.data_ptr<float>();
  float* xsum = x_sum.data_ptr<float>();
  for (int64_t r = 0; r < m * groups; ++r) {
    const float* v = xp + r * group;
    float amax = 0.f;
    for (int64_t j = 0; j < group; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t total = 0;
    for (int64_t j = 0; j < group; ++j) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(v[j] * inv));
      xqp[r * group + j] = static_cast<int8_t>(q);
      total += q;
    }
    xs[r] = amax / 127.f;
    xsum[r] = static_cast<float>(total);
  }
  auto out = torch::empty({m, n}, torch::kFloat32);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = k * bits / 8, blocks = group / kBlock;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* w = wp + o * row_bytes;
      if (bits == 8)
        weight_rows<8>(w, xqp, xs, xsum, sp + o * groups, zp + o * groups, m, k, groups,
                       blocks, op + o, n);
      else
        weight_rows<4>(w, xqp, xs, xsum, sp + o * groups, zp + o * groups, m, k, groups,
                       blocks, op + o, n);
    }
  });
  return out;
}

torch::Tensor wxa8_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& zeros,
                          const c10::optional<torch::Tensor>& input_order, int64_t group,
                          int64_t bits, int64_t dequantized_from) {
  const torch::Tensor rows = input_order ? x.index_select(1, *input_order) : x;
  const torch::Tensor out =
      dequantized_from > 0 && rows.size(0) >= dequantized_from
          ? dequantized_linear(rows.contiguous(), packed, scales, zeros, group, bits)
          : wxa8_matmul(rows.to(torch::kFloat).contiguous(), packed, scales, zeros, group,
                        bits);
  return out.to(x.scalar_type());
}

}  // namespace kvserve
