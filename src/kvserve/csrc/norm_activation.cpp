// The small per-token layers of a CPU step as one op each, with the contracts of their Triton
// counterparts (layers/triton_kernels.py): a decode step issues ~90 of them, and each costs
// about ten torch ops when written out. float32 or bfloat16 rows; float32 arithmetic, with
// bfloat16 results rounded where the torch ops they replace round them. AVX-512 lanes where the
// CPU has them for the dtype (the exponentials of simd.h: ~1e-7 relative error in float32,
// 7.5e-5 in bfloat16, a 26th of its own rounding), AVX2 ones for float32 rows, else scalar.
#include "kvserve_cpu.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float rounded(float v) { return static_cast<float>(static_cast<T>(v)); }

#ifdef __AVX512F__
using kvserve::simd::first_lanes;
using kvserve::simd::kBlock;
using kvserve::simd::Lanes;
#ifdef __AVX512BF16__
using kvserve::simd::join_pairs;
using kvserve::simd::round_pair;
using kvserve::simd::split_pairs;
#endif

template <typename T>
void add_rms_norm_row_simd(const T* x, const T* weight, T* residual, T* out, int64_t n,
                           float eps) {
  using L = Lanes<T>;
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kBlock) {
    const __mmask16 mask = first_lanes(n - i);
    __m512 v = L::load(x + i, mask);
    if (residual != nullptr) {
      v = L::round(_mm512_add_ps(v, L::load(residual + i, mask)));
      L::store(residual + i, v, mask);
    }
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 inv = _mm512_set1_ps(
      1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(n) + eps));
  const T* summed = residual != nullptr ? residual : x;
  for (int64_t i = 0; i < n; i += kBlock) {
    const __mmask16 mask = first_lanes(n - i);
    const __m512 normed = L::round(_mm512_mul_ps(L::load(summed + i, mask), inv));
    L::store(out + i, _mm512_mul_ps(L::load(weight + i, mask), normed), mask);
  }
}

#ifdef __AVX512BF16__
using Bf16 = at::BFloat16;

// The weight's float32 values in split_pairs' order, for add_rms_norm_row_pairs.
void split_weight(const Bf16* weight, int64_t n, float* pairs) {
  for (int64_t i = 0; i < n; i += 2 * kBlock) {
    __m512 even, odd;
    split_pairs(_mm512_loadu_si512(weight + i), even, odd);
    _mm512_storeu_ps(pairs + i, even);
    _mm512_storeu_ps(pairs + i + kBlock, odd);
  }
}

// add_rms_norm_row_simd for bfloat16 rows of a multiple of 32, in split_pairs' order, with the
// summed row kept in float32 in `row` for the second pass and the weight split once per call
// (`weight_pairs`): 11 vector ops per 16 elements where the in-order form takes 19, and
// 0.83-0.94x the time of a [2,048, 576] norm with a residual. The squares sum in another
// order, so an output may differ from the in-order form's in its last bit (8 of 2.4 M).
void add_rms_norm_row_pairs(const Bf16* x, const float* weight_pairs, Bf16* residual, Bf16* out,
                            int64_t n, float eps, float* row) {
  __m512 squares_even = _mm512_setzero_ps(), squares_odd = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 2 * kBlock) {
    __m512 even, odd;
    split_pairs(_mm512_loadu_si512(x + i), even, odd);
    if (residual != nullptr) {  // the residual add happens in bfloat16, as `x + residual` does
      __m512 add_even, add_odd;
      split_pairs(_mm512_loadu_si512(residual + i), add_even, add_odd);
      const __m512i summed =
          join_pairs(_mm512_add_ps(even, add_even), _mm512_add_ps(odd, add_odd));
      _mm512_storeu_si512(residual + i, summed);
      split_pairs(summed, even, odd);
    }
    _mm512_storeu_ps(row + i, even);
    _mm512_storeu_ps(row + i + kBlock, odd);
    squares_even = _mm512_fmadd_ps(even, even, squares_even);
    squares_odd = _mm512_fmadd_ps(odd, odd, squares_odd);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(
      _mm512_reduce_add_ps(_mm512_add_ps(squares_even, squares_odd)) / static_cast<float>(n) +
      eps));
  for (int64_t i = 0; i < n; i += 2 * kBlock) {
    __m512 even = _mm512_mul_ps(_mm512_loadu_ps(row + i), inv);
    __m512 odd = _mm512_mul_ps(_mm512_loadu_ps(row + i + kBlock), inv);
    round_pair(even, odd);  // the normed row rounded to bfloat16, as `normed.to(dtype)` rounds it
    _mm512_storeu_si512(out + i,
                        join_pairs(_mm512_mul_ps(even, _mm512_loadu_ps(weight_pairs + i)),
                                   _mm512_mul_ps(odd, _mm512_loadu_ps(weight_pairs + i + kBlock))));
  }
}
#endif

template <typename T>
void silu_and_mul_row_simd(const T* gate, const T* up, T* out, int64_t n) {
  using L = Lanes<T>;
  for (int64_t i = 0; i < n; i += kBlock) {
    const __mmask16 mask = first_lanes(n - i);
    L::store(out + i,
             kvserve::simd::silu_and_mul<T>(L::load(gate + i, mask), L::load(up + i, mask)),
             mask);
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// add_rms_norm_row_simd in 8 lanes for float32 rows: on a 2-core AVX2 EPYC, [1, 8,192] with a
// residual took 6.2 us a call where the scalar loop, one chain of adds, took 13.6.
void add_rms_norm_row_avx2(const float* x, const float* weight, float* residual, float* out,
                           int64_t n, float eps) {
  __m256 squares = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i mask = kvserve::simd::first_avx2_lanes(n - i);
    __m256 v = _mm256_maskload_ps(x + i, mask);
    if (residual != nullptr) {
      v = _mm256_add_ps(v, _mm256_maskload_ps(residual + i, mask));
      kvserve::simd::store_first_lanes(residual + i, v, n - i);
    }
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  const __m256 inv = _mm256_set1_ps(
      1.f / std::sqrt(kvserve::simd::sum_of(squares) / static_cast<float>(n) + eps));
  const float* summed = residual != nullptr ? residual : x;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i mask = kvserve::simd::first_avx2_lanes(n - i);
    const __m256 normed = _mm256_mul_ps(_mm256_maskload_ps(summed + i, mask), inv);
    kvserve::simd::store_first_lanes(
        out + i, _mm256_mul_ps(_mm256_maskload_ps(weight + i, mask), normed), n - i);
  }
}

// float32 rows 8 lanes at a time with simd.h's exponential: on a 2-core AVX2 EPYC, a 1B
// model's 8,192 channels took 10 us where the scalar loop (std::exp) took 52.5.
void silu_and_mul_row_avx2(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i mask = kvserve::simd::first_avx2_lanes(n - i);
    const __m256 g = _mm256_maskload_ps(gate + i, mask);
    const __m256 e = kvserve::simd::exp(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
    kvserve::simd::store_first_lanes(out + i, _mm256_mul_ps(silu, _mm256_maskload_ps(up + i, mask)),
                                     n - i);
  }
}
#endif

template <typename T>
void add_rms_norm_row(const T* x, const T* weight, T* residual, T* out, int64_t n, float eps,
                      std::vector<float>& row) {
#ifdef __AVX512F__
  if constexpr (kvserve::simd::kHasLanes<T>)
    return add_rms_norm_row_simd(x, weight, residual, out, n, eps);
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>)
    return add_rms_norm_row_avx2(x, weight, residual, out, n, eps);
#endif
  float squares = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    float v = static_cast<float>(x[i]);
    if (residual != nullptr) {  // the residual add happens in T, as `x + residual` does
      v = rounded<T>(v + static_cast<float>(residual[i]));
      residual[i] = static_cast<T>(v);
    }
    row[i] = v;
    squares += v * v;
  }
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<T>(static_cast<float>(weight[i]) * rounded<T>(row[i] * inv));
}

template <typename T>
void silu_and_mul_row(const T* gate, const T* up, T* out, int64_t n) {
#ifdef __AVX512F__
  if constexpr (kvserve::simd::kHasLanes<T>) return silu_and_mul_row_simd(gate, up, out, n);
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) return silu_and_mul_row_avx2(gate, up, out, n);
#endif
  for (int64_t i = 0; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    out[i] = static_cast<T>(rounded<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
  }
}

template <typename T>
void add_rms_norm_rows(const T* x, const T* weight, T* residual, T* out, int64_t rows,
                       int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, Bf16>) {
      if (n % (2 * kBlock) == 0) {
        std::vector<float> weight_pairs(n);
        split_weight(weight, n, weight_pairs.data());
        for (int64_t r = begin; r < end; ++r)
          add_rms_norm_row_pairs(x + r * n, weight_pairs.data(),
                                 residual ? residual + r * n : nullptr, out + r * n, n, eps,
                                 row.data());
        return;
      }
    }
#endif
    for (int64_t r = begin; r < end; ++r)
      add_rms_norm_row(x + r * n, weight, residual ? residual + r * n : nullptr, out + r * n, n,
                       eps, row);
  });
}

// Head h of each row of heads (rows `row_stride` apart, heads `head_stride`, head_dim
// contiguous channels) normed by q_weight below num_q_heads and by k_weight from there, into
// out [rows, heads, head_dim].
template <typename T>
void rms_norm_heads_of(const T* heads, int64_t row_stride, int64_t head_stride, const T* q_weight,
                       const T* k_weight, T* out, int64_t rows, int64_t num_heads,
                       int64_t num_q_heads, int64_t head_dim, float eps) {
  at::parallel_for(0, rows * num_heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / num_heads, h = i % num_heads;
      add_rms_norm_row(heads + r * row_stride + h * head_stride,
                       h < num_q_heads ? q_weight : k_weight, static_cast<T*>(nullptr),
                       out + i * head_dim, head_dim, eps, row);
    }
  });
}

template <typename T>
void silu_and_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      silu_and_mul_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, out + r * n, n);
  });
}

void check(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              what, ": contiguous 2-D float32 or bfloat16 rows");
}

}  // namespace

namespace kvserve {

// RMSNorm of x's rows, after adding `residual` to x in place of residual when one is given.
at::Tensor add_rms_norm(at::Tensor x, at::Tensor weight, double eps,
                        c10::optional<at::Tensor> residual) {
  check(x, "add_rms_norm");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "add_rms_norm: weight of x's dtype and row size");
  if (residual) {
    check(*residual, "add_rms_norm");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "add_rms_norm: residual of x's shape and dtype");
  }
  auto out = at::empty_like(x);
  const float feps = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat)
    add_rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(),
                      residual ? residual->data_ptr<float>() : nullptr, out.data_ptr<float>(),
                      x.size(0), x.size(1), feps);
  else
    add_rms_norm_rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                      residual ? residual->data_ptr<at::BFloat16>() : nullptr,
                      out.data_ptr<at::BFloat16>(), x.size(0), x.size(1), feps);
  return out;
}

// Queries then keys [rows, Hq + Hk, head_dim] (a view with contiguous channels, such as the
// leading heads of a QKV projection) -> each head's row RMS-normed by q_weight (the first
// num_q_heads) or k_weight, into a new contiguous tensor: Qwen3's per-head norms as one call,
// the rows add_rms_norm would norm and the same bits.
at::Tensor rms_norm_heads(const at::Tensor& heads, int64_t num_q_heads,
                          const at::Tensor& q_weight, const at::Tensor& k_weight,
                          double eps) {
  TORCH_CHECK(heads.dim() == 3 && heads.stride(2) == 1 &&
                  (heads.scalar_type() == at::kFloat ||
                   heads.scalar_type() == at::kBFloat16),
              "rms_norm_heads: float32 or bfloat16 heads [rows, heads, head_dim] with "
              "contiguous channels");
  const int64_t head_dim = heads.size(2);
  for (const at::Tensor* weight : {&q_weight, &k_weight})
    TORCH_CHECK(weight->scalar_type() == heads.scalar_type() && weight->is_contiguous() &&
                    weight->numel() == head_dim,
                "rms_norm_heads: weights of the heads' dtype and head_dim");
  TORCH_CHECK(num_q_heads >= 0 && num_q_heads <= heads.size(1), "rms_norm_heads: ", num_q_heads,
              " query heads of ", heads.size(1));
  auto out = at::empty(heads.sizes(), heads.options());
  const auto norm = [&](auto type_tag) {
    using T = decltype(type_tag);
    rms_norm_heads_of(heads.data_ptr<T>(), heads.stride(0), heads.stride(1),
                      q_weight.data_ptr<T>(), k_weight.data_ptr<T>(), out.data_ptr<T>(),
                      heads.size(0), heads.size(1), num_q_heads, head_dim,
                      static_cast<float>(eps));
  };
  if (heads.scalar_type() == at::kFloat)
    norm(float{});
  else
    norm(at::BFloat16{});
  return out;
}

// silu(gate) * up for rows laid out as [gate | up].
at::Tensor silu_and_mul(at::Tensor gate_up) {
  check(gate_up, "silu_and_mul");
  const int64_t n = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), n}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat)
    silu_and_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), gate_up.size(0), n);
  else
    silu_and_mul_rows(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                      gate_up.size(0), n);
  return out;
}

}  // namespace kvserve
