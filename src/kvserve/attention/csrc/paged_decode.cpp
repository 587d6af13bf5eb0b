// Paged decode attention for CPU: one query token per sequence, keys and values read in place
// from the block pool (no gather copy), all query heads of a GQA group served by one pass over
// their shared KV head. Work is split over (sequence, kv head) pairs. float32 or bfloat16
// tensors; bfloat16 rows are widened to float32 as they are read, and all arithmetic is float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;

#ifdef __AVX512F__
inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += kLanes)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return _mm512_reduce_add_ps(acc);
}

inline void axpy(float* out, float p, const float* v, int64_t n) {
  const __m512 scale = _mm512_set1_ps(p);
  for (int64_t d = 0; d < n; d += kLanes)
    _mm512_storeu_ps(out + d, _mm512_fmadd_ps(scale, _mm512_loadu_ps(v + d),
                                              _mm512_loadu_ps(out + d)));
}
#else
// Explicit lanes let the compiler vectorize without fast-math.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0};
  for (int64_t d = 0; d < n; d += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += a[d + l] * b[d + l];
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

inline void axpy(float* out, float p, const float* v, int64_t n) {
  for (int64_t d = 0; d < n; ++d) out[d] += p * v[d];
}
#endif

// A row of n values as float32: the row itself, or its widening into `buf`.
inline const float* widen(const float* src, float*, int64_t) { return src; }

inline const float* widen(const at::BFloat16* src, float* buf, int64_t n) {
#ifdef __AVX512F__
  for (int64_t d = 0; d < n; d += kLanes) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
    _mm512_storeu_ps(buf + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw),
                                                                    16)));
  }
#else
  for (int64_t d = 0; d < n; ++d) buf[d] = static_cast<float>(src[d]);
#endif
  return buf;
}

inline void narrow(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }

inline void narrow(const float* src, at::BFloat16* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<at::BFloat16>(src[d]);
}

template <typename T>
void decode(const T* q_ptr, const T* k_base, const T* v_base, const int64_t* tables,
            const int64_t* lens, T* out_ptr, int64_t batch, int64_t num_heads,
            int64_t num_kv_heads, int64_t head_stride, int64_t block_size, int64_t width,
            int64_t head_dim, float scale, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, queries(group * head_dim), acc(group * head_dim), row(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.assign(group * n, 0.f);
      const float* qg = widen(q_ptr + (b * num_heads + h * group) * head_dim, queries.data(),
                              group * head_dim);
      const int64_t* table = tables + b * width;
      const T* k_head = k_base + h * head_stride;
      const T* v_head = v_base + h * head_stride;
      for (int64_t t = first; t < len; ++t) {
        const float* k = widen(
            k_head + (table[t / block_size] * block_size + t % block_size) * head_dim,
            row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g)
          scores[g * n + (t - first)] = dot(qg + g * head_dim, k, head_dim) * scale;
      }
      for (int64_t g = 0; g < group && n > 0; ++g) {
        float* s = scores.data() + g * n;
        const float max = *std::max_element(s, s + n);
        float total = 0.f;
        for (int64_t i = 0; i < n; ++i) total += (s[i] = std::exp(s[i] - max));
        const float inv = 1.f / total;
        for (int64_t i = 0; i < n; ++i) s[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = first; t < len; ++t) {
        const float* v = widen(
            v_head + (table[t / block_size] * block_size + t % block_size) * head_dim,
            row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g)
          axpy(acc.data() + g * head_dim, scores[g * n + (t - first)], v, head_dim);
      }
      narrow(acc.data(), out_ptr + (b * num_heads + h * group) * head_dim, group * head_dim);
    }
  });
}

}  // namespace

// q: [B, Hq, D]; kv_cache: [2, Hkv, num_blocks, block_size, D] of q's dtype; block_tables:
// [B, W] int64; seq_lens: [B] int64. Keys at positions < seq_len - window are skipped when
// window > 0.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     double scale, int64_t window) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) &&
                  kv_cache.scalar_type() == dtype,
              "paged_decode_attention: float32 or bfloat16 q and kv_cache of one dtype");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous(),
              "paged_decode_attention: inputs must be contiguous");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2);
  const int64_t block_size = kv_cache.size(3), width = block_tables.size(1);
  TORCH_CHECK(head_dim % kLanes == 0, "paged_decode_attention: head_dim % 16 != 0");
  const int64_t head_stride = num_blocks * block_size * head_dim;
  auto out = torch::empty_like(q);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  if (dtype == torch::kFloat) {
    const float* k = kv_cache.data_ptr<float>();
    decode(q.data_ptr<float>(), k, k + num_kv_heads * head_stride, tables, lens,
           out.data_ptr<float>(), batch, num_heads, num_kv_heads, head_stride, block_size,
           width, head_dim, fscale, window);
  } else {
    const at::BFloat16* k = kv_cache.data_ptr<at::BFloat16>();
    decode(q.data_ptr<at::BFloat16>(), k, k + num_kv_heads * head_stride, tables, lens,
           out.data_ptr<at::BFloat16>(), batch, num_heads, num_kv_heads, head_stride,
           block_size, width, head_dim, fscale, window);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // No Python objects are touched: let other threads (the HTTP server) run meanwhile.
  m.def("paged_decode_attention", &paged_decode_attention,
        py::call_guard<py::gil_scoped_release>());
}
