// A Llama-family decode step (one new token per sequence) through all decoder layers in one
// call: the same kernels, in the same order, as the eager forward of models/llama.py (and
// models/moe.py for experts), so the hidden states are bit for bit the same. What it saves is
// the Python between them: a batch-1 step of a 30-layer model issues about 300 kernel calls,
// and from Python each costs more than the small kernel itself (a third of the step on a
// 2-core EPYC).
#include "kvserve_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <utility>

namespace kvserve {

// The quantized kinds as Int4Weight.matmul, Int8Weight.matmul and WxA8Weight.matmul run them.
at::Tensor LinearWeights::operator()(const at::Tensor& x, int64_t n,
                                     const c10::optional<at::Tensor>& bias) const {
  at::Tensor out;
  switch (kind) {
    case Kind::kBlocked:
      return blocked_linear(x, weight, n, bias);
    case Kind::kWxA8:
      out = wxa8_linear(x, weight, *scales, *zeros, input_order, group, bits, amx_from,
                        dequantized_from, gemm_from);
      break;
    case Kind::kInt4: {
      const at::Tensor rows = x.to(at::kBFloat16);
      out = at::_weight_int4pack_mm_for_cpu(
                (input_order ? rows.index_select(1, *input_order) : rows).contiguous(), weight,
                group, *scales)
                .to(x.scalar_type());
      break;
    }
    case Kind::kInt8: {
      const at::Tensor rows = x.to(at::kBFloat16);
      out = at::_weight_int8pack_mm(rows, weight, *scales);
      if (zeros) out = out.to(at::kFloat) - rows.to(at::kFloat).sum(1, true) * *zeros;
      out = out.to(x.scalar_type());
      break;
    }
  }
  return bias ? out + *bias : out;
}

at::Tensor LinearWeights::silu_and_mul(const at::Tensor& x, int64_t n) const {
  return kind == Kind::kBlocked ? blocked_linear_silu_and_mul(x, weight, n)
                                : kvserve::silu_and_mul((*this)(x, 2 * n, c10::nullopt));
}

namespace {

// out's rows plus each (row, expert) pair's output row times its router weight, the pairs in
// the order given, as index_add_(0, picked, outputs * scales) adds them expert by expert (or
// add_ for one row): each product rounded to out's dtype, then added in a pass of its own, so
// that no product is contracted into a fused multiply-add. pairs[i] is the i-th pair's index
// in weights [rows, top_k] (its row: pairs[i] / top_k), outputs[i] its output row, scaled in
// place. Columns split among threads from 32K products a thread: a batch-1 decode's few
// experts stay on one.
void add_weighted_rows(const at::Tensor& out, const at::Tensor& weights,
                       const std::vector<int64_t>& pairs, const std::vector<void*>& outputs) {
  TORCH_CHECK(weights.scalar_type() == out.scalar_type(), "MoEWeights: router weights in ",
              weights.scalar_type(), ", outputs in ", out.scalar_type());
  const at::Tensor by_pair = weights.contiguous();
  const int64_t count = static_cast<int64_t>(pairs.size()), n = out.size(1),
                top_k = by_pair.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out.scalar_type(), "add_weighted_rows", [&] {
    scalar_t* sum = out.data_ptr<scalar_t>();
    const scalar_t* scale = by_pair.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(64, 32768 / std::max<int64_t>(count, 1));
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = 0; i < count; ++i) {
        scalar_t* output = static_cast<scalar_t*>(outputs[i]);
        const scalar_t w = scale[pairs[i]];
        for (int64_t c = begin; c < end; ++c) output[c] = output[c] * w;
      }
      for (int64_t i = 0; i < count; ++i) {
        const scalar_t* output = static_cast<const scalar_t*>(outputs[i]);
        scalar_t* into = sum + pairs[i] / top_k * n;
        for (int64_t c = begin; c < end; ++c) into[c] = into[c] + output[c];
      }
    });
  });
}

// A step's (row, expert) pairs sorted by expert, stably (as torch's stable argsort sorts
// them): each pair's index in the router's [rows, top_k] outputs, each expert's count of rows,
// and x's rows gathered in that order. One counting pass in place of torch's argsort, bincount
// and gathers: a 64-expert layer of 2-8 rows took 0.91-0.96x the time on a 2-core AVX-512 EPYC.
struct SortedPairs {
  std::vector<int64_t> pairs, counts;
  at::Tensor gathered;  // [pairs, hidden], x's dtype
};

SortedPairs sort_pairs(const at::Tensor& x, const at::Tensor& experts,
                       int64_t num_experts) {
  const at::Tensor in = x.contiguous(), ids = experts.contiguous();
  const int64_t top_k = ids.size(1), count = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  SortedPairs sorted{std::vector<int64_t>(count), std::vector<int64_t>(num_experts, 0),
                     at::empty({count, in.size(1)}, in.options())};
  for (int64_t p = 0; p < count; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "MoEWeights: expert ", id[p], " of ",
                num_experts);
    ++sorted.counts[id[p]];
  }
  std::vector<int64_t> next(num_experts, 0);
  std::partial_sum(sorted.counts.begin(), sorted.counts.end() - 1, next.begin() + 1);
  for (int64_t p = 0; p < count; ++p) sorted.pairs[next[id[p]]++] = p;
  const int64_t row_bytes = in.size(1) * in.element_size();
  const char* row = static_cast<const char*>(in.data_ptr());
  char* gathered = static_cast<char*>(sorted.gathered.data_ptr());
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t at = begin; at < end; ++at)
      std::memcpy(gathered + at * row_bytes, row + sorted.pairs[at] / top_k * row_bytes,
                  row_bytes);
  });
  return sorted;
}

}  // namespace

at::Tensor MoEWeights::operator()(const at::Tensor& x, int64_t hidden_size) const {
  const auto [weights, experts] = route_experts(
      router(x, static_cast<int64_t>(gate_up.size()), c10::nullopt), top_k, renormalize);
  at::Tensor out = x.size(0) == 1 ? one_row(x, weights, experts, hidden_size)
                                     : many_rows(x, weights, experts, hidden_size);
  if (shared_intermediate_size) {
    out += at::sigmoid((*shared_gate)(x, 1, c10::nullopt)) *
           (*shared_down)(shared_gate_up->silu_and_mul(x, shared_intermediate_size),
                          hidden_size, c10::nullopt);
  }
  return out;
}

at::Tensor MoEWeights::expert(int64_t e, const at::Tensor& rows,
                              int64_t hidden_size) const {
  return down[e](gate_up[e].silu_and_mul(rows, intermediate_size), hidden_size, c10::nullopt);
}

// One row (a batch-1 decode) takes its experts in the router's order sorted by expert, with
// no sorting, gathering or scattering: the same ops on the same values, a third of the calls;
// on W4A8/W8A8 weights, all its experts' gate_up in one call and all their down in another
// (wxa8_experts), each output times its weight, then their sum in the same order.
at::Tensor MoEWeights::one_row(const at::Tensor& x, const at::Tensor& weights,
                               const at::Tensor& experts, int64_t hidden_size) const {
  const int64_t* ids = experts.data_ptr<int64_t>();
  std::vector<int64_t> order(top_k);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  std::vector<const LinearWeights*> ups, downs;
  for (const int64_t j : order) {
    ups.push_back(&gate_up[ids[j]]);
    downs.push_back(&down[ids[j]]);
  }
  const std::vector<int64_t> ones(top_k, 1), firsts(top_k, 0);
  if (wxa8_experts_run(ups, ones) && wxa8_experts_run(downs, ones)) {
    std::vector<int64_t> each(top_k);
    std::iota(each.begin(), each.end(), 0);
    const at::Tensor outputs = wxa8_experts(
        kvserve::silu_and_mul(wxa8_experts(x, ups, firsts, ones)), downs, each, ones);
    std::vector<void*> rows;
    for (int64_t j = 0; j < top_k; ++j)
      rows.push_back(static_cast<char*>(outputs.data_ptr()) + j * outputs.stride(0) *
                                                                  outputs.element_size());
    at::Tensor out = at::zeros_like(x);
    add_weighted_rows(out, weights, order, rows);
    return out;
  }
  at::Tensor out = at::zeros_like(x);
  for (const int64_t j : order) out.add_(expert(ids[j], x, hidden_size) * weights.narrow(1, j, 1));
  return out;
}

// Many rows: the (row, expert) pairs sorted by expert, each expert run over its rows' gathered
// inputs, its outputs scaled by the router's weights and added into their rows in that order.
// Experts whose rows all go to the W4A8/W8A8 few-rows kernel (a decode batch spreads a few
// rows over most experts) run in one wxa8_experts call for gate_up and one for down, the
// others one by one. On a 2-core AVX-512 EPYC, a 64-expert layer's 8 rows took 0.83 ms this
// way, and 2.15 with a call an expert and torch ops to gather, scale and add.
at::Tensor MoEWeights::many_rows(const at::Tensor& x, const at::Tensor& weights,
                                 const at::Tensor& experts, int64_t hidden_size) const {
  const int64_t num_experts = static_cast<int64_t>(gate_up.size());
  const SortedPairs sorted = sort_pairs(x, experts, num_experts);
  const int64_t* count = sorted.counts.data();
  std::vector<const LinearWeights*> ups, downs;
  std::vector<int64_t> starts, few_counts;
  for (int64_t e = 0, start = 0; e < num_experts; start += count[e++]) {
    if (count[e] && wxa8_few_rows_run(gate_up[e], count[e]) &&
        wxa8_few_rows_run(down[e], count[e])) {
      ups.push_back(&gate_up[e]);
      downs.push_back(&down[e]);
      starts.push_back(start);
      few_counts.push_back(count[e]);
    }
  }
  if (!wxa8_experts_run(ups, few_counts) || !wxa8_experts_run(downs, few_counts))
    starts.clear();  // none together
  at::Tensor together;
  if (!starts.empty()) {
    std::vector<int64_t> outputs(few_counts.size(), 0);
    std::partial_sum(few_counts.begin(), few_counts.end() - 1, outputs.begin() + 1);
    together = wxa8_experts(
        kvserve::silu_and_mul(wxa8_experts(sorted.gathered, ups, starts, few_counts)), downs,
        outputs, few_counts);
  }
  // Each pair's output row, in expert order: from `together`, or from its expert's own call.
  std::vector<at::Tensor> alone;
  std::vector<void*> pair_outputs;
  const int64_t row_bytes = hidden_size * x.element_size();
  char* next_together = starts.empty() ? nullptr : static_cast<char*>(together.data_ptr());
  for (int64_t e = 0, start = 0, f = 0; e < num_experts; start += count[e++]) {
    if (count[e] == 0) continue;
    char* first;
    if (f < static_cast<int64_t>(starts.size()) && starts[f] == start) {
      first = next_together;
      next_together += count[e] * row_bytes;
      ++f;
    } else {
      alone.push_back(
          expert(e, sorted.gathered.narrow(0, start, count[e]), hidden_size).contiguous());
      TORCH_CHECK(alone.back().scalar_type() == x.scalar_type(), "MoEWeights: expert ", e,
                  "'s outputs in ", alone.back().scalar_type(), ", its inputs in ",
                  x.scalar_type());
      first = static_cast<char*>(alone.back().data_ptr());
    }
    for (int64_t j = 0; j < count[e]; ++j) pair_outputs.push_back(first + j * row_bytes);
  }
  at::Tensor out = at::zeros_like(x);
  add_weighted_rows(out, weights, sorted.pairs, pair_outputs);
  return out;
}

LlamaDecodeStack::LlamaDecodeStack(std::vector<DecoderLayerWeights> layers,
                                   at::Tensor final_norm, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim,
                                   int64_t intermediate_size, double eps, double scale,
                                   bool gelu, double softcap)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), num_heads_(num_heads),
      num_kv_heads_(num_kv_heads), head_dim_(head_dim), hidden_size_(final_norm_.numel()),
      intermediate_size_(intermediate_size), eps_(eps), scale_(scale), gelu_(gelu),
      softcap_(softcap) {
  TORCH_CHECK(!layers_.empty(), "LlamaDecodeStack: no layers");
}

// The layer's MLP (or experts) on its normed input, as models/mlp.py computes it: GELU on
// the [gate | up] output's halves, or SiLU fused into the GEMM.
at::Tensor LlamaDecodeStack::mlp(const DecoderLayerWeights& layer, const at::Tensor& x) const {
  if (layer.moe) return (*layer.moe)(x, hidden_size_);
  const int64_t n = intermediate_size_;
  at::Tensor gated;
  if (gelu_) {
    const at::Tensor both = (*layer.gate_up)(x, 2 * n, c10::nullopt);
    gated = at::gelu(both.narrow(1, 0, n), "tanh") * both.narrow(1, n, n);
  } else {
    gated = layer.gate_up->silu_and_mul(x, n);
  }
  return (*layer.down)(gated, hidden_size_, c10::nullopt);
}

// x: [B, hidden] embeddings (used as the residual stream, updated in place); rotation:
// [B, D / 2, 2] float32, and local_rotation likewise for the layers with `local_rotation`;
// kv_caches: each layer's [2, Hkv, blocks, block_size, D] pool; rows_share_sequences: as in
// rotate_cache_and_decode. Returns the final norm's output [B, hidden].
at::Tensor LlamaDecodeStack::forward(at::Tensor x, const at::Tensor& rotation,
                                     const at::Tensor& slot_mapping,
                                     const std::vector<at::Tensor>& kv_caches,
                                     const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, int64_t window,
                                     bool rows_share_sequences,
                                     const c10::optional<at::Tensor>& local_rotation) const {
  TORCH_CHECK(kv_caches.size() == layers_.size(), "LlamaDecodeStack: ", layers_.size(),
              " layers, ", kv_caches.size(), " KV caches");
  const int64_t rows = x.size(0), qk_heads = num_heads_ + num_kv_heads_;
  const int64_t qkv_size = (qk_heads + num_kv_heads_) * head_dim_;
  at::Tensor residual = x;
  at::Tensor normed = add_rms_norm(x, layers_[0].input_norm, eps_, c10::nullopt);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayerWeights& layer = layers_[i];
    if (i > 0) normed = add_rms_norm(x, layer.input_norm, eps_, residual);
    const at::Tensor heads =
        layer.qkv(normed, qkv_size, layer.qkv_bias).view({rows, -1, head_dim_});
    at::Tensor qk = heads.narrow(1, 0, qk_heads);
    if (layer.q_norm && layer.k_norm)  // each head's row normed, as models/llama.py does
      qk = rms_norm_heads(qk, num_heads_, *layer.q_norm, *layer.k_norm, eps_);
    TORCH_CHECK(!layer.local_rotation || local_rotation,
                "LlamaDecodeStack: layer ", i, " turns by a local rotation, none given");
    const at::Tensor attention = rotate_cache_and_decode(
        qk, heads.narrow(1, qk_heads, num_kv_heads_),
        layer.local_rotation ? *local_rotation : rotation, slot_mapping, kv_caches[i],
        block_tables, seq_lens, scale_, layer.full_attention ? 0 : window,
        rows_share_sequences, softcap_);
    const at::Tensor out = layer.o(attention.view({rows, -1}), hidden_size_, c10::nullopt);
    if (layer.pre_mlp_norm) {
      normed = add_rms_norm(add_rms_norm(out, layer.post_norm, eps_, c10::nullopt),
                            *layer.pre_mlp_norm, eps_, residual);
    } else {
      normed = add_rms_norm(out, layer.post_norm, eps_, residual);
    }
    x = mlp(layer, normed);
    if (layer.post_mlp_norm) x = add_rms_norm(x, *layer.post_mlp_norm, eps_, c10::nullopt);
  }
  return add_rms_norm(x, final_norm_, eps_, residual);
}

}  // namespace kvserve
