// A CPU GEMM for the linear layers over a weight packed in 16-output blocks, the layout of
// oneDNN's and llama.cpp's AVX-512 kernels: block b holds outputs 16b..16b+15, one 64-byte
// row per input step, and an input step is one float32 channel or a pair of bfloat16 ones
// (the operand shape of VDPBF16PS). A tile of up to 6 input rows x 64 outputs accumulates in
// 24 registers over the whole input, reading each weight row once per tile with no
// horizontal sums. For 1-64 rows it streams weights faster than oneDNN's prepacked GEMV
// (1.5x at batch 1 on an AVX512-BF16 EPYC); at 2048 rows it is within 10% of oneDNN. Built
// where the compiler targets AVX-512 (and AVX512-BF16 for bfloat16), and for float32 where it
// targets AVX2 with FMA (a block's 16 outputs in two 256-bit halves, tiles of up to 6 rows x 1
// block in 12 of the 16 registers); `gemm_supports` says which.
// Where the CPU has AMX (Sapphire Rapids Xeons and later), bfloat16 runs on its tiles instead,
// over the same packed weight: 8-13x the VDPBF16PS tiles' rate from 64 rows up, and at least
// as fast at batch 1 (`amx_in_use`).
#include "kvserve_cpu.h"
#include "amx.h"
#include "dequantize.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using kvserve::simd::kBlock;
constexpr int kTileRows = 6;    // input rows per tile
constexpr int kTileBlocks = 4;  // blocks per tile (AVX-512: 6 x 4 accumulators + 4 weights)

// Where a GEMM's weight blocks come from, `load`ed a range at a time by the thread that runs
// them: a packed weight, read in place, or a quantized one, dequantized into a buffer of the
// thread's own (dequantize.h). A copy of the source per thread would do as well, but made the
// AMX GEMM of 2,048 x 576 x 1,536 1.10x slower.
template <typename T>
struct PackedBlocks {
  const T* w;
  int64_t block_elems;
  void load(int64_t, int64_t) const {}
  const T* block(int64_t b) const { return w + b * block_elems; }
};

#ifdef __AVX512F__
using kvserve::simd::accumulate;
using kvserve::simd::Lanes;

// out[ROWS x 16*BLOCKS] = x[ROWS x k] W^T (+ bias) for BLOCKS consecutive weight blocks.
template <typename T, int ROWS, int BLOCKS>
void tile(const T* x, int64_t k, const T* w, int64_t outputs_left, const T* bias, T* out,
          int64_t n) {
  __m512 acc[ROWS][BLOCKS];
  for (int i = 0; i < ROWS; ++i)
    for (int b = 0; b < BLOCKS; ++b) acc[i][b] = _mm512_setzero_ps();
  accumulate<T, ROWS, BLOCKS>(acc, x, k, k, w);
  for (int b = 0; b < BLOCKS; ++b) {
    const int64_t cols = std::min<int64_t>(kBlock, outputs_left - b * kBlock);
    if (cols <= 0) break;
    const auto mask = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 add = bias ? Lanes<T>::load(bias + b * kBlock, mask) : _mm512_setzero_ps();
    for (int i = 0; i < ROWS; ++i)
      Lanes<T>::store(out + i * n + b * kBlock, _mm512_add_ps(acc[i][b], add), mask);
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
// out[ROWS x 16] = x[ROWS x k] W^T (+ bias) for one block, whose 16 outputs are two 256-bit
// halves: ROWS x 2 accumulators, each weight row read once. WIDTH blocks run side by side
// where ROWS leaves registers for them (16 in all: accumulators, the broadcast input and the
// weights in use). Built at -O2: GCC 12 at -O3 stores every accumulator to the stack on each
// input step, which made the tile store-bound at 0.4x the rate.
template <int ROWS, int WIDTH>
__attribute__((optimize("O2"))) void avx2_tile(const float* x, int64_t k, const float* w,
                                                int64_t outputs_left, const float* bias,
                                                float* out, int64_t n) {
  __m256 acc[ROWS][WIDTH][2];
#pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 4
    for (int b = 0; b < WIDTH; ++b) acc[i][b][0] = acc[i][b][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < k; ++s) {
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * k + s);
#pragma GCC unroll 4
      for (int b = 0; b < WIDTH; ++b)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h)
          acc[i][b][h] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + (b * k + s) * kBlock + 8 * h),
                                         acc[i][b][h]);
    }
  }
  // The sums through a buffer, so the last block's partial width is a plain copy.
  alignas(32) float sums[ROWS][WIDTH][kBlock];
#pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 4
    for (int b = 0; b < WIDTH; ++b)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) _mm256_store_ps(sums[i][b] + 8 * h, acc[i][b][h]);
  for (int b = 0; b < WIDTH; ++b) {
    const int64_t cols = std::min<int64_t>(kBlock, outputs_left - b * kBlock);
    for (int64_t i = 0; i < ROWS; ++i)
      for (int64_t c = 0; c < cols; ++c)
        out[i * n + b * kBlock + c] = sums[i][b][c] + (bias ? bias[b * kBlock + c] : 0.f);
  }
}

// out[ROWS x 16*BLOCKS] = x[ROWS x k] W^T (+ bias) for BLOCKS consecutive weight blocks, in
// float32: one row's blocks four at a time, two rows' two at a time, more rows' one by one.
template <typename T, int ROWS, int BLOCKS>
void tile(const T* x, int64_t k, const T* w, int64_t outputs_left, const T* bias, T* out,
          int64_t n) {
  static_assert(std::is_same_v<T, float>, "the AVX2 GEMM is float32 only");
  constexpr int kWidth = std::min(BLOCKS, ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1);
  for (int b = 0; b < BLOCKS; b += kWidth) {
    if (outputs_left <= b * kBlock) break;
    avx2_tile<ROWS, kWidth>(x, k, w + b * k * kBlock, outputs_left - b * kBlock,
                            bias ? bias + b * kBlock : nullptr, out + b * kBlock, n);
  }
}
#endif

#ifdef KVSERVE_BLOCKED_FLOAT32
template <typename T, int BLOCKS>
void blocks_for_all_rows(const T* x, int64_t m, int64_t k, const T* w, int64_t outputs_left,
                         const T* bias, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + kTileRows <= m; i += kTileRows)
    tile<T, kTileRows, BLOCKS>(x + i * k, k, w, outputs_left, bias, out + i * n, n);
  const T* xi = x + i * k;
  T* oi = out + i * n;
  switch (m - i) {
    case 5: tile<T, 5, BLOCKS>(xi, k, w, outputs_left, bias, oi, n); break;
    case 4: tile<T, 4, BLOCKS>(xi, k, w, outputs_left, bias, oi, n); break;
    case 3: tile<T, 3, BLOCKS>(xi, k, w, outputs_left, bias, oi, n); break;
    case 2: tile<T, 2, BLOCKS>(xi, k, w, outputs_left, bias, oi, n); break;
    case 1: tile<T, 1, BLOCKS>(xi, k, w, outputs_left, bias, oi, n); break;
    default: break;
  }
}

// Threads split the output blocks evenly (a layer of 9 groups of kTileBlocks would leave one
// thread a fifth idle); each walks all input rows over kTileBlocks of its blocks at a time,
// so their weights stay in cache while the rows stream past, then over a pair and a single
// for what is left.
template <typename T, typename Blocks>
void blocked_gemm(const T* x, int64_t m, int64_t k, const Blocks& weight, int64_t n,
                  const T* bias, T* out) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, kTileBlocks, [&](int64_t begin, int64_t end) {
    const auto run = [&](auto width, int64_t b) {
      constexpr int kWidth = decltype(width)::value;
      const int64_t first = b * kBlock;
      weight.load(b, b + kWidth);
      blocks_for_all_rows<T, kWidth>(x, m, k, weight.block(b), n - first,
                                     bias ? bias + first : nullptr, out + first, n);
    };
    int64_t b = begin;
    for (; b + kTileBlocks <= end; b += kTileBlocks)
      run(std::integral_constant<int, kTileBlocks>{}, b);
    for (; b + 2 <= end; b += 2) run(std::integral_constant<int, 2>{}, b);
    for (; b < end; ++b) run(std::integral_constant<int, 1>{}, b);
  });
}
#endif  // KVSERVE_BLOCKED_FLOAT32

#ifdef KVSERVE_AMX
using Bf16 = at::BFloat16;
constexpr int64_t kAmxGroupBytes = 1 << 20;  // weights kept in L2 while many rows pass
constexpr int64_t kAmxFewRows = 256;         // up to which rows pass each weight pair at once

// Rows [from, to) of out, outputs [first, first + 32), from the tiles' float32 sums c.
void amx_store(const float* c, int from, int to, int64_t first, int64_t n, const Bf16* bias,
               Bf16* out) {
  using L = kvserve::simd::Lanes<Bf16>;
  for (int half = 0; half < 2; ++half) {
    const int64_t col = first + half * kBlock;
    if (col >= n) break;
    const auto mask = kvserve::simd::first_lanes(n - col);
    const __m512 add = bias ? L::load(bias + col, mask) : _mm512_setzero_ps();
    for (int i = from; i < to; ++i)
      L::store(out + i * n + col,
               _mm512_add_ps(_mm512_loadu_ps(c + (2 * i + half) * kBlock), add), mask);
  }
}

// Pair p of a GEMM's blocks on AMX: blocks 2p and 2p + 1 (2p twice for an odd last one).
template <typename Blocks>
struct ConsecutivePairs {
  Blocks blocks;
  int64_t count;  // blocks
  void load(int64_t begin, int64_t end) const {
    blocks.load(2 * begin, std::min(2 * end, count));
  }
  std::pair<const Bf16*, const Bf16*> operator()(int64_t pair) const {
    const Bf16* w0 = blocks.block(2 * pair);
    return {w0, 2 * pair + 1 < count ? blocks.block(2 * pair + 1) : w0};
  }
};

// The products on AMX tiles (amx.h) of x's rows by `pairs` pairs of weight blocks, each pair's
// float32 sums for up to 32 rows handed to `store(c, from, to, pair, first_row)` for its rows
// [from, to). `blocks_of` gives a pair's two blocks, after a `load` of the pairs a thread is
// about to run. With few rows (a decode batch)
// threads split the pairs, and each pair runs over all rows while its weights sit in L1. With
// many (a prefill) threads split the rows, as the row-wise ops around a linear layer split
// them, so each thread reads the rows it wrote and writes the rows it reads next (split by
// pairs, each thread read every row, half of them from the other core's cache: 2,048 x 576 x
// 576 took 1.15x the time). The pairs then go in groups whose weights fit in L2, each 32-row
// step running over a whole group while its rows sit in L1 (2048 x 576 x 3072: 17 % faster
// than pair by pair). Only the last, shorter row step changes the tile configuration.
// A pair's rows are stored a few at a time after each channel step of the next pair's
// multiply, so the store's vector ops run while the tiles multiply, where the two took turns:
// 0.88x the time of the 2,048 x 576 x 3,072 gate/up with its SiLU, 0.93-0.96x for 2,048 rows
// of 576 or 1,536 channels, 0.92x at 32 x 576 x 1,536, level at 2,048^3 (the same bits).
template <typename Pairs, typename Store>
void amx_pairs(const Bf16* x, int64_t m, int64_t k, int64_t pairs, const Pairs& blocks_of,
               Store store) {
  namespace amx = kvserve::amx;
  const int64_t pair_bytes = 2 * k * kBlock * static_cast<int64_t>(sizeof(Bf16));
  const int64_t steps = (m + amx::kRows - 1) / amx::kRows;
  const bool by_rows = m > kAmxFewRows;
  const int64_t group_pairs = by_rows ? std::max<int64_t>(1, kAmxGroupBytes / pair_bytes) : 1;
  at::parallel_for(0, by_rows ? steps : pairs, 1, [&](int64_t begin, int64_t end) {
    const int64_t first_step = by_rows ? begin : 0, end_step = by_rows ? end : steps;
    const int64_t first_pair = by_rows ? 0 : begin, end_pair = by_rows ? pairs : end;
    alignas(64) float c[2][amx::kRows * 2 * kBlock];  // this pair's sums and the last one's
    int configured = 0, current = 0;
    // The last pair's sums: `stored` of its `rows` rows stored so far.
    struct {
      const float* sums = nullptr;
      int rows = 0, stored = 0;
      int64_t pair = 0, row = 0;
    } last;
    const auto store_last = [&](int to) {
      to = std::min(to, last.rows);
      if (to <= last.stored) return;
      store(last.sums, last.stored, to, last.pair, last.row);
      last.stored = to;
    };
    const int64_t channel_steps = std::max<int64_t>(1, k / amx::kChannels);
    for (int64_t group = first_pair; group < end_pair; group += group_pairs) {
      const int64_t group_end = std::min(end_pair, group + group_pairs);
      blocks_of.load(group, group_end);
      for (int64_t step = first_step; step < end_step; ++step) {
        const int64_t row = step * amx::kRows;
        const int rows = static_cast<int>(std::min<int64_t>(amx::kRows, m - row));
        if (rows != configured) amx::configure(configured = rows);
        for (int64_t pair = group; pair < group_end; ++pair) {
          const auto [w0, w1] = blocks_of(pair);
          float* sums = c[current ^= 1];
          const int per_step = static_cast<int>((last.rows + channel_steps - 1) / channel_steps);
          amx::multiply<true>(rows, x + row * k, k, k, w0, w1, sums, 2 * kBlock, false,
                              [&](int64_t s) { store_last((s + 1) * per_step); });
          store_last(last.rows);
          last = {sums, rows, 0, pair, row};
        }
      }
    }
    store_last(last.rows);
    _tile_release();
  });
}

// out = x W^T (+ bias) in bfloat16 on AMX.
template <typename Blocks>
void amx_gemm(const Bf16* x, int64_t m, int64_t k, const Blocks& weight, int64_t n,
              const Bf16* bias, Bf16* out) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  amx_pairs(
      x, m, k, (blocks + 1) / 2, ConsecutivePairs<Blocks>{weight, blocks},
      [&](const float* c, int from, int to, int64_t pair, int64_t row) {
        amx_store(c, from, to, 2 * kBlock * pair, n, bias, out + row * n);
      });
}

// out [m, n] = silu(x W_gate^T) * (x W_up^T) for W = [W_gate; W_up], n a multiple of 16: gate
// block p and up block p as pair p, so the tiles hold both halves of 16 outputs and the [m, 2n]
// projection is never stored (a 2,048-row gate/up of 2 x 1,536 outputs stores 6 of its 12.6 MB
// and skips silu_and_mul's pass over them). The same bits as the two ops: each half is rounded
// to bfloat16 first, as blocked_linear stores it.
void amx_gemm_silu_and_mul(const Bf16* x, int64_t m, int64_t k, const Bf16* w, int64_t n,
                           Bf16* out) {
  using L = kvserve::simd::Lanes<Bf16>;
  struct GateUpPairs {  // pair p: gate block p and up block p
    const Bf16* w;
    int64_t block_elems, up;
    void load(int64_t, int64_t) const {}
    std::pair<const Bf16*, const Bf16*> operator()(int64_t pair) const {
      const Bf16* gate = w + pair * block_elems;
      return {gate, gate + up};
    }
  };
  const int64_t block_elems = k * kBlock;
  amx_pairs(
      x, m, k, n / kBlock, GateUpPairs{w, block_elems, n / kBlock * block_elems},
      [&](const float* c, int from, int to, int64_t pair, int64_t row) {
        for (int i = from; i < to; ++i) {
          __m512 gate = _mm512_loadu_ps(c + 2 * i * kBlock);
          __m512 up = _mm512_loadu_ps(c + (2 * i + 1) * kBlock);
          kvserve::simd::round_pair(gate, up);  // as blocked_linear stores them
          L::store(out + (row + i) * n + pair * kBlock,
                   kvserve::simd::silu_and_mul<Bf16>(gate, up), 0xffff);
        }
      });
}
#endif  // KVSERVE_AMX

// out = x W^T (+ bias) over the blocks `weight` gives: on AMX tiles where they run, else on the
// AVX-512 register tiles.
template <typename T, typename Blocks>
void gemm(const T* x, int64_t m, int64_t k, const Blocks& weight, int64_t n, const T* bias,
          T* out) {
#ifdef KVSERVE_AMX
  if constexpr (std::is_same_v<T, Bf16>) {
    if (kvserve::amx::runs(k)) {
      amx_gemm(x, m, k, weight, n, bias, out);
      return;
    }
  }
#endif
#ifdef KVSERVE_BLOCKED_FLOAT32
  blocked_gemm<T>(x, m, k, weight, n, bias, out);
#endif
}

// fn(T{}) for the GEMM's element type T of `type`, where this build has a GEMM for it.
template <typename Fn>
void with_gemm_type(at::ScalarType type, const char* name, Fn fn) {
#ifdef KVSERVE_BLOCKED_FLOAT32
  if (type == at::kFloat) return fn(float{});
#endif
#ifdef __AVX512BF16__
  if (type == at::kBFloat16) return fn(at::BFloat16{});
#endif
  TORCH_CHECK(false, name, ": no blocked GEMM for ", type, " on this CPU");
}

// x: contiguous [m, k] rows of the weight's dtype; packed: a weight of at least n outputs.
void check_blocked_input(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == packed.scalar_type(),
              "blocked_linear: contiguous 2-D input of the weight's dtype");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * packed.size(3) == x.size(1) &&
                  packed.size(0) * kBlock >= n,
              "blocked_linear: input width ", x.size(1), " does not match the packed weight");
}

}  // namespace

namespace kvserve {

bool amx_in_use() {
#ifdef KVSERVE_AMX
  return amx::ready();
#else
  return false;
#endif
}

bool gemm_supports(const at::Tensor& w) {
  switch (w.scalar_type()) {
#ifdef KVSERVE_BLOCKED_FLOAT32
    case at::kFloat: return w.dim() == 2;
#endif
#ifdef __AVX512BF16__
    case at::kBFloat16: return w.dim() == 2 && w.size(1) % 2 == 0;
#endif
    default: return false;
  }
}

// The rows of `shards` ([n_i, k] each, in order: a fused layer's checkpoint tensors) ->
// [ceil(n / 16), k / step, 16, step] in `dtype`, outputs padded with zeros. One pass over
// 4-byte units (a float, or a bfloat16 pair) read where the shards lie: a model's load writes
// every weight once into fresh memory, where staging the fused rows, zero-filling and then
// permuting took 2-3x the time. bfloat16 shards of a float32 model widen in the same pass
// (a bfloat16 is a float32's upper half), so the checkpoint is never converted on its own.
at::Tensor pack_weight(const std::vector<at::Tensor>& shards,
                       c10::ScalarType dtype) {
  TORCH_CHECK(!shards.empty(), "pack_weight: no shards");
  const auto source = shards.front().scalar_type();
  const int64_t k = shards.front().size(1);
  auto packed_options = shards.front().options().dtype(dtype);
  TORCH_CHECK(gemm_supports(at::empty({0, k}, packed_options)),
              "pack_weight: no blocked GEMM for this weight on this CPU");
  const bool widen = source == at::kBFloat16 && dtype == at::kFloat;
  TORCH_CHECK(source == dtype || widen, "pack_weight: cannot pack ", source, " as ", dtype);
  const int64_t step = dtype == at::kBFloat16 ? 2 : 1;
  const int64_t units = k / step;
  std::vector<at::Tensor> contiguous;
  std::vector<const void*> rows;
  for (const auto& shard : shards) {
    TORCH_CHECK(shard.dim() == 2 && shard.size(1) == k && shard.scalar_type() == source,
                "pack_weight: shards of one width and dtype");
    contiguous.push_back(shard.contiguous());
    const auto* base = static_cast<const char*>(contiguous.back().data_ptr());
    const int64_t row_bytes = k * shard.element_size();
    for (int64_t r = 0; r < shard.size(0); ++r) rows.push_back(base + r * row_bytes);
  }
  const int64_t n = static_cast<int64_t>(rows.size()), blocks = (n + kBlock - 1) / kBlock;
  auto packed = at::empty({blocks, units, kBlock, step}, packed_options);
  auto* dst = static_cast<uint32_t*>(packed.data_ptr());
  constexpr int64_t kUnitsPerPass = 256;  // a 16 KiB slice of the block, written in L1
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      uint32_t* block = dst + b * units * kBlock;
      for (int64_t u0 = 0; u0 < units; u0 += kUnitsPerPass) {
        const int64_t u1 = std::min(units, u0 + kUnitsPerPass);
        for (int64_t r = 0; r < kBlock; ++r) {
          const int64_t row = b * kBlock + r;
          if (row >= n) {
            for (int64_t u = u0; u < u1; ++u) block[u * kBlock + r] = 0;
          } else if (widen) {
            const auto* in = static_cast<const uint16_t*>(rows[row]);
            for (int64_t u = u0; u < u1; ++u) block[u * kBlock + r] = uint32_t{in[u]} << 16;
          } else {
            const auto* in = static_cast<const uint32_t*>(rows[row]);
            for (int64_t u = u0; u < u1; ++u) block[u * kBlock + r] = in[u];
          }
        }
      }
    }
  });
  return packed;
}

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                          const c10::optional<at::Tensor>& bias) {
  check_blocked_input(x, packed, n);
  const int64_t m = x.size(0), k = x.size(1);
  auto out = at::empty({m, n}, x.options());
  if (m > 0)
    with_gemm_type(x.scalar_type(), "blocked_linear", [&](auto type) {
      using T = decltype(type);
      gemm<T>(x.data_ptr<T>(), m, k, PackedBlocks<T>{packed.data_ptr<T>(), k * kBlock}, n,
              bias ? bias->data_ptr<T>() : nullptr, out.data_ptr<T>());
    });
  return out;
}

bool dequantized_linear_supports(const at::Tensor& x) {
#ifdef __AVX512F__
  return gemm_supports(x);
#else
  return false;
#endif
}

at::Tensor dequantized_linear(const at::Tensor& x, const at::Tensor& qweight,
                              const at::Tensor& scales, const at::Tensor& zeros,
                              int64_t group, int64_t bits) {
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "dequantized_linear: contiguous 2-D input");
  TORCH_CHECK(bits == 4 || bits == 8, "dequantized_linear: 4 or 8 bits, got ", bits);
  TORCH_CHECK(group % 64 == 0 && k % group == 0 && qweight.size(1) * 8 == k * bits &&
                  qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "dequantized_linear: a [n, k * bits / 8] uint8 weight in groups of a multiple "
              "of 64 input channels for input width ", k);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == n * (k / group),
              "dequantized_linear: float32 scales of [n, k / group]");
  const int64_t zero_row = wxa8_zero_row(zeros, n, k / group, "dequantized_linear");
  auto out = at::empty({m, n}, x.options());
#ifdef __AVX512F__
  if (m > 0)
    with_gemm_type(x.scalar_type(), "dequantized_linear", [&](auto type) {
      using T = decltype(type);
      const auto run = [&](auto width) {
        const dequantize::Blocks<T, decltype(width)::value> weight{
            qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(),
            zero_row, n, k, group};
        gemm<T>(x.data_ptr<T>(), m, k, weight, n, nullptr, out.data_ptr<T>());
      };
      if (bits == 4)
        run(std::integral_constant<int, 4>{});
      else
        run(std::integral_constant<int, 8>{});
    });
#else
  TORCH_CHECK(m == 0, "dequantized_linear: no blocked GEMM on this CPU");
#endif
  return out;
}

// silu(gate) * up of blocked_linear(x, packed, 2 * n) for a packed [gate; up] weight: fused
// into the AMX GEMM's store where the bfloat16 GEMM runs on AMX and n is a multiple of 16, else
// the two ops (the same bits either way).
at::Tensor blocked_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& packed,
                                       int64_t n) {
#ifdef KVSERVE_AMX
  if (x.scalar_type() == at::kBFloat16 && n % kBlock == 0 && x.dim() == 2 &&
      amx::runs(x.size(1))) {
    check_blocked_input(x, packed, 2 * n);
    TORCH_CHECK(packed.size(0) * kBlock == 2 * n,
                "blocked_linear_silu_and_mul: a packed [gate; up] weight of 2 x ", n,
                " outputs, got ", packed.size(0) * kBlock);
    auto out = at::empty({x.size(0), n}, x.options());
    using T = at::BFloat16;
    if (x.size(0) > 0)
      amx_gemm_silu_and_mul(x.data_ptr<T>(), x.size(0), x.size(1), packed.data_ptr<T>(), n,
                            out.data_ptr<T>());
    return out;
  }
#endif
  return silu_and_mul(blocked_linear(x, packed, 2 * n, c10::nullopt));
}

}  // namespace kvserve
