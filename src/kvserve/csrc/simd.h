// AVX-512 building blocks shared by the GEMM and the prefill attention: a weight (or key,
// value) matrix packed in 16-output blocks, one 64-byte row per input step, an input step
// being one float32 channel or a pair of bfloat16 ones (the operand shape of VDPBF16PS).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <iterator>

namespace kvserve::simd {
constexpr int64_t kBlock = 16;  // outputs per block: one 512-bit register of float32

// e^x as the AVX-512 and AVX2 kernels compute it (relative error ~1e-7): x clamped at
// kExpLowest, n = round(x * log2(e)), g = x - n * ln(2) (|g| <= ln2 / 2), e^g by its Taylor
// polynomial (coefficients from the highest degree down), times 2^n.
constexpr float kExpLowest = -87.f;
constexpr float kLog2e = 1.44269504f;
constexpr float kLn2 = 0.693147181f;
constexpr float kExpTaylor[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24,
                                1.f / 6,    0.5f,      1.f,       1.f};

constexpr int64_t kCacheLineBytes = 64;

// Fetches p's line into L2 (prefetcht1 on x86), not L1: for streams whose lookahead would
// crowd out of L1 what is read before it (decode attention's next unit, long weight rows).
inline void prefetch_into_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
}  // namespace kvserve::simd

// Where the blocked float32 GEMM is built: AVX-512, or AVX2 with FMA (a block as two 256-bit
// halves). The rest of this file, and the kernels built on it, are AVX-512 only, but for one
// AVX2 mask.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define KVSERVE_BLOCKED_FLOAT32 1
#include <immintrin.h>
#endif

#ifdef __AVX2__
#include <immintrin.h>

namespace kvserve::simd {
// The int32 mask of the first min(8, left) lanes of a 256-bit register, for masked loads and
// stores of a row's last, partial register.
inline __m256i first_avx2_lanes(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The sum of v's 8 lanes: the halves added, then pairs of their lanes, then the last two.
inline float sum_of(__m256 v) {
  const __m128 quads = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(quads, _mm_movehl_ps(quads, quads));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

// v's first min(8, left) lanes stored at p: a plain store for a whole register. A masked store
// (vmaskmovps) costs 13 cycles on Zen 3, eight times a plain one, where a masked load costs
// what a plain load does.
inline void store_first_lanes(float* p, __m256 v, int64_t left) {
  if (left >= 8)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, first_avx2_lanes(left), v);
}

#ifdef __FMA__
// e^x in each lane as exp(__m512) computes it (kExpTaylor's comment), 2^n built in the
// exponent bits, so x is also clamped at kExpHighest, where 2^n still fits them.
constexpr float kExpHighest = 88.f;
inline __m256 exp(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLowest)), _mm256_set1_ps(kExpHighest));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 g = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2), x);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (size_t i = 1; i < std::size(kExpTaylor); ++i)
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i two_to_n =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_to_n));
}

// tanh(x) in each lane, as 1 - 2 / (e^2x + 1) (tanh(__m512)'s comment).
inline __m256 tanh(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f);
  return _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f),
                                          _mm256_add_ps(exp(_mm256_add_ps(x, x)), one)));
}
#endif
}  // namespace kvserve::simd
#endif

#ifdef __AVX512F__
#include <immintrin.h>

namespace kvserve::simd {

// e^x in each lane (kExpTaylor's comment above).
inline __m512 exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpLowest));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 g = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2), x);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (size_t i = 1; i < std::size(kExpTaylor); ++i)
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_scalef_ps(p, n);
}

// tanh(x) in each lane, as 1 - 2 / (e^2x + 1): within ~1e-7 of it absolutely (not relatively
// near 0), which is what a softcapped attention score, cap * tanh(score / cap), needs.
inline __m512 tanh(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f),
                                          _mm512_add_ps(exp(_mm512_add_ps(x, x)), one)));
}

// 2^y in each lane as 2^f * 2^floor(y), f = y - floor(y) in [0, 1), with 2^f from the
// polynomial whose coefficients run from the highest degree down. Lanes below -149 give zeros.
template <size_t N>
inline __m512 exp2_polynomial(__m512 y, const float (&coefficients)[N]) {
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(coefficients[0]);
  for (size_t i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(coefficients[i]));
  return _mm512_scalef_ps(p, y);
}

// 2^y (relative error 1.6e-7): a degree-5 polynomial fitted to 2^f on [0, 1).
inline __m512 exp2(__m512 y) {
  constexpr float kDegree5[] = {1.87757611e-3f, 8.98934156e-3f, 5.58263175e-2f,
                                2.40153611e-1f, 6.93153083e-1f, 9.99999940e-1f};
  return exp2_polynomial(y, kDegree5);
}

// 2^y to bfloat16's precision (relative error 7.5e-5, a 26th of its largest rounding error):
// degree 3, two FMAs fewer.
inline __m512 exp2_coarse(__m512 y) {
  constexpr float kDegree3[] = {7.80237094e-2f, 2.26066768e-1f, 6.95834517e-1f,
                                9.99925017e-1f};
  return exp2_polynomial(y, kDegree3);
}

// The 16-bit elements of v's two 256-bit halves interleaved: element e of the low half to 2e,
// of the high half to 2e + 1.
inline __m512i interleave_halves(__m512i v) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  return _mm512_permutexvar_epi16(order, v);
}

template <typename T> struct Lanes;  // how one input step of T is loaded and multiplied

template <> struct Lanes<float> {
  static constexpr int64_t kStep = 1;  // channels per input step
  static __m512 broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 madd(__m512 acc, __m512 x, const float* w) {
    return _mm512_fmadd_ps(x, _mm512_loadu_ps(w), acc);
  }
  static __m512 load(const float* v, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, v); }
  static void store(float* out, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(out, mask, v); }
  static __m512 round(__m512 v) { return v; }  // to the nearest T
  static __m512 exp2(__m512 y) { return simd::exp2(y); }  // 2^y as precisely as T holds it
  static __m512 exp_negated(__m512 x) {  // e^-x likewise
    return simd::exp(_mm512_sub_ps(_mm512_setzero_ps(), x));
  }
  static __m512 divide(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }  // a / b likewise
  static void store_pair(float* out, __m512 a, __m512 b) {  // a then b as 32 T
    _mm512_storeu_ps(out, a);
    _mm512_storeu_ps(out + kBlock, b);
  }
};
template <typename T> constexpr bool kHasLanes = false;  // whether Lanes<T> exists on this CPU
template <> constexpr bool kHasLanes<float> = true;

#ifdef __AVX512BF16__
template <> struct Lanes<at::BFloat16> {
  static constexpr int64_t kStep = 2;
  static __m512i broadcast(const at::BFloat16* x) {
    return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x));
  }
  static __m512 madd(__m512 acc, __m512i x, const at::BFloat16* w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)_mm512_loadu_si512(w));
  }
  static __m512 widen(__m256i bf16) {  // 16 bfloat16 -> float32, exactly
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
  }
  static __m512 load(const at::BFloat16* v, __mmask16 mask) {
    return widen(_mm256_maskz_loadu_epi16(mask, v));
  }
  static void store(at::BFloat16* out, __m512 v, __mmask16 mask) {
    _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
  static __m512 round(__m512 v) { return widen((__m256i)_mm512_cvtneps_pbh(v)); }
  static __m512 exp2(__m512 y) { return simd::exp2_coarse(y); }
  // e^-x through the coarse 2^y: SiLU's in the AMX gate/up GEMM's store takes 0.92x the time
  // of the precise one (2,048 x 576 x 3,072). -x * log2(e) in one multiply, exactly as
  // negating first would give it.
  static __m512 exp_negated(__m512 x) {
    return exp2(_mm512_mul_ps(x, _mm512_set1_ps(-1.44269504f)));
  }
  // a times b's 14-bit reciprocal (relative error 6.1e-5, near the exponential's), not a
  // division: SiLU in the AMX gate/up GEMM's store (2,048 x 576 x 3,072) takes 0.98x the time,
  // and differs from torch's in 0.25 % of lanes against the division's 0.35 % (gate ~ N(0, 16)).
  static __m512 divide(__m512 a, __m512 b) { return _mm512_mul_ps(a, _mm512_rcp14_ps(b)); }
  static void store_pair(at::BFloat16* out, __m512 a, __m512 b) {
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
};
template <> constexpr bool kHasLanes<at::BFloat16> = true;

// 32 bfloat16 as float32 in two registers, the even-indexed elements and the odd ones: one op
// each, where widening 16 in order takes two.
inline void split_pairs(__m512i v, __m512& even, __m512& odd) {
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  const __m512i high_halves = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, high_halves));
}

// split_pairs' inverse, rounding to bfloat16: one conversion and one permute per 32, where
// rounding 16 in order takes one op and widening them again two more.
inline __m512i join_pairs(__m512 even, __m512 odd) {
  return interleave_halves((__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// a and b rounded to bfloat16, in place: four ops for the two, where Lanes::round takes three
// for each.
inline void round_pair(__m512& a, __m512& b) { split_pairs(join_pairs(a, b), a, b); }
#endif

// acc[i][b] += x row i (k channels, rows ldx apart) . block b of the packed matrix w, whose
// blocks lie k * 16 elements apart: ROWS x 16 * BLOCKS products, each weight row read once.
template <typename T, int ROWS, int BLOCKS>
inline void accumulate(__m512 (&acc)[ROWS][BLOCKS], const T* x, int64_t ldx, int64_t k,
                       const T* w) {
  using L = Lanes<T>;
  constexpr int64_t row_elems = kBlock * L::kStep;
  const int64_t steps = k / L::kStep;
  for (int64_t s = 0; s < steps; ++s) {
    for (int i = 0; i < ROWS; ++i) {
      const auto xv = L::broadcast(x + i * ldx + s * L::kStep);
      for (int b = 0; b < BLOCKS; ++b)
        acc[i][b] = L::madd(acc[i][b], xv, w + (b * steps + s) * row_elems);
    }
  }
}

// silu(gate) * up in each lane, for gate and up already rounded to T, with silu's result
// rounded to T as torch's `F.silu(gate) * up` rounds it; the caller stores the product as T.
template <typename T>
inline __m512 silu_and_mul(__m512 gate, __m512 up) {
  const __m512 e = Lanes<T>::exp_negated(gate);
  const __m512 silu = Lanes<T>::divide(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return _mm512_mul_ps(Lanes<T>::round(silu), up);
}

// The mask of the first min(16, left) lanes.
inline __mmask16 first_lanes(int64_t left) {
  return static_cast<__mmask16>(left >= kBlock ? 0xffffu : (1u << left) - 1);
}

}  // namespace kvserve::simd
#endif  // __AVX512F__
