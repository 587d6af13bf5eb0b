// Causal prefill attention for CPU over the paged pool, flash-attention style: each tile of
// up to 6 query rows of one head walks its visible keys 64 at a time, with an online softmax,
// so no score matrix is ever written out. Each KV head's context is first packed in the
// GEMM's 16-output blocks (keys as the outputs of Q.K^T, head dimensions as the outputs of
// P.V), so both products run as the GEMM's register tiles: VDPBF16PS in bfloat16, FMA in
// float32, accumulating in float32. PyTorch's CPU flash attention reaches ~140 GFLOP/s on a
// 2-core AVX512-BF16 EPYC; the tiles here run at several times that. Where the CPU has AMX,
// bfloat16 tiles of 32 query rows (16 at head_dim 64, their output held in tiles) run both
// products on AMX tiles (amx.h) over the same packing, and only the softmax in AVX-512.
#include "kvserve_cpu.h"
#include "amx.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using kvserve::simd::kBlock;

#ifdef __AVX512F__
using kvserve::simd::accumulate;
using kvserve::simd::Lanes;

constexpr int64_t kKeyTile = 64;  // keys per step: 4 blocks
constexpr int kTileRows = 6;
constexpr int kMaxTileRows = 32;  // the most query rows of a tile on any path (AMX)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kMaxExp2Growth = 8.f;

// One KV head's context, packed: keys as [ctx / 16] blocks of a [16 x D] matrix (Q.K^T's
// outputs are keys), values per 64-key tile as [D / 16] blocks of a [D x 64] one (P.V's
// outputs are head dimensions). Positions past the context are zeros. In 32-bit words (a
// float32, or a bfloat16 pair), key t's word w lies at word w * 16 + t % 16 of its block:
// each key row is scattered 16 words at a time. A value block takes 16 dimensions of one key
// (float32) or of a key pair, interleaved (bfloat16). This packs the 64 keys of `tile`.
template <typename T>
void pack_tile(const T* keys, const T* values, const int64_t* block_ids, int64_t block_size,
               int64_t ctx, int64_t tile, int64_t head_dim, const T* zeros, T* packed_k,
               T* packed_v) {
  constexpr int64_t step = Lanes<T>::kStep;
  const int64_t words = head_dim * static_cast<int64_t>(sizeof(T)) / 4;
  const __m512i word_offsets = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(kBlock));
  const auto row_of = [&](const T* pool, int64_t t) {
    return t < ctx ? pool + (block_ids[t / block_size] * block_size + t % block_size) * head_dim
                   : zeros;
  };
  const auto half_vector = [](const T* v) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
  };
  T* v_tile = packed_v + tile * kKeyTile * head_dim;
  for (int64_t i = 0; i < kKeyTile; i += step) {
    const int64_t t = tile * kKeyTile + i;
    for (int64_t j = 0; j < step; ++j) {
      const auto* key = reinterpret_cast<const int32_t*>(row_of(keys, t + j));
      auto* block = reinterpret_cast<int32_t*>(packed_k + (t + j) / kBlock * head_dim * kBlock) +
                    (t + j) % kBlock;
      for (int64_t w = 0; w < words; w += kBlock) {
        const __mmask16 mask = kvserve::simd::first_lanes(words - w);
        _mm512_mask_i32scatter_epi32(block + w * kBlock, mask, word_offsets,
                                     _mm512_maskz_loadu_epi32(mask, key + w), 4);
      }
    }
    const T* value = row_of(values, t);
    for (int64_t d = 0; d < head_dim; d += kBlock) {
      T* out = v_tile + d * kKeyTile + i * kBlock;
      if constexpr (step == 1) {
        _mm512_storeu_si512(out, _mm512_loadu_si512(value + d));
      } else {
        const __m512i pair = _mm512_inserti64x4(_mm512_castsi256_si512(half_vector(value + d)),
                                                half_vector(row_of(values, t + 1) + d), 1);
        // A bfloat16 key pair: dimension e of the first key to element 2e, of the second to
        // 2e + 1.
        _mm512_storeu_si512(out, kvserve::simd::interleave_halves(pair));
      }
    }
  }
}

// out[i] += P row i . V for the head dimensions of BLOCKS blocks from d_block.
template <typename T, int ROWS, int BLOCKS>
void add_values(float* out, int64_t head_dim, const T* probs, const T* v_tile, int64_t d_block) {
  __m512 acc[ROWS][BLOCKS];
  for (int i = 0; i < ROWS; ++i)
    for (int b = 0; b < BLOCKS; ++b)
      acc[i][b] = _mm512_loadu_ps(out + i * head_dim + (d_block + b) * kBlock);
  accumulate<T, ROWS, BLOCKS>(acc, probs, kKeyTile, kKeyTile,
                              v_tile + d_block * kKeyTile * kBlock);
  for (int i = 0; i < ROWS; ++i)
    for (int b = 0; b < BLOCKS; ++b)
      _mm512_storeu_ps(out + i * head_dim + (d_block + b) * kBlock, acc[i][b]);
}

template <typename T, int ROWS>
void add_all_values(float* out, int64_t head_dim, const T* probs, const T* v_tile) {
  const int64_t blocks = head_dim / kBlock;
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) add_values<T, ROWS, 4>(out, head_dim, probs, v_tile, b);
  for (; b < blocks; ++b) add_values<T, ROWS, 1>(out, head_dim, probs, v_tile, b);
}

// A query row's softmax so far: a reference raw (unscaled) score `max`, and the sum of
// exp(scale * (score - max)) kept per lane, summed across lanes once at the end. The reference
// moves up only when a tile's largest score would give a probability above 2^kMaxExp2Growth
// against it, so most tiles skip rescaling the row's output (15 % off the bfloat16 AMX kernel
// at 2,048 tokens), and probabilities of at most 256 keep float32's and bfloat16's relative
// precision. The sum is of the probabilities before P.V's operands round them to T, each
// within half a unit of T's last place and as often up as down; summing the rounded ones took
// 1.5 more vector ops per 16 keys (3-4 % of the AMX kernel's time at 2,048 tokens).
struct RowState {
  float max = kNegInf;
  float limit = kNegInf;  // the raw score that moves the reference: one compare per tile
  __m512 total = _mm512_setzero_ps();
};

// The probabilities of one query row's tile of raw scores (visible where MASKED), whose
// lanes' largest visible scores are row_max, rounded to T in p, with the row's state updated;
// returns the factor that rescales the row's output so far to a new reference (else 1). The
// lanes are compared with the row's limit, so the lanes' maximum is reduced only for a row's
// first tile and when the reference moves.
template <typename T, bool MASKED>
__attribute__((always_inline)) inline float tile_probabilities(
    const __m512 (&scores)[4], const __mmask16 (&visible)[4], __m512 row_max, float to_exp2,
    RowState& s, T* p) {
  float factor = 1.f;
  const __m512 c = _mm512_set1_ps(to_exp2);
  if (s.max == kNegInf || _mm512_cmp_ps_mask(row_max, _mm512_set1_ps(s.limit), _CMP_GT_OQ)) {
    const float tile_max = _mm512_reduce_max_ps(row_max);
    if (tile_max == kNegInf) {
      std::fill(p, p + kKeyTile, T(0.f));
      return 1.f;
    }
    if (s.max != kNegInf) {
      factor = std::exp2((s.max - tile_max) * to_exp2);
      s.total = _mm512_mul_ps(s.total, _mm512_set1_ps(factor));
    }
    s.max = tile_max;
    s.limit = tile_max + kMaxExp2Growth / to_exp2;
  }
  const __m512 shift = _mm512_set1_ps(s.max * to_exp2);
  __m512 sum = _mm512_setzero_ps();  // a register: p's stores could alias s.total
  for (int b = 0; b < 4; b += 2) {
    __m512 e0 = Lanes<T>::exp2(_mm512_fmsub_ps(scores[b], c, shift));
    __m512 e1 = Lanes<T>::exp2(_mm512_fmsub_ps(scores[b + 1], c, shift));
    if constexpr (MASKED) {
      e0 = _mm512_maskz_mov_ps(visible[b], e0);
      e1 = _mm512_maskz_mov_ps(visible[b + 1], e1);
    }
    Lanes<T>::store_pair(p + b * kBlock, e0, e1);
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
  }
  s.total = _mm512_add_ps(s.total, sum);
  return factor;
}

// One query row's raw scores against a 64-key tile -> its probabilities, rounded to T, in p
// (zeros where no key of the tile is visible to the row), with the row's state updated.
// Returns the factor that rescales the row's output so far to a new reference (else 1).
// Tiles the row sees whole skip the masks. Inlined: as a call per row and tile it cost 6 %.
// With softcap > 0 (Gemma 2's), raw scores r first become (softcap / scale) *
// tanh(scale * r / softcap), so that their scaled values are the capped ones.
template <typename T>
__attribute__((always_inline)) inline float softmax_tile_row(
    __m512 (&scores)[4], int64_t row_pos, int64_t tile, int64_t window, float scale,
    float softcap, RowState& s, T* p) {
  constexpr float kLog2e = 1.44269504f;
  const float to_exp2 = scale * kLog2e;
  if (softcap > 0.f) {
    const __m512 in = _mm512_set1_ps(scale / softcap), out = _mm512_set1_ps(softcap / scale);
    for (int b = 0; b < 4; ++b)
      scores[b] = _mm512_mul_ps(out, kvserve::simd::tanh(_mm512_mul_ps(scores[b], in)));
  }
  const int64_t first_key = tile * kKeyTile;
  __mmask16 visible[4] = {0xffff, 0xffff, 0xffff, 0xffff};
  if (first_key + kKeyTile - 1 <= row_pos && (window <= 0 || first_key > row_pos - window)) {
    const __m512 row_max = _mm512_max_ps(_mm512_max_ps(scores[0], scores[1]),
                                         _mm512_max_ps(scores[2], scores[3]));
    return tile_probabilities<T, false>(scores, visible, row_max, to_exp2, s, p);
  }
  __m512 row_max = _mm512_set1_ps(kNegInf);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int b = 0; b < 4; ++b) {
    const __m512i key = _mm512_add_epi32(
        _mm512_set1_epi32(static_cast<int32_t>(first_key + b * kBlock)), lane);
    visible[b] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(row_pos)));
    if (window > 0)
      visible[b] &= _mm512_cmpgt_epi32_mask(
          key, _mm512_set1_epi32(static_cast<int32_t>(row_pos - window)));
    row_max = _mm512_mask_max_ps(row_max, visible[b], row_max, scores[b]);
  }
  return tile_probabilities<T, true>(scores, visible, row_max, to_exp2, s, p);
}

// A row of output so far times a softmax's rescaling factor.
inline void rescale_row(float* acc_row, int64_t head_dim, float factor) {
  if (factor == 1.f) return;
  for (int64_t d = 0; d < head_dim; d += kBlock)
    _mm512_storeu_ps(acc_row + d, _mm512_mul_ps(_mm512_loadu_ps(acc_row + d),
                                                _mm512_set1_ps(factor)));
}

// out row i = acc row i / its softmax total, for `rows` rows.
template <typename T>
void normalize_rows(int rows, const RowState* state, const float* acc, int64_t head_dim, T* out,
                    int64_t out_stride) {
  for (int i = 0; i < rows; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(state[i].total));
    for (int64_t d = 0; d < head_dim; d += kBlock)
      Lanes<T>::store(out + i * out_stride + d,
                      _mm512_mul_ps(_mm512_loadu_ps(acc + i * head_dim + d), inv), 0xffff);
  }
}

// The first key tile any of the rows (at ascending positions pos[0..rows)) can see.
inline int64_t first_tile(const int64_t* pos, int64_t window) {
  return (window > 0 ? std::max<int64_t>(0, pos[0] - window + 1) : 0) / kKeyTile;
}

// Query rows r0.. (ROWS of them, at ascending positions `pos`) of one head.
template <typename T, int ROWS>
void attend_rows(const T* q, int64_t q_stride, const int64_t* pos, const T* packed_k,
                 const T* packed_v, int64_t head_dim, float scale, int64_t window, float softcap,
                 float* acc_out, T* probs, T* out, int64_t out_stride) {
  RowState state[ROWS];
  std::fill(acc_out, acc_out + ROWS * head_dim, 0.f);
  for (int64_t tile = first_tile(pos, window); tile * kKeyTile <= pos[ROWS - 1]; ++tile) {
    __m512 scores[ROWS][4];
    for (int i = 0; i < ROWS; ++i)
      for (int b = 0; b < 4; ++b) scores[i][b] = _mm512_setzero_ps();
    accumulate<T, ROWS, 4>(scores, q, q_stride, head_dim,
                           packed_k + tile * kKeyTile * head_dim);
    for (int i = 0; i < ROWS; ++i)
      rescale_row(acc_out + i * head_dim, head_dim,
                  softmax_tile_row<T>(scores[i], pos[i], tile, window, scale, softcap, state[i],
                                      probs + i * kKeyTile));
    add_all_values<T, ROWS>(acc_out, head_dim, probs, packed_v + tile * kKeyTile * head_dim);
  }
  normalize_rows<T>(ROWS, state, acc_out, head_dim, out, out_stride);
}

#ifdef KVSERVE_AMX
namespace amx = kvserve::amx;

// attend_rows for up to 32 bfloat16 query rows on AMX tiles (configured for `rows`): Q.K^T
// into a float32 score tile, the softmax as above, P.V added to the float32 output rows in
// the tiles. head_dim a multiple of 32.
void attend_rows_amx(int rows, const amx::Bf16* q, int64_t q_stride, const int64_t* pos,
                     const amx::Bf16* packed_k, const amx::Bf16* packed_v, int64_t head_dim,
                     float scale, int64_t window, float softcap, float* acc, float* scores,
                     amx::Bf16* probs, amx::Bf16* out, int64_t out_stride) {
  RowState state[amx::kRows];
  std::fill(acc, acc + rows * head_dim, 0.f);
  for (int64_t tile = first_tile(pos, window); tile * kKeyTile <= pos[rows - 1]; ++tile) {
    const amx::Bf16* keys = packed_k + tile * kKeyTile * head_dim;
    for (int64_t key = 0; key < kKeyTile; key += 2 * kBlock) {
      const amx::Bf16* k0 = keys + key * head_dim;  // the key's block: key / 16 blocks in
      amx::multiply<false>(rows, q, q_stride, head_dim, k0, k0 + kBlock * head_dim,
                           scores + key, kKeyTile, false);
    }
    for (int i = 0; i < rows; ++i) {
      __m512 row[4];
      for (int b = 0; b < 4; ++b) row[b] = _mm512_loadu_ps(scores + i * kKeyTile + b * kBlock);
      rescale_row(acc + i * head_dim, head_dim,
                  softmax_tile_row<amx::Bf16>(row, pos[i], tile, window, scale, softcap,
                                              state[i], probs + i * kKeyTile));
    }
    const amx::Bf16* values = packed_v + tile * kKeyTile * head_dim;
    for (int64_t d = 0; d < head_dim; d += 2 * kBlock) {
      const amx::Bf16* v0 = values + d * kKeyTile;  // the dimension's block: d / 16 blocks in
      amx::multiply<false>(rows, probs, kKeyTile, kKeyTile, v0, v0 + kKeyTile * kBlock,
                           acc + d, head_dim, true);
    }
  }
  normalize_rows<amx::Bf16>(rows, state, acc, head_dim, out, out_stride);
}

// For head_dim 64, 16 query rows keep their whole output in tiles tmm0-3 (16 dimensions
// each) across the context, where attend_rows_amx loads and stores it at every key tile;
// tmm4-5 take two 16-key score blocks, tmm6 the queries or probabilities, tmm7 one block.
// Twice the key and value tile loads per row, none of the output's: 0.85x the time at 2,048
// tokens, the same bits.
constexpr int64_t kResidentHeadDim = 64;
constexpr int kResidentRows = 16;

inline void configure_resident(int rows) {
  const auto r = static_cast<uint8_t>(rows);
  amx::configure_tiles({r, r, r, r, r, r, r, 16});
}

// The output tiles to or from acc's rows. (The tile instructions take constant tile numbers.)
inline void store_output(float* acc) {
  constexpr int64_t kStride = kResidentHeadDim * sizeof(float);
  _tile_stored(0, acc, kStride);
  _tile_stored(1, acc + kBlock, kStride);
  _tile_stored(2, acc + 2 * kBlock, kStride);
  _tile_stored(3, acc + 3 * kBlock, kStride);
}
inline void load_output(const float* acc) {
  constexpr int64_t kStride = kResidentHeadDim * sizeof(float);
  _tile_loadd(0, acc, kStride);
  _tile_loadd(1, acc + kBlock, kStride);
  _tile_loadd(2, acc + 2 * kBlock, kStride);
  _tile_loadd(3, acc + 3 * kBlock, kStride);
}

// Output tile b += the probabilities in tmm6 times dimension block b of a packed value tile,
// for its 32 keys from `key`.
inline void add_value_blocks(const amx::Bf16* values, int64_t key) {
  const amx::Bf16* v = values + key * kBlock;
  constexpr int64_t kBlockElems = kKeyTile * kBlock;
  _tile_loadd(7, v, 64);
  _tile_dpbf16ps(0, 6, 7);
  _tile_loadd(7, v + kBlockElems, 64);
  _tile_dpbf16ps(1, 6, 7);
  _tile_loadd(7, v + 2 * kBlockElems, 64);
  _tile_dpbf16ps(2, 6, 7);
  _tile_loadd(7, v + 3 * kBlockElems, 64);
  _tile_dpbf16ps(3, 6, 7);
}

// Row i's share (a 16th) of the next key tile's keys and of this tile's values, brought into
// L1 while the rows take their softmax, where the tile loads would otherwise wait on L2 for
// them: 0.95x the time at 2,048 tokens, 0.82x at 8,192, 0.79x for a 256-token chunk at 8,192.
// (attend_rows_amx's 32 rows of head_dim 128 and their outputs leave no room in L1 for it:
// 1.04-1.27x there.) The keys after a head's last tile are the next head's or the values', so
// the addresses stay inside the packed context.
inline void prefetch_share(const amx::Bf16* next_keys, const amx::Bf16* values, int i) {
  constexpr int64_t kShare = kKeyTile * kResidentHeadDim / kResidentRows;
  amx::prefetch(next_keys + i * kShare, kShare * sizeof(amx::Bf16));
  amx::prefetch(values + i * kShare, kShare * sizeof(amx::Bf16));
}

// attend_rows_amx for up to 16 rows of head_dim 64, configured by configure_resident.
void attend_rows_amx_resident(int rows, const amx::Bf16* q, int64_t q_stride,
                              const int64_t* pos, const amx::Bf16* packed_k,
                              const amx::Bf16* packed_v, float scale, int64_t window,
                              float softcap, float* acc, float* scores, amx::Bf16* probs,
                              amx::Bf16* out, int64_t out_stride) {
  constexpr int64_t kDim = kResidentHeadDim;
  RowState state[kResidentRows];
  float factor[kResidentRows];
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t tile = first_tile(pos, window); tile * kKeyTile <= pos[rows - 1]; ++tile) {
    for (int64_t key = 0; key < kKeyTile; key += 2 * kBlock) {
      const amx::Bf16* k0 = packed_k + (tile * kKeyTile + key) * kDim;
      _tile_zero(4);
      _tile_zero(5);
      for (int64_t s = 0; s < kDim; s += amx::kChannels) {
        _tile_loadd(6, q + s, q_stride * sizeof(amx::Bf16));
        _tile_loadd(7, k0 + s * kBlock, 64);
        _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(7, k0 + (kDim + s) * kBlock, 64);
        _tile_dpbf16ps(5, 6, 7);
      }
      _tile_stored(4, scores + key, kKeyTile * sizeof(float));
      _tile_stored(5, scores + key + kBlock, kKeyTile * sizeof(float));
    }
    const amx::Bf16* values = packed_v + tile * kKeyTile * kDim;
    bool moved = false;
    for (int i = 0; i < rows; ++i) {
      prefetch_share(packed_k + (tile + 1) * kKeyTile * kDim, values, i);
      __m512 row[4];
      for (int b = 0; b < 4; ++b) row[b] = _mm512_loadu_ps(scores + i * kKeyTile + b * kBlock);
      factor[i] = softmax_tile_row<amx::Bf16>(row, pos[i], tile, window, scale, softcap,
                                              state[i], probs + i * kKeyTile);
      moved |= factor[i] != 1.f;
    }
    if (moved) {  // rare: the reference moves by more than 2^kMaxExp2Growth
      store_output(acc);
      for (int i = 0; i < rows; ++i) rescale_row(acc + i * kDim, kDim, factor[i]);
      load_output(acc);
    }
    for (int64_t key = 0; key < kKeyTile; key += amx::kChannels) {
      _tile_loadd(6, probs + key, kKeyTile * sizeof(amx::Bf16));
      add_value_blocks(values, key);
    }
  }
  store_output(acc);
  normalize_rows<amx::Bf16>(rows, state, acc, kDim, out, out_stride);
}
#endif  // KVSERVE_AMX

template <typename T>
void attend_tile(int rows, const T* q, int64_t q_stride, const int64_t* pos, const T* packed_k,
                 const T* packed_v, int64_t head_dim, float scale, int64_t window, float softcap,
                 float* acc, T* probs, T* out, int64_t out_stride) {
  switch (rows) {
#define KVSERVE_ROWS(R)                                                                     \
  case R:                                                                                   \
    attend_rows<T, R>(q, q_stride, pos, packed_k, packed_v, head_dim, scale, window,       \
                      softcap, acc, probs, out, out_stride);                               \
    break;
    KVSERVE_ROWS(1) KVSERVE_ROWS(2) KVSERVE_ROWS(3) KVSERVE_ROWS(4) KVSERVE_ROWS(5)
    KVSERVE_ROWS(6)
#undef KVSERVE_ROWS
    default: break;
  }
}

template <typename T>
void prefill(const at::Tensor& q, const at::Tensor& kv_cache, const int64_t* block_ids,
             int64_t ctx, float scale, int64_t window, float softcap, const int64_t* positions,
             at::Tensor& out) {
  const int64_t num_q = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2);
  const int64_t block_size = kv_cache.size(3);
  const int64_t padded = (ctx + kKeyTile - 1) / kKeyTile * kKeyTile;
  const int64_t head_elems = num_blocks * block_size * head_dim;
  auto packed = at::empty({2, num_kv_heads, padded * head_dim}, q.options());
  const T* cache = kv_cache.data_ptr<T>();
  T* packed_k = packed[0].data_ptr<T>();
  T* packed_v = packed[1].data_ptr<T>();
  const std::vector<T> zeros(head_dim, T(0.f));
  const int64_t key_tiles = padded / kKeyTile;
  at::parallel_for(0, num_kv_heads * key_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / key_tiles;
      pack_tile(cache + h * head_elems, cache + (num_kv_heads + h) * head_elems, block_ids,
                block_size, ctx, item % key_tiles, head_dim, zeros.data(),
                packed_k + h * padded * head_dim, packed_v + h * padded * head_dim);
    }
  });
  const int64_t group = num_heads / num_kv_heads;
#ifdef KVSERVE_AMX
  const bool on_amx = std::is_same_v<T, amx::Bf16> && amx::runs(head_dim);
  const bool resident = on_amx && head_dim == kResidentHeadDim;
  const int64_t tile_rows = resident ? kResidentRows : on_amx ? amx::kRows : kTileRows;
#else
  const int64_t tile_rows = kTileRows;
#endif
  const int64_t tiles = (num_q + tile_rows - 1) / tile_rows;
  const T* qd = q.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const int64_t q_stride = q.stride(0), out_stride = num_heads * head_dim;
  // Later rows see more keys: pairing tile j with tile (tiles - 1 - j) keeps the threads'
  // contiguous shares of the items equally heavy. Items go KV head by KV head (a group's
  // query heads in turn at each tile), so a thread streams one KV head's keys and values at a
  // time, not all of them: on AMX, 0.84x the time at 4,096 tokens and 0.80x at 8,192, where
  // all heads' overflow L2 (0.97x at 2,048).
  at::parallel_for(0, tiles * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(tile_rows * head_dim), scores(tile_rows * kKeyTile);
    std::vector<T> probs(tile_rows * kKeyTile);
#ifdef KVSERVE_AMX
    int configured = 0;
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / (tiles * group), j = item / group % tiles;
      const int64_t head = kv * group + item % group;
      const int64_t tile = j % 2 == 0 ? j / 2 : tiles - 1 - j / 2;
      const int64_t r0 = tile * tile_rows;
      const int rows = static_cast<int>(std::min<int64_t>(tile_rows, num_q - r0));
      int64_t pos[kMaxTileRows];
      for (int i = 0; i < rows; ++i) pos[i] = positions ? positions[r0 + i] : ctx - num_q + r0 + i;
      const T* q_rows = qd + r0 * q_stride + head * head_dim;
      const T* keys = packed_k + kv * padded * head_dim;
      const T* values = packed_v + kv * padded * head_dim;
      T* out_rows = od + r0 * out_stride + head * head_dim;
#ifdef KVSERVE_AMX
      if constexpr (std::is_same_v<T, amx::Bf16>) {
        if (on_amx) {
          if (resident) {
            if (rows != configured) configure_resident(configured = rows);
            attend_rows_amx_resident(rows, q_rows, q_stride, pos, keys, values, scale, window,
                                     softcap, acc.data(), scores.data(), probs.data(),
                                     out_rows, out_stride);
            continue;
          }
          if (rows != configured) amx::configure(configured = rows);
          attend_rows_amx(rows, q_rows, q_stride, pos, keys, values, head_dim, scale, window,
                          softcap, acc.data(), scores.data(), probs.data(), out_rows,
                          out_stride);
          continue;
        }
      }
#endif
      attend_tile<T>(rows, q_rows, q_stride, pos, keys, values, head_dim, scale, window,
                     softcap, acc.data(), probs.data(), out_rows, out_stride);
    }
#ifdef KVSERVE_AMX
    if (configured) _tile_release();
#endif
  });
}
#endif  // __AVX512F__

}  // namespace

namespace kvserve {

// q: [num_q, Hq, D] rotated queries at positions ctx - num_q .. ctx - 1, or at the ascending
// `positions` (< ctx) when given (heads contiguous, rows may be strided); kv_cache:
// [2, Hkv, num_blocks, block_size, D] holding the context's keys and values (the new ones
// written); block_ids: the context's blocks. Returns [num_q, Hq * D], written into `out` when
// given (rows of a larger step's output: no copy afterwards). With window > 0 a query sees only
// the last `window` positions; with softcap > 0, each scaled score s becomes
// softcap * tanh(s / softcap).
bool prefill_attention_supports(const at::Tensor& q) {
#ifdef __AVX512F__
  return gemm_supports(q.new_empty({kBlock, 2}));
#else
  return false;
#endif
}

at::Tensor prefill_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_ids,
                             int64_t ctx, double scale, int64_t window,
                             c10::optional<at::Tensor> positions,
                             c10::optional<at::Tensor> out, double softcap) {
  const int64_t num_q = q.size(0), head_dim = q.size(2);
  TORCH_CHECK(prefill_attention_supports(q) && kv_cache.scalar_type() ==
                  q.scalar_type() && kv_cache.is_contiguous(),
              "prefill_attention: a float32 (AVX-512) or bfloat16 (AVX512-BF16) q and "
              "contiguous kv_cache of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == head_dim && head_dim % 16 == 0,
              "prefill_attention: q heads contiguous, head_dim a multiple of 16");
  TORCH_CHECK(num_q <= ctx && block_ids.scalar_type() == at::kLong &&
                  block_ids.is_contiguous() &&
                  block_ids.numel() * kv_cache.size(3) >= ctx,
              "prefill_attention: ", num_q, " queries, a context of ", ctx,
              " and int64 block ids covering it");
  TORCH_CHECK(!positions || (positions->scalar_type() == at::kLong &&
                              positions->is_contiguous() && positions->numel() == num_q),
              "prefill_attention: positions, when given, are num_q contiguous int64");
  TORCH_CHECK(!out || (out->scalar_type() == q.scalar_type() && out->is_contiguous() &&
                       out->dim() == 2 && out->size(0) == num_q &&
                       out->size(1) == q.size(1) * head_dim),
              "prefill_attention: out, when given, is a contiguous [", num_q, ", ",
              q.size(1) * head_dim, "] tensor of q's dtype");
  auto result = out ? *out : at::empty({num_q, q.size(1) * head_dim}, q.options());
  if (num_q == 0) return result;
#ifdef __AVX512F__
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  const int64_t* pos = positions ? positions->data_ptr<int64_t>() : nullptr;
  if (q.scalar_type() == at::kFloat)
    prefill<float>(q, kv_cache, ids, ctx, s, window, cap, pos, result);
#ifdef __AVX512BF16__
  else prefill<at::BFloat16>(q, kv_cache, ids, ctx, s, window, cap, pos, result);
#endif
#endif
  return result;
}

}  // namespace kvserve
