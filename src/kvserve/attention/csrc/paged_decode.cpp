// Paged decode attention for CPU: one query token per sequence, keys and values read in place
// from the block pool (no gather copy), all query heads of a GQA group served by one pass over
// their shared KV head. Work is split over (sequence, kv head) pairs.
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

}  // namespace

// q: [B, Hq, D]; kv_cache: [2, Hkv, num_blocks, block_size, D]; block_tables: [B, W] int64;
// seq_lens: [B] int64. Keys at positions < seq_len - window are skipped when window > 0.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && kv_cache.scalar_type() == torch::kFloat,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous(),
              "paged_decode_attention: inputs must be contiguous");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2);
  const int64_t block_size = kv_cache.size(3), width = block_tables.size(1);
  TORCH_CHECK(head_dim % kLanes == 0, "paged_decode_attention: head_dim % 16 != 0");
  const int64_t group = num_heads / num_kv_heads;
  auto out = torch::zeros_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* k_base = kv_cache.data_ptr<float>();
  const float* v_base = k_base + num_kv_heads * num_blocks * block_size * head_dim;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.assign(group * n, 0.f);
      const float* qg = q_ptr + (b * num_heads + h * group) * head_dim;
      const int64_t* table = tables + b * width;
      const float* k_head = k_base + h * num_blocks * block_size * head_dim;
      const float* v_head = v_base + h * num_blocks * block_size * head_dim;
      for (int64_t t = first; t < len; ++t) {
        const float* k = k_head + (table[t / block_size] * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g)
          scores[g * n + (t - first)] = dot(qg + g * head_dim, k, head_dim) * fscale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        const float max = *std::max_element(s, s + n);
        float total = 0.f;
        for (int64_t i = 0; i < n; ++i) total += (s[i] = std::exp(s[i] - max));
        const float inv = 1.f / total;
        for (int64_t i = 0; i < n; ++i) s[i] *= inv;
      }
      float* og = out_ptr + (b * num_heads + h * group) * head_dim;
      for (int64_t t = first; t < len; ++t) {
        const float* v = v_head + (table[t / block_size] * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g)
          axpy(og + g * head_dim, scores[g * n + (t - first)], v, head_dim);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // No Python objects are touched: let other threads (the HTTP server) run meanwhile.
  m.def("paged_decode_attention", &paged_decode_attention,
        py::call_guard<py::gil_scoped_release>());
}
