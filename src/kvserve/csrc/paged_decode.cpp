// Paged decode attention for CPU: one query token per sequence, keys and values read in place
// from the block pool (no gather copy), all query heads of a GQA group served by one pass over
// their shared KV head. Work is split over (sequence, kv head) pairs. float32 or bfloat16
// tensors; bfloat16 rows are widened to float32 as they are read, and all arithmetic is float32.
// For a decode-only step, `rotate_cache_and_decode` also applies the rotary embedding and
// writes the new keys and values, which would otherwise be a dozen small torch ops per layer.
#include "kvserve_cpu.h"

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

// A decode step's new tokens, for the fused path: unrotated q and k heads ([B, Hq + Hkv, D]),
// v heads ([B, Hkv, D]), each row a row stride after the last (the QKV projection's
// rows, where q, k and v lie side by side), each token's rotation as (cos, sin) pairs
// ([B, D / 2, 2]) and its cache slot. Attention then rotates them, writes k and v into the
// cache, and attends.
template <typename T>
struct NewTokens {
  const T* qk;
  const T* v;
  int64_t qk_row_stride;
  int64_t v_row_stride;
  const float* rotation;
  const int64_t* slots;
};

// Rotates n / 2 adjacent pairs of `src` by `rotation`, as complex numbers, into `dst`.
template <typename T>
inline void rotate(const T* src, const float* rotation, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 2) {
    const float a = static_cast<float>(src[i]), b = static_cast<float>(src[i + 1]);
    const float c = rotation[i], s = rotation[i + 1];
    dst[i] = a * c - b * s;
    dst[i + 1] = a * s + b * c;
  }
}

// Writes token b's rotated key and its value for KV head h into the head's pool at the
// token's slot; a padding row (slot -1) writes nothing. `row` is D floats of scratch.
template <typename T>
void cache_new_kv(const NewTokens<T>& fresh, int64_t b, int64_t h, int64_t num_heads,
                  int64_t head_dim, T* k_head, T* v_head, float* row) {
  const int64_t slot = fresh.slots[b];
  if (slot < 0) return;
  const T* heads = fresh.qk + b * fresh.qk_row_stride;
  rotate(heads + (num_heads + h) * head_dim, fresh.rotation + b * head_dim, row, head_dim);
  narrow(row, k_head + slot * head_dim, head_dim);
  const T* v_new = fresh.v + b * fresh.v_row_stride + h * head_dim;
  std::copy(v_new, v_new + head_dim, v_head + slot * head_dim);
}

template <typename T>
void decode(const T* q_ptr, const NewTokens<T>* fresh, T* k_base, T* v_base,
            const int64_t* tables, const int64_t* lens, T* out_ptr, int64_t batch,
            int64_t num_heads, int64_t num_kv_heads, int64_t head_stride, int64_t block_size,
            int64_t width, int64_t head_dim, float scale, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, queries(group * head_dim), acc(group * head_dim), row(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.assign(group * n, 0.f);
      T* k_head = k_base + h * head_stride;
      T* v_head = v_base + h * head_stride;
      const float* qg = queries.data();
      if (fresh != nullptr) {
        // This item alone writes head h of sequence b, so it reads its own write below.
        const T* heads = fresh->qk + b * fresh->qk_row_stride;
        const float* rotation = fresh->rotation + b * head_dim;
        for (int64_t g = 0; g < group; ++g)
          rotate(heads + (h * group + g) * head_dim, rotation, queries.data() + g * head_dim,
                 head_dim);
        cache_new_kv(*fresh, b, h, num_heads, head_dim, k_head, v_head, row.data());
      } else {
        qg = widen(q_ptr + (b * num_heads + h * group) * head_dim, queries.data(),
                   group * head_dim);
      }
      const int64_t* table = tables + b * width;
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

void check_inputs(const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& seq_lens, torch::ScalarType dtype, int64_t head_dim) {
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) &&
                  kv_cache.scalar_type() == dtype,
              "paged_decode_attention: float32 or bfloat16 q and kv_cache of one dtype");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous(),
              "paged_decode_attention: inputs must be contiguous");
  TORCH_CHECK(head_dim % kLanes == 0, "paged_decode_attention: head_dim % 16 != 0");
}

template <typename T>
void dispatch(const T* q, const NewTokens<T>* fresh, torch::Tensor& kv_cache,
              const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
              torch::Tensor& out, int64_t batch, int64_t num_heads, int64_t head_dim,
              double scale, int64_t window) {
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2);
  const int64_t block_size = kv_cache.size(3);
  const int64_t head_stride = num_blocks * block_size * head_dim;
  T* k = kv_cache.data_ptr<T>();
  decode(q, fresh, k, k + num_kv_heads * head_stride, block_tables.data_ptr<int64_t>(),
         seq_lens.data_ptr<int64_t>(), out.data_ptr<T>(), batch, num_heads, num_kv_heads,
         head_stride, block_size, block_tables.size(1), head_dim, static_cast<float>(scale),
         window);
}

// Rotates rows' q and k heads as the fused decode does, writing q to `q_out` ([B, Hq, D])
// and k and v into the cache at each row's slot.
template <typename T>
void rotate_rows(const NewTokens<T>& fresh, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, T* k_base, T* v_base, int64_t head_stride, T* q_out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(head_dim);
    for (int64_t b = begin; b < end; ++b) {
      const T* heads = fresh.qk + b * fresh.qk_row_stride;
      const float* rotation = fresh.rotation + b * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        rotate(heads + h * head_dim, rotation, row.data(), head_dim);
        narrow(row.data(), q_out + (b * num_heads + h) * head_dim, head_dim);
      }
      for (int64_t h = 0; h < num_kv_heads; ++h)
        cache_new_kv(fresh, b, h, num_heads, head_dim, k_base + h * head_stride,
                     v_base + h * head_stride, row.data());
    }
  });
}

}  // namespace

namespace kvserve {

// q: [B, Hq, D]; kv_cache: [2, Hkv, num_blocks, block_size, D] of q's dtype; block_tables:
// [B, W] int64; seq_lens: [B] int64. Keys at positions < seq_len - window are skipped when
// window > 0.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     double scale, int64_t window) {
  check_inputs(kv_cache, block_tables, seq_lens, q.scalar_type(), q.size(2));
  TORCH_CHECK(q.is_contiguous(), "paged_decode_attention: inputs must be contiguous");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat)
    dispatch<float>(q.data_ptr<float>(), nullptr, kv_cache, block_tables, seq_lens, out,
                    q.size(0), q.size(1), q.size(2), scale, window);
  else
    dispatch<at::BFloat16>(q.data_ptr<at::BFloat16>(), nullptr, kv_cache, block_tables,
                           seq_lens, out, q.size(0), q.size(1), q.size(2), scale, window);
  return out;
}

// The decode step's attention in one call: qk [B, Hq + Hkv, D] unrotated, v [B, Hkv, D]
// (each with contiguous heads; rows may be strided), rotation [B, D / 2, 2] float32
// (cos, sin), slot_mapping [B] int64; returns [B, Hq, D].
torch::Tensor rotate_cache_and_decode(torch::Tensor qk, torch::Tensor v, torch::Tensor rotation,
                                      torch::Tensor slot_mapping, torch::Tensor kv_cache,
                                      torch::Tensor block_tables, torch::Tensor seq_lens,
                                      double scale, int64_t window) {
  const int64_t batch = qk.size(0), head_dim = qk.size(2);
  const int64_t num_heads = qk.size(1) - kv_cache.size(1);
  check_inputs(kv_cache, block_tables, seq_lens, qk.scalar_type(), head_dim);
  const auto heads_contiguous = [&](const torch::Tensor& x) {
    return x.stride(2) == 1 && x.stride(1) == head_dim;
  };
  TORCH_CHECK(heads_contiguous(qk) && heads_contiguous(v) && rotation.is_contiguous() &&
                  slot_mapping.is_contiguous() && v.scalar_type() == qk.scalar_type() &&
                  rotation.scalar_type() == torch::kFloat,
              "rotate_cache_and_decode: qk and v of one dtype with contiguous heads, float32 "
              "rotation");
  auto out = torch::empty({batch, num_heads, head_dim}, qk.options());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* rot = rotation.data_ptr<float>();
  if (qk.scalar_type() == torch::kFloat) {
    const NewTokens<float> fresh{qk.data_ptr<float>(), v.data_ptr<float>(), qk.stride(0),
                                 v.stride(0), rot, slots};
    dispatch<float>(nullptr, &fresh, kv_cache, block_tables, seq_lens, out, batch, num_heads,
                    head_dim, scale, window);
  } else {
    const NewTokens<at::BFloat16> fresh{qk.data_ptr<at::BFloat16>(),
                                        v.data_ptr<at::BFloat16>(), qk.stride(0), v.stride(0),
                                        rot, slots};
    dispatch<at::BFloat16>(nullptr, &fresh, kv_cache, block_tables, seq_lens, out, batch,
                           num_heads, head_dim, scale, window);
  }
  return out;
}

// The rotation and cache write of rotate_cache_and_decode without the attention, for the
// prefill rows of a step: qk [N, Hq + Hkv, D], v [N, Hkv, D] (heads contiguous); returns the
// rotated queries [N, Hq, D].
torch::Tensor rotate_and_cache(torch::Tensor qk, torch::Tensor v, torch::Tensor rotation,
                               torch::Tensor slot_mapping, torch::Tensor kv_cache) {
  const int64_t rows = qk.size(0), head_dim = qk.size(2), num_kv_heads = kv_cache.size(1);
  const int64_t num_heads = qk.size(1) - num_kv_heads;
  TORCH_CHECK(qk.stride(2) == 1 && qk.stride(1) == head_dim && v.stride(2) == 1 &&
                  v.stride(1) == head_dim && rotation.is_contiguous() &&
                  slot_mapping.is_contiguous() && kv_cache.is_contiguous() &&
                  v.scalar_type() == qk.scalar_type() &&
                  kv_cache.scalar_type() == qk.scalar_type() &&
                  rotation.scalar_type() == torch::kFloat &&
                  (qk.scalar_type() == torch::kFloat || qk.scalar_type() == torch::kBFloat16),
              "rotate_and_cache: float32 or bfloat16 qk, v and kv_cache with contiguous heads, "
              "float32 rotation");
  auto q = torch::empty({rows, num_heads, head_dim}, qk.options());
  const int64_t head_stride = kv_cache.size(2) * kv_cache.size(3) * head_dim;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* rot = rotation.data_ptr<float>();
  if (qk.scalar_type() == torch::kFloat) {
    const NewTokens<float> fresh{qk.data_ptr<float>(), v.data_ptr<float>(), qk.stride(0),
                                 v.stride(0), rot, slots};
    float* k = kv_cache.data_ptr<float>();
    rotate_rows(fresh, rows, num_heads, num_kv_heads, head_dim, k,
                k + num_kv_heads * head_stride, head_stride, q.data_ptr<float>());
  } else {
    using T = at::BFloat16;
    const NewTokens<T> fresh{qk.data_ptr<T>(), v.data_ptr<T>(), qk.stride(0), v.stride(0), rot,
                             slots};
    T* k = kv_cache.data_ptr<T>();
    rotate_rows(fresh, rows, num_heads, num_kv_heads, head_dim, k,
                k + num_kv_heads * head_stride, head_stride, q.data_ptr<T>());
  }
  return q;
}

}  // namespace kvserve
