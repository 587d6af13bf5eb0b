// 4-bit weight x 8-bit activation matmul for CPU decode: the activations of each row are
// quantized to int8 per weight group on the fly, and each group's integer dot product runs on
// VNNI (AVX512-VNNI: 64 multiply-adds per instruction) or, without it, AVX2's maddubs. A group
// contributes x_scale * (w_scale * dot(q, xq) - w_scale * zero * sum(xq)) to the output.
//
// Weight layout: [N, K / 2] uint8; within each block of 64 input channels, byte j holds
// channel j in its low nibble and channel j + 32 in its high nibble.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 64;  // input channels per packed block

constexpr int64_t kRows = 4;  // activation rows served by one pass over a weight row

// out[r] = sum over groups g of x_scale[r, g] * (scale[g] * dot(q_g, xq[r]_g)
//                                             - scaled_zero[g] * x_sum[r, g])
// for ROWS activation rows `k` apart, over one weight row: each block of 64 weights is
// unpacked once for all rows, and a group's integer sums are scaled into float lanes, so
// lanes are summed once per output.
template <int ROWS>
inline void weight_row(const uint8_t* w, const int8_t* xq, const float* x_scale,
                       const float* x_sum, const float* scale, const float* scaled_zero,
                       int64_t k, int64_t groups, int64_t blocks, float* out) {
  float zero_terms[ROWS] = {};
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dots[ROWS];
    for (int r = 0; r < ROWS; ++r) dots[r] = _mm512_setzero_si512();
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32));
      const __m256i lo = _mm256_and_si256(packed, nibble);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      for (int r = 0; r < ROWS; ++r)
        dots[r] = _mm512_dpbusd_epi32(dots[r], q, _mm512_loadu_si512(xq + r * k + b * kBlock));
    }
    for (int r = 0; r < ROWS; ++r) {
      const float xs = x_scale[r * groups + g];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_set1_ps(xs * scale[g]),
                               acc[r]);
      zero_terms[r] += xs * scaled_zero[g] * x_sum[r * groups + g];
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) - zero_terms[r];
#elif defined(__AVX2__)
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dots[ROWS];
    for (int r = 0; r < ROWS; ++r) dots[r] = _mm256_setzero_si256();
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32));
      const __m256i lo = _mm256_and_si256(packed, nibble);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* xb = xq + r * k + b * kBlock;
        // u8 x s8 pairs sum to at most 2 * 15 * 127: no int16 saturation.
        const __m256i plo = _mm256_maddubs_epi16(
            lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));
        const __m256i phi = _mm256_maddubs_epi16(
            hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 32)));
        dots[r] = _mm256_add_epi32(dots[r],
                                   _mm256_madd_epi16(_mm256_add_epi16(plo, phi), ones));
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const float xs = x_scale[r * groups + g];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_set1_ps(xs * scale[g]),
                               acc[r]);
      zero_terms[r] += xs * scaled_zero[g] * x_sum[r * groups + g];
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
      for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b)
        for (int64_t j = 0; j < 32; ++j)
          dot += (w[b * 32 + j] & 0x0F) * xq[r * k + b * kBlock + j] +
                 (w[b * 32 + j] >> 4) * xq[r * k + b * kBlock + 32 + j];
      const float xs = x_scale[r * groups + g];
      total += xs * (scale[g] * static_cast<float>(dot) - scaled_zero[g] * x_sum[r * groups + g]);
    }
    out[r] = total;
  }
#endif
}

}  // namespace

// x [M, K] float32; packed [N, K / 2] uint8; scales and scaled_zeros [N, K / group] float32.
torch::Tensor int4_w4a8_matmul(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                               torch::Tensor scaled_zeros, int64_t group) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2);
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  const int64_t groups = k / group;
  TORCH_CHECK(group % kBlock == 0 && groups * group == k && packed.size(1) * 2 == k);
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
    const float scale = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t total = 0;
    for (int64_t j = 0; j < group; ++j) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(v[j] * inv));
      xqp[r * group + j] = static_cast<int8_t>(q);
      total += q;
    }
    xs[r] = scale;
    xsum[r] = static_cast<float>(total);
  }
  auto out = torch::empty({m, n}, torch::kFloat32);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = scaled_zeros.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = k / 2, blocks = group / kBlock;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* w = wp + o * row_bytes;
      const float* scale = sp + o * groups;
      const float* zero = zp + o * groups;
      float row_out[kRows];
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = std::min(kRows, m - r0);
        const int8_t* x = xqp + r0 * k;
        const float* s0 = xs + r0 * groups;
        const float* t0 = xsum + r0 * groups;
        switch (rows) {
          case 4: weight_row<4>(w, x, s0, t0, scale, zero, k, groups, blocks, row_out); break;
          case 3: weight_row<3>(w, x, s0, t0, scale, zero, k, groups, blocks, row_out); break;
          case 2: weight_row<2>(w, x, s0, t0, scale, zero, k, groups, blocks, row_out); break;
          default: weight_row<1>(w, x, s0, t0, scale, zero, k, groups, blocks, row_out);
        }
        for (int64_t r = 0; r < rows; ++r) op[(r0 + r) * n + o] = row_out[r];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_w4a8_matmul", &int4_w4a8_matmul, "4-bit weight x int8 activation matmul");
}
