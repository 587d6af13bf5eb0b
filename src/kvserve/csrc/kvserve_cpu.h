// The CPU kernels of one extension (built on first use by kvserve/cpp_extension.py), as the
// tensor-level functions Python calls and the decode stack composes. Files include ATen's
// tensor and the operators they call, and bindings.cpp torch's Python bindings, not
// <torch/extension.h>: its C++ frontend took ~20 s of parsing per file.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace kvserve {

// norm_activation.cpp
at::Tensor add_rms_norm(at::Tensor x, at::Tensor weight, double eps,
                        c10::optional<at::Tensor> residual);
at::Tensor silu_and_mul(at::Tensor gate_up);
at::Tensor rms_norm_heads(const at::Tensor& heads, int64_t num_q_heads,
                          const at::Tensor& q_weight, const at::Tensor& k_weight,
                          double eps);

// gemm.cpp
bool amx_in_use();  // bfloat16 products on AMX tiles (built for them, and granted by the OS)
bool gemm_supports(const at::Tensor& w);
at::Tensor pack_weight(const std::vector<at::Tensor>& shards,
                       c10::ScalarType dtype);
at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                          const c10::optional<at::Tensor>& bias);
at::Tensor blocked_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& packed,
                                       int64_t n);
// x @ W^T for a W4A8/W8A8 weight (wxa8.cpp's [n, k * bits / 8] layout, scales [n, k / group]
// and zeros as wxa8_zero_row takes them), dequantized block by block into the GEMM's packed
// form.
bool dequantized_linear_supports(const at::Tensor& x);  // built for x's dtype
at::Tensor dequantized_linear(const at::Tensor& x, const at::Tensor& qweight,
                              const at::Tensor& scales, const at::Tensor& zeros,
                              int64_t group, int64_t bits);

// wxa8.cpp: the distance between outputs' zero points in zeros, float32 [n, groups], or [1,
// groups] where every output has the same ones (a symmetric layer's): 0 for those, read once
// for all, so a 4-bit layer in groups of 64 channels streams 36 bytes a group and not 40.
// `who` names the caller in the error that a tensor of another shape or type raises.
int64_t wxa8_zero_row(const at::Tensor& zeros, int64_t n, int64_t groups, const char* who);
// x [m, k] float32 times a W4A8/W8A8 weight, activations quantized to int8 per group.
at::Tensor wxa8_matmul(at::Tensor x, at::Tensor packed, at::Tensor scales,
                       at::Tensor zeros, int64_t group, int64_t bits, int64_t gemm_from);
// Whether wxa8_matmul runs `rows` rows of an n-output layer as its GEMM (AVX512-VNNI or AVX2):
// from `gemm_from` rows up (0: from the build's own row count).
bool wxa8_gemm_runs(int64_t rows, int64_t n, int64_t gemm_from);
// wxa8_matmul on AMX's int8 tiles (wxa8_amx_runs: built, granted, and a shape it takes).
bool wxa8_amx_runs(int64_t k, int64_t n, int64_t group);
at::Tensor wxa8_amx_matmul(at::Tensor x, at::Tensor packed, at::Tensor scales,
                           at::Tensor zeros, int64_t group, int64_t bits);
// A W4A8/W8A8 layer (quantization/cpu_kernels.py's WxA8Weight) on x [m, k] of any float dtype:
// x's columns in `input_order` (act-order), then wxa8_matmul (its GEMM from `gemm_from` rows
// up), wxa8_amx_matmul from `amx_from` rows up, or dequantized_linear from `dequantized_from`
// rows up (0: never); the output in x's dtype.
at::Tensor wxa8_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& scales, const at::Tensor& zeros,
                       const c10::optional<at::Tensor>& input_order, int64_t group,
                       int64_t bits, int64_t amx_from, int64_t dequantized_from,
                       int64_t gemm_from);

// paged_decode.cpp
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kv_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens,
                                  double scale, int64_t window, double softcap);
at::Tensor rotate_cache_and_decode(at::Tensor qk, at::Tensor v, at::Tensor rotation,
                                   at::Tensor slot_mapping, at::Tensor kv_cache,
                                   at::Tensor block_tables, at::Tensor seq_lens,
                                   double scale, int64_t window, bool rows_share_sequences,
                                   double softcap);
at::Tensor rotate_and_cache(at::Tensor qk, at::Tensor v, at::Tensor rotation,
                            at::Tensor slot_mapping, at::Tensor kv_cache);

// prefill_attention.cpp
bool prefill_attention_supports(const at::Tensor& q);  // built for q's dtype
at::Tensor prefill_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_ids,
                             int64_t ctx, double scale, int64_t window,
                             c10::optional<at::Tensor> positions,
                             c10::optional<at::Tensor> out, double softcap);

// token_mask.cpp
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask,
                         const at::Tensor& rows);

// cache_lines.cpp: t's bytes dropped from every cache level (clflush).
void evict_from_caches(const at::Tensor& t);

// logits.cpp
at::Tensor greedy_tokens(const at::Tensor& logits);
bool logsumexp_and_greater_supported();  // built with AVX-512
std::tuple<at::Tensor, at::Tensor> logsumexp_and_greater(const at::Tensor& logits,
                                                         const at::Tensor& thresholds);

// moe_routing.cpp: each row's top_k experts by router logits [rows, experts] and their softmax
// weights (renormalized over the top_k where the model says so): weights [rows, top_k] in the
// logits' dtype, expert ids [rows, top_k] int64.
std::tuple<at::Tensor, at::Tensor> route_experts(const at::Tensor& logits, int64_t top_k,
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
  at::Tensor weight;
  Kind kind = Kind::kBlocked;
  int64_t bits = 0;
  c10::optional<at::Tensor> scales, zeros, input_order;
  int64_t group = 0, amx_from = 0, dequantized_from = 0;  // 0: never
  int64_t gemm_from = 0;  // 0: the build's own row count (wxa8_gemm_runs)

  at::Tensor operator()(const at::Tensor& x, int64_t n,
                        const c10::optional<at::Tensor>& bias) const;
  // silu(gate) * up of this [gate; up] layer with n outputs each.
  at::Tensor silu_and_mul(const at::Tensor& x, int64_t n) const;
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
at::Tensor wxa8_experts(const at::Tensor& x, const std::vector<const LinearWeights*>& layers,
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

  at::Tensor operator()(const at::Tensor& x, int64_t hidden_size) const;

 private:
  at::Tensor expert(int64_t e, const at::Tensor& rows, int64_t hidden_size) const;
  at::Tensor one_row(const at::Tensor& x, const at::Tensor& weights,
                     const at::Tensor& experts, int64_t hidden_size) const;
  at::Tensor many_rows(const at::Tensor& x, const at::Tensor& weights,
                       const at::Tensor& experts, int64_t hidden_size) const;
};

// One Llama-family decoder layer's weights: its MLP dense (gate_up, down) or experts (moe).
struct DecoderLayerWeights {
  at::Tensor input_norm;
  LinearWeights qkv, o;
  at::Tensor post_norm;
  c10::optional<LinearWeights> gate_up, down;
  c10::optional<at::Tensor> qkv_bias, q_norm, k_norm;  // q/k norms: Qwen3's per-head ones
  c10::optional<MoEWeights> moe;
  // Gemma's norms before and after the MLP, where post_norm norms attention's output.
  c10::optional<at::Tensor> pre_mlp_norm, post_mlp_norm;
  bool full_attention = false;  // Gemma's global layers: no sliding window
  bool local_rotation = false;  // Gemma 3's local layers: the stack's second rotation
};

// A decode-only step through every decoder layer in one call (see llama_decode.cpp).
class LlamaDecodeStack {
 public:
  LlamaDecodeStack(std::vector<DecoderLayerWeights> layers, at::Tensor final_norm,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t intermediate_size, double eps, double scale, bool gelu,
                   double softcap);
  at::Tensor forward(at::Tensor x, const at::Tensor& rotation,
                     const at::Tensor& slot_mapping,
                     const std::vector<at::Tensor>& kv_caches,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     int64_t window, bool rows_share_sequences,
                     const c10::optional<at::Tensor>& local_rotation) const;

 private:
  at::Tensor mlp(const DecoderLayerWeights& layer, const at::Tensor& x) const;

  std::vector<DecoderLayerWeights> layers_;
  at::Tensor final_norm_;
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_size_, intermediate_size_;
  double eps_, scale_;
  bool gelu_;  // the MLP's activation: GELU's tanh approximation (Gemma's), else SiLU
  double softcap_;  // Gemma 2's attention logit softcapping; 0: none
};

}  // namespace kvserve
