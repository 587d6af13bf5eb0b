// The CPU kernels of one extension (built on first use by kvserve/cpp_extension.py), as the
// tensor-level functions Python calls and the decode stack composes.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace kvserve {

// norm_activation.cpp
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                           c10::optional<torch::Tensor> residual);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor rms_norm_heads(const torch::Tensor& heads, int64_t num_q_heads,
                             const torch::Tensor& q_weight, const torch::Tensor& k_weight,
                             double eps);

// gemm.cpp
bool amx_in_use();  // bfloat16 products on AMX tiles (built for them, and granted by the OS)
bool gemm_supports(const torch::Tensor& w);
torch::Tensor pack_weight(const std::vector<torch::Tensor>& shards,
                          c10::ScalarType dtype);
torch::Tensor blocked_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                             const c10::optional<torch::Tensor>& bias);
torch::Tensor blocked_linear_silu_and_mul(const torch::Tensor& x, const torch::Tensor& packed,
                                          int64_t n);
// x @ W^T for a W4A8/W8A8 weight (wxa8.cpp's [n, k * bits / 8] layout, scales [n, k / group]
// and zeros as wxa8_zero_row takes them), dequantized block by block into the GEMM's packed
// form.
bool dequantized_linear_supports(const torch::Tensor& x);  // built for x's dtype
torch::Tensor dequantized_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                                 const torch::Tensor& scales, const torch::Tensor& zeros,
                                 int64_t group, int64_t bits);

// wxa8.cpp: the distance between outputs' zero points in zeros, float32 [n, groups], or [1,
// groups] where every output has the same ones (a symmetric layer's): 0 for those, read once
// for all, so a 4-bit layer in groups of 64 channels streams 36 bytes a group and not 40.
// `who` names the caller in the error that a tensor of another shape or type raises.
int64_t wxa8_zero_row(const torch::Tensor& zeros, int64_t n, int64_t groups, const char* who);
// x [m, k] float32 times a W4A8/W8A8 weight, activations quantized to int8 per group.
torch::Tensor wxa8_matmul(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          torch::Tensor zeros, int64_t group, int64_t bits, int64_t gemm_from);
// Whether wxa8_matmul runs `rows` rows of an n-output layer as its GEMM (AVX512-VNNI or AVX2):
// from `gemm_from` rows up (0: from the build's own row count).
bool wxa8_gemm_runs(int64_t rows, int64_t n, int64_t gemm_from);
// wxa8_matmul on AMX's int8 tiles (wxa8_amx_runs: built, granted, and a shape it takes).
bool wxa8_amx_runs(int64_t k, int64_t n, int64_t group);
torch::Tensor wxa8_amx_matmul(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                              torch::Tensor zeros, int64_t group, int64_t bits);
// A W4A8/W8A8 layer (quantization/cpu_kernels.py's WxA8Weight) on x [m, k] of any float dtype:
// x's columns in `input_order` (act-order), then wxa8_matmul (its GEMM from `gemm_from` rows
// up), wxa8_amx_matmul from `amx_from` rows up, or dequantized_linear from `dequantized_from`
// rows up (0: never); the output in x's dtype.
torch::Tensor wxa8_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& zeros,
                          const c10::optional<torch::Tensor>& input_order, int64_t group,
                          int64_t bits, int64_t amx_from, int64_t dequantized_from,
                          int64_t gemm_from);

// paged_decode.cpp
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     double scale, int64_t window);
torch::Tensor rotate_cache_and_decode(torch::Tensor qk, torch::Tensor v, torch::Tensor rotation,
                                      torch::Tensor slot_mapping, torch::Tensor kv_cache,
                                      torch::Tensor block_tables, torch::Tensor seq_lens,
                                      double scale, int64_t window, bool rows_share_sequences);
torch::Tensor rotate_and_cache(torch::Tensor qk, torch::Tensor v, torch::Tensor rotation,
                               torch::Tensor slot_mapping, torch::Tensor kv_cache);

// prefill_attention.cpp
bool prefill_attention_supports(const torch::Tensor& q);  // built for q's dtype
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_ids,
                                int64_t ctx, double scale, int64_t window,
                                c10::optional<torch::Tensor> positions,
                                c10::optional<torch::Tensor> out);

// token_mask.cpp
void apply_token_bitmask(torch::Tensor logits, const torch::Tensor& bitmask,
                         const torch::Tensor& rows);

// cache_lines.cpp: t's bytes dropped from every cache level (clflush).
void evict_from_caches(const torch::Tensor& t);

// logits.cpp
torch::Tensor greedy_tokens(const torch::Tensor& logits);
bool logsumexp_and_greater_supported();  // built with AVX-512
std::tuple<torch::Tensor, torch::Tensor> logsumexp_and_greater(const torch::Tensor& logits,
                                                               const torch::Tensor& thresholds);

// moe_routing.cpp: each row's top_k experts by router logits [rows, experts] and their softmax
// weights (renormalized over the top_k where the model says so): weights [rows, top_k] in the
// logits' dtype, expert ids [rows, top_k] int64.
std::tuple<torch::Tensor, torch::Tensor> route_experts(const torch::Tensor& logits, int64_t top_k,
                                                       bool renormalize);

// llama_decode.cpp: a linear layer of the decode stack, run as the eager forward runs it, on
// any kernel the CPU runs quantized layers on (quantization/cpu_kernels.py), so that which one
// a layer's timing picks never takes a model off the stack.
struct LinearWeights {
  enum class Kind {
    kBlocked,  // weight: packed by pack_weight
    kWxA8,     // weight [n, k * bits / 8] uint8, scales, zeros: on wxa8_linear
    kInt4,     // weight packed by torch's int4 CPU kernel, scales: its scales and zeros
    kInt8,     // weight [n, k] int8, scales [n] bfloat16, zeros: the zero terms (if any)
  };
  torch::Tensor weight;
  Kind kind = Kind::kBlocked;
  int64_t bits = 0;
  c10::optional<torch::Tensor> scales, zeros, input_order;
  int64_t group = 0, amx_from = 0, dequantized_from = 0;  // 0: never
  int64_t gemm_from = 0;  // 0: the build's own row count (wxa8_gemm_runs)

  torch::Tensor operator()(const torch::Tensor& x, int64_t n,
                           const c10::optional<torch::Tensor>& bias) const;
  // silu(gate) * up of this [gate; up] layer with n outputs each.
  torch::Tensor silu_and_mul(const torch::Tensor& x, int64_t n) const;
};

// wxa8.cpp: whether `rows` rows through a layer go to the few-rows W4A8/W8A8 kernel in
// wxa8_linear: neither to AMX, the integer GEMM nor the dequantizing GEMM, without act-order.
bool wxa8_few_rows_run(const LinearWeights& layer, int64_t rows);
// Rows [starts[e], starts[e] + counts[e]) of x [m, k] through layers[e], as wxa8_linear runs
// them, one layer's rows after another: [sum of counts, n] in x's dtype. A step's experts, each
// a few microseconds of work over a row or a few, in one call: the rows quantized once, and one
// parallel region for all. It takes layers of one shape, group and width whose rows each go to
// the few-rows kernel (wxa8_experts_run).
bool wxa8_experts_run(const std::vector<const LinearWeights*>& layers,
                      const std::vector<int64_t>& counts);
torch::Tensor wxa8_experts(const torch::Tensor& x, const std::vector<const LinearWeights*>& layers,
                           const std::vector<int64_t>& starts, const std::vector<int64_t>& counts);

// A mixture-of-experts MLP's weights, run as models/moe.py runs them.
struct MoEWeights {
  LinearWeights router;
  std::vector<LinearWeights> gate_up, down;  // each expert's
  int64_t top_k = 0, intermediate_size = 0;
  bool renormalize = false;
  // Qwen2-MoE's shared expert and its sigmoid gate (shared_intermediate_size 0: none).
  c10::optional<LinearWeights> shared_gate_up, shared_down, shared_gate;
  int64_t shared_intermediate_size = 0;

  torch::Tensor operator()(const torch::Tensor& x, int64_t hidden_size) const;

 private:
  torch::Tensor expert(int64_t e, const torch::Tensor& rows, int64_t hidden_size) const;
  torch::Tensor one_row(const torch::Tensor& x, const torch::Tensor& weights,
                        const torch::Tensor& experts, int64_t hidden_size) const;
  torch::Tensor many_rows(const torch::Tensor& x, const torch::Tensor& weights,
                          const torch::Tensor& experts, int64_t hidden_size) const;
};

// One Llama-family decoder layer's weights: its MLP dense (gate_up, down) or experts (moe).
struct DecoderLayerWeights {
  torch::Tensor input_norm;
  LinearWeights qkv, o;
  torch::Tensor post_norm;
  c10::optional<LinearWeights> gate_up, down;
  c10::optional<torch::Tensor> qkv_bias, q_norm, k_norm;  // q/k norms: Qwen3's per-head ones
  c10::optional<MoEWeights> moe;
};

// A decode-only step through every decoder layer in one call (see llama_decode.cpp).
class LlamaDecodeStack {
 public:
  LlamaDecodeStack(std::vector<DecoderLayerWeights> layers, torch::Tensor final_norm,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t intermediate_size, double eps, double scale);
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& rotation,
                        const torch::Tensor& slot_mapping,
                        const std::vector<torch::Tensor>& kv_caches,
                        const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                        int64_t window, bool rows_share_sequences) const;

 private:
  std::vector<DecoderLayerWeights> layers_;
  torch::Tensor final_norm_;
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_size_, intermediate_size_;
  double eps_, scale_;
};

}  // namespace kvserve
