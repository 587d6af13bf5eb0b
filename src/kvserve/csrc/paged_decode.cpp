// Paged decode attention for CPU: one query token per sequence, keys and values read in place
// from the block pool (no gather copy), all query heads of a GQA group served by one pass over
// their shared KV head. Work is split over (sequence, kv head, 128-key partition) units, given
// to the threads by key count, and split heads merge their partitions' softmax after. Keys
// are scored 16 at a time (16 register accumulators and one transposing sum), the softmax
// is vectorized, and values accumulate per 16-key tile. float32 or bfloat16 tensors;
// bfloat16 rows are widened to float32 as they are read, and all arithmetic is float32.
// For a decode-only step, `rotate_cache_and_decode` also applies the rotary embedding and
// writes the new keys and values, which would otherwise be a dozen small torch ops per layer.
#include "kvserve_cpu.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kTile = 16;  // keys scored, and values added, together
// Tokens per unit of work. A sequence's context splits at fixed offsets, so the threads share
// long contexts and a batch of one, and a sequence's result never depends on the batch.
constexpr int64_t kPartition = 128;

// Row src of n values as float32 in dst.
inline void widen(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }

inline void widen(const at::BFloat16* src, float* dst, int64_t n) {
#ifdef __AVX512F__
  for (int64_t d = 0; d < n; d += kLanes) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
    _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw),
                                                                    16)));
  }
#else
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
#endif
}

#ifdef __AVX512F__
// Lane t of the result: the sum of v[t]'s lanes (a transposing tree of 45 instructions instead
// of 16 horizontal sums).
inline __m512 sum_lanes(const __m512 (&v)[kTile]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xdd));
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define KVSERVE_AVX2_ATTENTION 1
constexpr int64_t kHalf = 8;  // lanes of a 256-bit register of float32

// Lane t of the result: the sum of v[t]'s lanes (two rounds of hadd and one cross-lane add).
inline __m256 sum_lanes(const __m256 (&v)[kHalf]) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

namespace simd = kvserve::simd;
#endif

// The largest of n scores.
inline float max_of(const float* s, int64_t n) {
#ifdef __AVX512F__
  __m512 max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += kLanes)
    max = _mm512_max_ps(max, _mm512_mask_loadu_ps(max, kvserve::simd::first_lanes(n - i), s + i));
  return _mm512_reduce_max_ps(max);
#elif defined(KVSERVE_AVX2_ATTENTION)
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 max = lowest;
  for (int64_t i = 0; i < n; i += kHalf) {
    const __m256i mask = simd::first_avx2_lanes(n - i);
    max = _mm256_max_ps(max, _mm256_blendv_ps(lowest, _mm256_maskload_ps(s + i, mask),
                                              _mm256_castsi256_ps(mask)));
  }
  alignas(32) float lanes[kHalf];
  _mm256_store_ps(lanes, max);
  return *std::max_element(lanes, lanes + kHalf);
#else
  return *std::max_element(s, s + n);
#endif
}

// s[i] = exp(s[i] - max) for n scores; returns their sum.
inline float exp_and_sum(float* s, int64_t n, float max) {
#ifdef __AVX512F__
  __m512 total = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(max);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = kvserve::simd::first_lanes(n - i);
    const __m512 e = kvserve::simd::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + i), shift));
    _mm512_mask_storeu_ps(s + i, mask, e);
    total = _mm512_mask_add_ps(total, mask, total, e);
  }
  return _mm512_reduce_add_ps(total);
#elif defined(KVSERVE_AVX2_ATTENTION)
  __m256 total = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(max);
  for (int64_t i = 0; i < n; i += kHalf) {
    const __m256i mask = simd::first_avx2_lanes(n - i);
    const __m256 e =
        _mm256_and_ps(simd::exp(_mm256_sub_ps(_mm256_maskload_ps(s + i, mask), shift)),
                      _mm256_castsi256_ps(mask));
    simd::store_first_lanes(s + i, e, n - i);
    total = _mm256_add_ps(total, e);
  }
  return simd::sum_of(total);
#else
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += (s[i] = std::exp(s[i] - max));
  return total;
#endif
}

// s[i] = cap * tanh(s[i] / cap) for n scores: Gemma 2's attention logit softcapping.
inline void cap_scores(float* s, int64_t n, float cap) {
#ifdef __AVX512F__
  const __m512 c = _mm512_set1_ps(cap), inverse = _mm512_set1_ps(1.f / cap);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = kvserve::simd::first_lanes(n - i);
    const __m512 x = _mm512_maskz_loadu_ps(mask, s + i);
    _mm512_mask_storeu_ps(s + i, mask,
                          _mm512_mul_ps(c, kvserve::simd::tanh(_mm512_mul_ps(x, inverse))));
  }
#elif defined(KVSERVE_AVX2_ATTENTION)
  const __m256 c = _mm256_set1_ps(cap), inverse = _mm256_set1_ps(1.f / cap);
  for (int64_t i = 0; i < n; i += kHalf) {
    const __m256 x = _mm256_maskload_ps(s + i, simd::first_avx2_lanes(n - i));
    simd::store_first_lanes(s + i, _mm256_mul_ps(c, simd::tanh(_mm256_mul_ps(x, inverse))),
                            n - i);
  }
#else
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
#endif
}

// The products of a tile of up to kTile keys, or values, given as row pointers into the pool
// (rows past `count` point at zeros), with every query head of a GQA group: scores[g][t] =
// scale * q_g . key t, and out_g += sum_t p[g][t] * value t. Rows and stride are in elements.
//
// WidenedTiles: float32 rows in place, bfloat16 ones widened once per tile; float32 products
// (any CPU, either dtype).
template <typename T>
struct WidenedTiles {
  using Query = float;

  static void prepare(const float* queries, int64_t n, float* out) {
    std::copy(queries, queries + n, out);
  }

  static void score(const float* q, int64_t group, const T* const* rows, int64_t count,
                    int64_t head_dim, float scale, float* scores, int64_t stride,
                    std::vector<float>& tile) {
    const float* const* wide = widen_tile(rows, count, head_dim, tile);
    for (int64_t g = 0; g < group; ++g)
      score_tile(q + g * head_dim, wide, count, head_dim, scale, scores + g * stride);
  }

  static void add_values(const float* probs, int64_t stride, int64_t group, const T* const* rows,
                         int64_t count, int64_t head_dim, float* out, std::vector<float>& tile) {
    const float* const* wide = widen_tile(rows, count, head_dim, tile);
    for (int64_t g = 0; g < group; ++g) {
      const float* p = probs + g * stride;
      float* acc = out + g * head_dim;
      int64_t d = 0;
      for (; d + kSpan <= head_dim; d += kSpan)
        add_span<kSpan / kLanes>(p, wide, count, d, acc + d);
      for (; d < head_dim; d += kLanes) add_span<1>(p, wide, count, d, acc + d);
    }
  }

  static void finish(float*, int64_t, int64_t) {}

 private:
  // Output dimensions summed side by side over a tile's rows: 64, as independent chains of
  // multiply-adds, one register each, where 16 at a time (one AVX-512 chain, two AVX2 ones)
  // waited on each multiply-add's latency.
  static constexpr int64_t kSpan = 64;

  // acc[0, SPANS * kLanes) += sum over the tile's rows t of p[t] * rows[t][d, ...), each
  // output dimension summed in row order, as one chain at a time sums it.
  template <int SPANS>
  static void add_span(const float* p, const float* const* rows, int64_t count, int64_t d,
                       float* acc) {
#ifdef __AVX512F__
    __m512 a[SPANS];
    for (int i = 0; i < SPANS; ++i) a[i] = _mm512_loadu_ps(acc + i * kLanes);
    for (int64_t t = 0; t < count; ++t) {
      const __m512 pt = _mm512_set1_ps(p[t]);
      for (int i = 0; i < SPANS; ++i)
        a[i] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(rows[t] + d + i * kLanes), a[i]);
    }
    for (int i = 0; i < SPANS; ++i) _mm512_storeu_ps(acc + i * kLanes, a[i]);
#elif defined(KVSERVE_AVX2_ATTENTION)
    __m256 a[2 * SPANS];
    for (int i = 0; i < 2 * SPANS; ++i) a[i] = _mm256_loadu_ps(acc + i * kHalf);
    for (int64_t t = 0; t < count; ++t) {
      const __m256 pt = _mm256_set1_ps(p[t]);
      for (int i = 0; i < 2 * SPANS; ++i)
        a[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(rows[t] + d + i * kHalf), a[i]);
    }
    for (int i = 0; i < 2 * SPANS; ++i) _mm256_storeu_ps(acc + i * kHalf, a[i]);
#else
    for (int64_t t = 0; t < count; ++t)
      for (int64_t l = 0; l < SPANS * kLanes; ++l) acc[l] += p[t] * rows[t][d + l];
#endif
  }

  // The tile's rows as float32: float32 rows in place, others widened into `tile`.
  static const float* const* widen_tile(const T* const* rows, int64_t count, int64_t head_dim,
                                        std::vector<float>& tile) {
    thread_local const float* wide[kTile];
    if constexpr (std::is_same_v<T, float>) return rows;
    tile.resize(kTile * head_dim);
    for (int64_t t = 0; t < kTile; ++t) {
      wide[t] = tile.data() + t * head_dim;
      widen(rows[t], tile.data() + t * head_dim, head_dim);
    }
    return wide;
  }

  // out[t] = scale * q . row t for the tile's `count` rows.
  static void score_tile(const float* q, const float* const* rows, int64_t count,
                         int64_t head_dim, float scale, float* out) {
#ifdef __AVX512F__
    __m512 acc[kTile];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += kLanes) {
      const __m512 qd = _mm512_loadu_ps(q + d);
      for (int64_t t = 0; t < kTile; ++t)
        acc[t] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(rows[t] + d), acc[t]);
    }
    _mm512_mask_storeu_ps(out, kvserve::simd::first_lanes(count),
                          _mm512_mul_ps(sum_lanes(acc), _mm512_set1_ps(scale)));
#elif defined(KVSERVE_AVX2_ATTENTION)
    for (int64_t first = 0; first < count; first += kHalf) {  // 8 keys at a time
      __m256 acc[kHalf];
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += kHalf) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int64_t t = 0; t < kHalf; ++t)
          acc[t] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(rows[first + t] + d), acc[t]);
      }
      simd::store_first_lanes(out + first, _mm256_mul_ps(sum_lanes(acc), _mm256_set1_ps(scale)),
                              count - first);
    }
#else
    for (int64_t t = 0; t < count; ++t) {
      float acc[kLanes] = {0};  // explicit lanes let the compiler vectorize without fast-math
      for (int64_t d = 0; d < head_dim; d += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) acc[l] += q[d + l] * rows[t][d + l];
      float sum = 0.f;
      for (const float a : acc) sum += a;
      out[t] = sum * scale;
    }
#endif
  }
};

#ifdef __AVX512BF16__
// BF16PairTiles: bfloat16 rows read in place by VDPBF16PS, the queries and probabilities
// rounded to bfloat16 (as a bfloat16 matmul of the reference rounds them), float32 sums; no
// widening, a third of the instructions. Values are interleaved in token pairs per 128-bit
// lane, so the outputs accumulate with their head dimensions permuted until `finish`.
struct BF16PairTiles {
  using T = at::BFloat16;
  using Query = T;
  static constexpr int64_t kPair = 32;  // head dimensions per 512-bit row of bfloat16
  // Query heads whose sums run side by side in add_values: with 64 head dimensions, 4 heads
  // x 2 runs x 2 halves are 16 chains of multiply-adds.
  static constexpr int64_t kMaxGroup = 4;

  // fn(std::integral_constant<int, heads>{}), for 1 to kMaxGroup heads.
  template <typename Fn>
  static void with_heads(int64_t heads, const Fn& fn) {
    switch (heads) {
      case 1: return fn(std::integral_constant<int, 1>{});
      case 2: return fn(std::integral_constant<int, 2>{});
      case 3: return fn(std::integral_constant<int, 3>{});
      default: return fn(std::integral_constant<int, 4>{});
    }
  }

  // acc[g * head_dim + first ...] (RUNS runs of 32 head dimensions) += the sum over token
  // pairs of both tokens' values times their probabilities: rows t and t + 1 interleaved in
  // registers, so 32-bit lane j of a pair vector holds both tokens' value of one dimension
  // (in unpack order, which `finish` undoes), and each (head, run, half) sums its pairs in
  // order in a register of its own.
  template <int RUNS, int HEADS>
  static void add_runs(const T (*p16)[kTile], const T* const* rows, int64_t pairs,
                       int64_t head_dim, float* acc, int64_t first) {
    __m512 lo[HEADS][RUNS], hi[HEADS][RUNS];
    for (int g = 0; g < HEADS; ++g)
      for (int c = 0; c < RUNS; ++c) {
        lo[g][c] = _mm512_loadu_ps(acc + g * head_dim + first + c * kPair);
        hi[g][c] = _mm512_loadu_ps(acc + g * head_dim + first + c * kPair + kLanes);
      }
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh both[HEADS];
      for (int g = 0; g < HEADS; ++g)
        both[g] = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(p16[g])[p]);
      for (int c = 0; c < RUNS; ++c) {
        const __m512i a = _mm512_loadu_si512(rows[2 * p] + first + c * kPair);
        const __m512i b = _mm512_loadu_si512(rows[2 * p + 1] + first + c * kPair);
        const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(a, b);
        const __m512bh high = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < HEADS; ++g) {
          lo[g][c] = _mm512_dpbf16_ps(lo[g][c], both[g], low);
          hi[g][c] = _mm512_dpbf16_ps(hi[g][c], both[g], high);
        }
      }
    }
    for (int g = 0; g < HEADS; ++g)
      for (int c = 0; c < RUNS; ++c) {
        _mm512_storeu_ps(acc + g * head_dim + first + c * kPair, lo[g][c]);
        _mm512_storeu_ps(acc + g * head_dim + first + c * kPair + kLanes, hi[g][c]);
      }
  }

  static void prepare(const float* queries, int64_t n, T* out) {
    for (int64_t i = 0; i < n; i += kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(queries + i)));
  }

  static void score(const T* q, int64_t group, const T* const* rows, int64_t count,
                    int64_t head_dim, float scale, float* scores, int64_t stride,
                    std::vector<float>&) {
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc[kTile];
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += kPair) {
        const __m512bh qd = (__m512bh)_mm512_loadu_si512(q + g * head_dim + d);
        for (int64_t t = 0; t < kTile; ++t)
          acc[t] = _mm512_dpbf16_ps(acc[t], qd, (__m512bh)_mm512_loadu_si512(rows[t] + d));
      }
      _mm512_mask_storeu_ps(scores + g * stride, kvserve::simd::first_lanes(count),
                            _mm512_mul_ps(sum_lanes(acc), _mm512_set1_ps(scale)));
    }
  }

  static void add_values(const float* probs, int64_t stride, int64_t group, const T* const* rows,
                         int64_t count, int64_t head_dim, float* out, std::vector<float>&) {
    // Each head's probabilities as bfloat16, two tokens to a 32-bit lane.
    alignas(64) T p16[kMaxGroup][kTile];
    const __mmask16 mask = kvserve::simd::first_lanes(count);
    for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
      const int64_t heads = std::min(kMaxGroup, group - g0);
      for (int64_t g = 0; g < heads; ++g)
        _mm256_store_si256(reinterpret_cast<__m256i*>(p16[g]),
                           (__m256i)_mm512_cvtneps_pbh(
                               _mm512_maskz_loadu_ps(mask, probs + (g0 + g) * stride)));
      const int64_t pairs = (count + 1) / 2;
      float* acc = out + g0 * head_dim;
      with_heads(heads, [&](auto h) {
        int64_t c = 0;
        for (; c + 2 * kPair <= head_dim; c += 2 * kPair)
          add_runs<2, h>(p16, rows, pairs, head_dim, acc, c);
        if (c < head_dim) add_runs<1, h>(p16, rows, pairs, head_dim, acc, c);
      });
    }
  }

  // Each 32-dimension run of `out` from unpack order (lane j of the low half: dimension
  // 8 * (j / 4) + j % 4; of the high half: 4 more) to natural order.
  static void finish(float* out, int64_t group, int64_t head_dim) {
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11,
                                            10, 9, 8);
    for (int64_t r = 0; r < group * head_dim; r += kPair) {
      const __m512 low = _mm512_loadu_ps(out + r), high = _mm512_loadu_ps(out + r + kLanes);
      _mm512_storeu_ps(out + r, _mm512_permutex2var_ps(low, first, high));
      _mm512_storeu_ps(out + r + kLanes, _mm512_permutex2var_ps(low, second, high));
    }
  }
};
#endif

inline void narrow(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }

inline void narrow(const float* src, at::BFloat16* dst, int64_t n) {
#ifdef __AVX512BF16__
  using L = kvserve::simd::Lanes<at::BFloat16>;
  for (int64_t d = 0; d < n; d += kLanes) {
    const __mmask16 mask = kvserve::simd::first_lanes(n - d);
    L::store(dst + d, _mm512_maskz_loadu_ps(mask, src + d), mask);
  }
#else
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<at::BFloat16>(src[d]);
#endif
}

// A decode step's new tokens, for the fused path: unrotated q and k heads ([B, Hq + Hkv, D]),
// v heads ([B, Hkv, D]), each row a row stride after the last (the QKV projection's
// rows, where q, k and v lie side by side), each token's rotation as (cos, sin) pairs
// ([B, D / 2, 2]) and its cache slot. Attention then rotates them, writes k and v into the
// cache, and attends. When rows are successive tokens of one sequence (the verified drafts of
// speculative decoding), each row attends to the keys of the rows before it: all rows are
// then `written` before any attends.
template <typename T>
struct NewTokens {
  const T* qk;
  const T* v;
  int64_t qk_row_stride;
  int64_t v_row_stride;
  const float* rotation;
  const int64_t* slots;
  bool written;
};

// Rotates n / 2 adjacent pairs of `src` by `rotation`, as complex numbers, into `dst`: each
// pair (a, b) by (c, s) to (a c - b s, a s + b c), 8 pairs a vector where the CPU has lanes
// for T (a 2,048-token prefill's rotary and cache writes: 10.5 -> 8.7 ms on a 2-core Xeon).
template <typename T>
inline void rotate(const T* src, const float* rotation, float* dst, int64_t n) {
#ifdef __AVX512F__
  if constexpr (kvserve::simd::kHasLanes<T>) {
    using L = kvserve::simd::Lanes<T>;
    for (int64_t i = 0; i < n; i += kLanes) {
      const __mmask16 mask = kvserve::simd::first_lanes(n - i);
      const __m512 v = L::load(src + i, mask), r = _mm512_maskz_loadu_ps(mask, rotation + i);
      const __m512 swapped = _mm512_permute_ps(v, 0xb1);  // (b, a)
      _mm512_mask_storeu_ps(dst + i, mask,
                            _mm512_fmaddsub_ps(v, _mm512_moveldup_ps(r),
                                               _mm512_mul_ps(swapped, _mm512_movehdup_ps(r))));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; i += 2) {
    const float a = static_cast<float>(src[i]), b = static_cast<float>(src[i + 1]);
    const float c = rotation[i], s = rotation[i + 1];
    dst[i] = a * c - b * s;
    dst[i + 1] = a * s + b * c;
  }
}

#ifdef __AVX512BF16__
// rotate() then narrow() for bfloat16 rows of a multiple of 32 values: each 32 as their even
// (a) and odd (b) halves (simd::split_pairs) against the rotation's cos and sin, deinterleaved
// to match, with the same products and roundings. 10 vector ops per 32 values where the
// in-order form takes 16: a 2,048-token prefill's rotary and cache writes 0.48-0.70x
// the time, the same bits.
inline void rotate_pairs(const at::BFloat16* src, const float* rotation, at::BFloat16* dst,
                         int64_t n) {
  const __m512i cos_lanes = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6,
                                             4, 2, 0);
  const __m512i sin_lanes = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7,
                                             5, 3, 1);
  for (int64_t i = 0; i < n; i += 2 * kLanes) {
    __m512 a, b;
    kvserve::simd::split_pairs(_mm512_loadu_si512(src + i), a, b);
    const __m512 low = _mm512_loadu_ps(rotation + i);
    const __m512 high = _mm512_loadu_ps(rotation + i + kLanes);
    const __m512 c = _mm512_permutex2var_ps(low, cos_lanes, high);
    const __m512 s = _mm512_permutex2var_ps(low, sin_lanes, high);
    _mm512_storeu_si512(dst + i,
                        kvserve::simd::join_pairs(_mm512_fmsub_ps(a, c, _mm512_mul_ps(b, s)),
                                                  _mm512_fmadd_ps(b, c, _mm512_mul_ps(a, s))));
  }
}
#endif

// rotate() of src's n values, narrowed to T in dst. `row` is n floats of scratch.
template <typename T>
inline void rotate_into(const T* src, const float* rotation, T* dst, int64_t n, float* row) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (n % (2 * kLanes) == 0) return rotate_pairs(src, rotation, dst, n);
  }
#endif
  rotate(src, rotation, row, n);
  narrow(row, dst, n);
}

// Writes token b's rotated key and its value for KV head h into the head's pool at the
// token's slot; a padding row (slot -1) writes nothing. `row` is D floats of scratch.
template <typename T>
void cache_new_kv(const NewTokens<T>& fresh, int64_t b, int64_t h, int64_t num_heads,
                  int64_t head_dim, T* k_head, T* v_head, float* row) {
  const int64_t slot = fresh.slots[b];
  if (slot < 0) return;
  const T* heads = fresh.qk + b * fresh.qk_row_stride;
  rotate_into(heads + (num_heads + h) * head_dim, fresh.rotation + b * head_dim,
              k_head + slot * head_dim, head_dim, row);
  const T* v_new = fresh.v + b * fresh.v_row_stride + h * head_dim;
  std::copy(v_new, v_new + head_dim, v_head + slot * head_dim);
}

// A unit of work: the keys [begin, end) of sequence `seq` for KV head `head`. A sequence
// whose context spans several units has them merged after; `partial` is then the unit's
// index among those, else -1.
struct Unit {
  int64_t seq, head, begin, end, partial;
};

// A sequence's head whose keys span several units: its outputs merge from partials
// [first_partial, first_partial + parts).
struct Split {
  int64_t seq, head, first_partial, parts;
};

// fn(unit) for every unit, the threads taking contiguous runs of about equal key counts.
template <typename F>
void for_each_unit_balanced(const std::vector<Unit>& units, F&& fn) {
  std::vector<int64_t> before(units.size() + 1, 0);  // keys (plus a unit's overhead) before i
  for (size_t i = 0; i < units.size(); ++i)
    before[i + 1] = before[i] + units[i].end - units[i].begin + kTile;
  const int64_t total = before.back();
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), units.size());
  at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t end_thread) {
    // Unit i belongs to thread floor(before[i] * threads / total).
    const auto start_of = [&](int64_t thread) {
      return std::lower_bound(before.begin(), before.end() - 1, thread,
                              [&](int64_t keys, int64_t t) { return keys * threads < t * total; }) -
             before.begin();
    };
    for (int64_t i = start_of(first_thread); i < start_of(end_thread); ++i) fn(units[i]);
  });
}

// Attention of each unit's query heads over its keys: whole heads' outputs to out_ptr,
// partial ones' softmax max, sum and unnormalized outputs to `partials`.
template <typename T, typename Tiles>
void attend(const std::vector<Unit>& units, const T* q_ptr, const NewTokens<T>* fresh,
            T* k_base, T* v_base, const int64_t* tables, const int64_t* lens, T* out_ptr,
            int64_t num_heads, int64_t group, int64_t head_stride, int64_t block_size,
            int64_t width, int64_t head_dim, float scale, float softcap, float* partials) {
  const int64_t partial_size = group * (2 + head_dim);
  for_each_unit_balanced(units, [&](const Unit& unit) {
    thread_local std::vector<float> rotated, scores, tile, acc, totals;
    thread_local std::vector<typename Tiles::Query> queries;
    thread_local std::vector<T> zeros;
    rotated.resize(group * head_dim);
    queries.resize(group * head_dim);
    scores.resize(group * kPartition);
    acc.assign(group * head_dim, 0.f);
    totals.resize(group);
    zeros.assign(head_dim, T(0.f));
    const int64_t b = unit.seq, h = unit.head, n = unit.end - unit.begin;
    T* k_head = k_base + h * head_stride;
    T* v_head = v_base + h * head_stride;
    if (fresh != nullptr) {
      const T* heads = fresh->qk + b * fresh->qk_row_stride;
      const float* rotation = fresh->rotation + b * head_dim;
      for (int64_t g = 0; g < group; ++g)
        rotate(heads + (h * group + g) * head_dim, rotation, rotated.data() + g * head_dim,
               head_dim);
      // The unit with the newest key writes it, then reads it back below.
      if (unit.end == lens[b] && !fresh->written)
        cache_new_kv(*fresh, b, h, num_heads, head_dim, k_head, v_head, acc.data());
      std::fill(acc.begin(), acc.end(), 0.f);
    } else {
      widen(q_ptr + (b * num_heads + h * group) * head_dim, rotated.data(), group * head_dim);
    }
    Tiles::prepare(rotated.data(), group * head_dim, queries.data());
    const int64_t* table = tables + b * width;
    const T* rows[kTile];
    // The tile's row pointers, walking the blocks: a division per tile, not per row.
    const auto tile_rows = [&](const T* pool, int64_t t0) {
      const int64_t count = std::min(kTile, n - t0), pos = unit.begin + t0;
      int64_t block = pos / block_size, offset = pos % block_size;
      for (int64_t t = 0; t < count; ++t) {
        rows[t] = pool + (table[block] * block_size + offset) * head_dim;
        if (++offset == block_size) offset = 0, ++block;
      }
      std::fill(rows + count, rows + kTile, zeros.data());
      return count;
    };
    // The pool's blocks lie anywhere, so the hardware prefetchers see a new stream every
    // block: the next unit's keys and values are fetched while this one computes. Into L2:
    // they are 16-64 KiB, as much as L1 or twice it, so fetching them into L1 evicted them
    // (and this unit's rows) before they were read. On a 2-core Zen 4 EPYC, 8 contexts of
    // 4,096 tokens then took 0.62x the time (float32 and bfloat16, from DRAM); on an AMX
    // Xeon, 1.00x. A share of its rows with each of this unit's tiles (keys first, then
    // values), not all at the unit's start: hundreds of prefetches in a row filled the
    // core's miss buffers and stalled it, a fifth of the kernel's cycles.
    const Unit* next = &unit != &units.back() ? &unit + 1 : nullptr;
    const int64_t next_rows = next != nullptr ? next->end - next->begin : 0;
    const int64_t tiles = (n + kTile - 1) / kTile;
    const int64_t fetch_step = tiles > 0 ? (next_rows + tiles - 1) / tiles : 0;
    int64_t fetched = 0;  // of the next unit's keys, then of its values
    const auto fetch_next = [&] {
      for (int64_t left = fetch_step; left > 0 && fetched < 2 * next_rows;) {
        const int64_t pos = next->begin + fetched % next_rows, offset = pos % block_size;
        const int64_t count = std::min({block_size - offset, next->end - pos, left});
        const T* pool = (fetched < next_rows ? k_base : v_base) + next->head * head_stride;
        const char* run = reinterpret_cast<const char*>(
            pool + (tables[next->seq * width + pos / block_size] * block_size + offset) *
                       head_dim);
        for (int64_t byte = 0; byte < count * head_dim * static_cast<int64_t>(sizeof(T));
             byte += kvserve::simd::kCacheLineBytes)
          kvserve::simd::prefetch_into_l2(run + byte);
        fetched += count;
        left -= count;
      }
    };
    for (int64_t t0 = 0; t0 < n; t0 += kTile) {
      fetch_next();
      const int64_t count = tile_rows(k_head, t0);
      Tiles::score(queries.data(), group, rows, count, head_dim, scale, scores.data() + t0,
                   kPartition, tile);
    }
    float* partial = unit.partial >= 0 ? partials + unit.partial * partial_size : nullptr;
    for (int64_t g = 0; g < group && n > 0; ++g) {
      float* s = scores.data() + g * kPartition;
      if (softcap > 0.f) cap_scores(s, n, softcap);
      const float max = max_of(s, n);
      totals[g] = exp_and_sum(s, n, max);
      if (partial != nullptr) {
        partial[2 * g] = max;
        partial[2 * g + 1] = totals[g];
      }
    }
    for (int64_t t0 = 0; t0 < n; t0 += kTile) {
      fetch_next();
      const int64_t count = tile_rows(v_head, t0);
      Tiles::add_values(scores.data() + t0, kPartition, group, rows, count, head_dim,
                        acc.data(), tile);
    }
    Tiles::finish(acc.data(), group, head_dim);
    if (partial != nullptr) {
      std::copy(acc.begin(), acc.end(), partial + 2 * group);
      return;
    }
    for (int64_t g = 0; g < group && n > 0; ++g)
      for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] /= totals[g];
    narrow(acc.data(), out_ptr + (b * num_heads + h * group) * head_dim, group * head_dim);
  });
}

// Each split head's output from its partials: softmax sums rescaled to the largest max.
template <typename T>
void merge(const std::vector<Split>& splits, const std::vector<float>& partials, T* out_ptr,
           int64_t num_heads, int64_t group, int64_t head_dim) {
  const int64_t partial_size = group * (2 + head_dim);
  at::parallel_for(0, splits.size(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const Split& split = splits[i];
      const int64_t first = split.first_partial, parts = split.parts;
      for (int64_t g = 0; g < group; ++g) {
        float max = -std::numeric_limits<float>::infinity(), total = 0.f;
        for (int64_t p = 0; p < parts; ++p)
          max = std::max(max, partials[(first + p) * partial_size + 2 * g]);
        std::fill(acc.begin() + g * head_dim, acc.begin() + (g + 1) * head_dim, 0.f);
        for (int64_t p = 0; p < parts; ++p) {
          const float* part = partials.data() + (first + p) * partial_size;
          const float weight = std::exp(part[2 * g] - max);
          total += weight * part[2 * g + 1];
          const float* out = part + 2 * group + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] += weight * out[d];
        }
        for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] /= total;
      }
      narrow(acc.data(), out_ptr + (split.seq * num_heads + split.head * group) * head_dim,
             group * head_dim);
    }
  });
}

template <typename T>
void decode(const T* q_ptr, const NewTokens<T>* fresh, T* k_base, T* v_base,
            const int64_t* tables, const int64_t* lens, T* out_ptr, int64_t batch,
            int64_t num_heads, int64_t num_kv_heads, int64_t head_stride, int64_t block_size,
            int64_t width, int64_t head_dim, float scale, int64_t window, float softcap) {
  const int64_t group = num_heads / num_kv_heads;
  std::vector<Unit> units;
  std::vector<Split> splits;
  int64_t num_partial = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    const int64_t parts = std::max<int64_t>(1, (lens[b] - first + kPartition - 1) / kPartition);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      if (parts > 1) splits.push_back({b, h, num_partial, parts});
      for (int64_t p = 0; p < parts; ++p)
        units.push_back({b, h, first + p * kPartition,
                         std::min(lens[b], first + (p + 1) * kPartition),
                         parts > 1 ? num_partial++ : -1});
    }
  }
  // A partial unit's softmax max and sum, then its unnormalized output, per query head.
  std::vector<float> partials(num_partial * group * (2 + head_dim));
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (head_dim % BF16PairTiles::kPair == 0) {
      attend<T, BF16PairTiles>(units, q_ptr, fresh, k_base, v_base, tables, lens, out_ptr,
                               num_heads, group, head_stride, block_size, width, head_dim, scale,
                               softcap, partials.data());
      return merge(splits, partials, out_ptr, num_heads, group, head_dim);
    }
  }
#endif
  attend<T, WidenedTiles<T>>(units, q_ptr, fresh, k_base, v_base, tables, lens, out_ptr,
                             num_heads, group, head_stride, block_size, width, head_dim, scale,
                             softcap, partials.data());
  merge(splits, partials, out_ptr, num_heads, group, head_dim);
}

void check_inputs(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, at::ScalarType dtype, int64_t head_dim) {
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) &&
                  kv_cache.scalar_type() == dtype,
              "paged_decode_attention: float32 or bfloat16 q and kv_cache of one dtype");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous(),
              "paged_decode_attention: inputs must be contiguous");
  TORCH_CHECK(head_dim % kLanes == 0, "paged_decode_attention: head_dim % 16 != 0");
}

template <typename T>
void dispatch(const T* q, const NewTokens<T>* fresh, at::Tensor& kv_cache,
              const at::Tensor& block_tables, const at::Tensor& seq_lens,
              at::Tensor& out, int64_t batch, int64_t num_heads, int64_t head_dim,
              double scale, int64_t window, double softcap) {
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2);
  const int64_t block_size = kv_cache.size(3);
  const int64_t head_stride = num_blocks * block_size * head_dim;
  T* k = kv_cache.data_ptr<T>();
  if (fresh != nullptr && fresh->written) {
    at::parallel_for(0, batch, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(head_dim);
      for (int64_t b = begin; b < end; ++b)
        for (int64_t h = 0; h < num_kv_heads; ++h)
          cache_new_kv(*fresh, b, h, num_heads, head_dim, k + h * head_stride,
                       k + (num_kv_heads + h) * head_stride, row.data());
    });
  }
  decode(q, fresh, k, k + num_kv_heads * head_stride, block_tables.data_ptr<int64_t>(),
         seq_lens.data_ptr<int64_t>(), out.data_ptr<T>(), batch, num_heads, num_kv_heads,
         head_stride, block_size, block_tables.size(1), head_dim, static_cast<float>(scale),
         window, static_cast<float>(softcap));
}

// Rotates rows' q and k heads as the fused decode does, writing q back in place (`qk`: the
// writable rows of fresh.qk) and k and v into the cache at each row's slot.
template <typename T>
void rotate_rows(const NewTokens<T>& fresh, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, T* k_base, T* v_base, int64_t head_stride, T* qk) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(head_dim);
    for (int64_t b = begin; b < end; ++b) {
      const T* heads = fresh.qk + b * fresh.qk_row_stride;
      const float* rotation = fresh.rotation + b * head_dim;
      for (int64_t h = 0; h < num_heads; ++h)
        rotate_into(heads + h * head_dim, rotation, qk + b * fresh.qk_row_stride + h * head_dim,
                    head_dim, row.data());
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
// window > 0. With softcap > 0, each score s becomes softcap * tanh(s / softcap).
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kv_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens,
                                  double scale, int64_t window, double softcap) {
  check_inputs(kv_cache, block_tables, seq_lens, q.scalar_type(), q.size(2));
  TORCH_CHECK(q.is_contiguous(), "paged_decode_attention: inputs must be contiguous");
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat)
    dispatch<float>(q.data_ptr<float>(), nullptr, kv_cache, block_tables, seq_lens, out,
                    q.size(0), q.size(1), q.size(2), scale, window, softcap);
  else
    dispatch<at::BFloat16>(q.data_ptr<at::BFloat16>(), nullptr, kv_cache, block_tables,
                           seq_lens, out, q.size(0), q.size(1), q.size(2), scale, window,
                           softcap);
  return out;
}

// The decode step's attention in one call: qk [B, Hq + Hkv, D] unrotated, v [B, Hkv, D]
// (each with contiguous heads; rows may be strided), rotation [B, D / 2, 2] float32
// (cos, sin), slot_mapping [B] int64; returns [B, Hq, D]. With `rows_share_sequences`, every
// row's key and value are cached before any row attends.
at::Tensor rotate_cache_and_decode(at::Tensor qk, at::Tensor v, at::Tensor rotation,
                                   at::Tensor slot_mapping, at::Tensor kv_cache,
                                   at::Tensor block_tables, at::Tensor seq_lens,
                                   double scale, int64_t window, bool rows_share_sequences,
                                   double softcap) {
  const int64_t batch = qk.size(0), head_dim = qk.size(2);
  const int64_t num_heads = qk.size(1) - kv_cache.size(1);
  check_inputs(kv_cache, block_tables, seq_lens, qk.scalar_type(), head_dim);
  const auto heads_contiguous = [&](const at::Tensor& x) {
    return x.stride(2) == 1 && x.stride(1) == head_dim;
  };
  TORCH_CHECK(heads_contiguous(qk) && heads_contiguous(v) && rotation.is_contiguous() &&
                  slot_mapping.is_contiguous() && v.scalar_type() == qk.scalar_type() &&
                  rotation.scalar_type() == at::kFloat,
              "rotate_cache_and_decode: qk and v of one dtype with contiguous heads, float32 "
              "rotation");
  auto out = at::empty({batch, num_heads, head_dim}, qk.options());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* rot = rotation.data_ptr<float>();
  if (qk.scalar_type() == at::kFloat) {
    const NewTokens<float> fresh{qk.data_ptr<float>(), v.data_ptr<float>(), qk.stride(0),
                                 v.stride(0), rot, slots, rows_share_sequences};
    dispatch<float>(nullptr, &fresh, kv_cache, block_tables, seq_lens, out, batch, num_heads,
                    head_dim, scale, window, softcap);
  } else {
    const NewTokens<at::BFloat16> fresh{qk.data_ptr<at::BFloat16>(),
                                        v.data_ptr<at::BFloat16>(), qk.stride(0), v.stride(0),
                                        rot, slots, rows_share_sequences};
    dispatch<at::BFloat16>(nullptr, &fresh, kv_cache, block_tables, seq_lens, out, batch,
                           num_heads, head_dim, scale, window, softcap);
  }
  return out;
}

// The rotation and cache write of rotate_cache_and_decode without the attention, for the
// prefill rows of a step: qk [N, Hq + Hkv, D], v [N, Hkv, D] (heads contiguous); rotates the
// queries in place and returns them, qk's first Hq heads: no [N, Hq, D] copy is allocated and
// written (2,048 rows' rotary, cache writes and prefill attention: 0.98-1.00x the time).
at::Tensor rotate_and_cache(at::Tensor qk, at::Tensor v, at::Tensor rotation,
                            at::Tensor slot_mapping, at::Tensor kv_cache) {
  const int64_t rows = qk.size(0), head_dim = qk.size(2), num_kv_heads = kv_cache.size(1);
  const int64_t num_heads = qk.size(1) - num_kv_heads;
  TORCH_CHECK(qk.stride(2) == 1 && qk.stride(1) == head_dim && v.stride(2) == 1 &&
                  v.stride(1) == head_dim && rotation.is_contiguous() &&
                  slot_mapping.is_contiguous() && kv_cache.is_contiguous() &&
                  v.scalar_type() == qk.scalar_type() &&
                  kv_cache.scalar_type() == qk.scalar_type() &&
                  rotation.scalar_type() == at::kFloat &&
                  (qk.scalar_type() == at::kFloat || qk.scalar_type() == at::kBFloat16),
              "rotate_and_cache: float32 or bfloat16 qk, v and kv_cache with contiguous heads, "
              "float32 rotation");
  const int64_t head_stride = kv_cache.size(2) * kv_cache.size(3) * head_dim;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* rot = rotation.data_ptr<float>();
  if (qk.scalar_type() == at::kFloat) {
    const NewTokens<float> fresh{qk.data_ptr<float>(), v.data_ptr<float>(), qk.stride(0),
                                 v.stride(0), rot, slots, true};
    float* k = kv_cache.data_ptr<float>();
    rotate_rows(fresh, rows, num_heads, num_kv_heads, head_dim, k,
                k + num_kv_heads * head_stride, head_stride, qk.data_ptr<float>());
  } else {
    using T = at::BFloat16;
    const NewTokens<T> fresh{qk.data_ptr<T>(), v.data_ptr<T>(), qk.stride(0), v.stride(0), rot,
                             slots, true};
    T* k = kv_cache.data_ptr<T>();
    rotate_rows(fresh, rows, num_heads, num_kv_heads, head_dim, k,
                k + num_kv_heads * head_stride, head_stride, qk.data_ptr<T>());
  }
  return qk.narrow(1, 0, num_heads);
}

}  // namespace kvserve
