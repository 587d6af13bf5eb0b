// The Python module of the CPU kernels. No binding touches a Python object while it computes,
// so each releases the GIL: other threads (the HTTP server) run meanwhile.
#include "kvserve_cpu.h"

#include <torch/python.h>

namespace py = pybind11;
using kvserve::DecoderLayerWeights;
using kvserve::LinearWeights;
using kvserve::LlamaDecodeStack;
using kvserve::MoEWeights;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def("add_rms_norm", &kvserve::add_rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("residual") = py::none(), release,
        "RMSNorm of x's rows, after adding x to `residual` in place when one is given");
  m.def("rms_norm_heads", &kvserve::rms_norm_heads, py::arg("heads"), py::arg("num_q_heads"),
        py::arg("q_weight"), py::arg("k_weight"), py::arg("eps"), release,
        "each head's row of [rows, heads, head_dim] RMS-normed, by q_weight for the first "
        "num_q_heads and by k_weight after");
  m.def("silu_and_mul", &kvserve::silu_and_mul, release, "silu(gate) * up of [gate | up] rows");
  m.def("gemm_supports", &kvserve::gemm_supports,
        "whether this CPU build has a blocked GEMM for the weight");
  m.def("amx_in_use", &kvserve::amx_in_use,
        "whether bfloat16 GEMMs and prefill attention run on AMX tiles");
  m.def("pack_weight", &kvserve::pack_weight,
        "a weight's row blocks [n_i, k], in order -> 16-output blocks in dtype (bfloat16 "
        "rows widen to float32)");
  m.def("blocked_linear", &kvserve::blocked_linear, release,
        "x @ W^T (+ bias) over a packed weight");
  m.def("blocked_linear_silu_and_mul", &kvserve::blocked_linear_silu_and_mul, release,
        "silu(gate) * up of x @ [W_gate; W_up]^T over a packed weight, n outputs");
  m.def("dequantized_linear_supports", &kvserve::dequantized_linear_supports,
        "whether this CPU build has dequantized_linear for x's dtype");
  m.def("dequantized_linear", &kvserve::dequantized_linear, release,
        "x @ W^T for a W4A8/W8A8 weight, dequantized block by block into the GEMM's tiles");
  // softcap > 0: each score s becomes softcap * tanh(s / softcap) (Gemma 2's).
  m.def("paged_decode_attention", &kvserve::paged_decode_attention, py::arg("q"),
        py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("window"), py::arg("softcap") = 0.0, release);
  m.def("rotate_cache_and_decode", &kvserve::rotate_cache_and_decode, py::arg("qk"),
        py::arg("v"), py::arg("rotation"), py::arg("slot_mapping"), py::arg("kv_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("window"),
        py::arg("rows_share_sequences"), py::arg("softcap") = 0.0, release);
  m.def("rotate_and_cache", &kvserve::rotate_and_cache, release,
        "rotary and cache write of rotate_cache_and_decode, without the attention; the queries "
        "are rotated in place");
  m.def("prefill_attention_supports", &kvserve::prefill_attention_supports,
        "whether this CPU build has prefill_attention for q's dtype");
  m.def("prefill_attention", &kvserve::prefill_attention, py::arg("q"), py::arg("kv_cache"),
        py::arg("block_ids"), py::arg("ctx"), py::arg("scale"), py::arg("window"),
        py::arg("positions") = py::none(), py::arg("out") = py::none(),
        py::arg("softcap") = 0.0, release,
        "causal attention of a prefill chunk (or of some of its positions) over its context");
  m.def("apply_token_bitmask", &kvserve::apply_token_bitmask, release,
        "-inf, in place, for the tokens a grammar's bitmask row leaves out");
  m.def("evict_from_caches", &kvserve::evict_from_caches, release,
        "drops a contiguous tensor's bytes from every cache level");
  m.def("greedy_tokens", &kvserve::greedy_tokens, release,
        "each row's torch.argmax of [rows, vocab] float32 logits");
  m.def("logsumexp_and_greater_supported", &kvserve::logsumexp_and_greater_supported,
        "whether this CPU build has logsumexp_and_greater");
  m.def("logsumexp_and_greater", &kvserve::logsumexp_and_greater, release,
        "each row's logsumexp, and how many of its logits exceed the row's threshold");
  m.def("route_experts", &kvserve::route_experts, py::arg("logits"), py::arg("top_k"),
        py::arg("renormalize"), release,
        "each row's top_k experts and their softmax weights, from router logits");
  m.def("wxa8_matmul", &kvserve::wxa8_matmul, py::arg("x"), py::arg("packed"),
        py::arg("scales"), py::arg("zeros"), py::arg("group"), py::arg("bits"),
        py::arg("gemm_from") = 0, release,
        "x @ W^T for a W4A8/W8A8 weight, x's rows quantized to int8 per group");
  m.def("wxa8_amx_matmul", &kvserve::wxa8_amx_matmul, release,
        "wxa8_matmul on AMX's int8 tiles");
  m.def("wxa8_amx_runs", &kvserve::wxa8_amx_runs, "whether wxa8_amx_matmul runs this shape");
  m.def("wxa8_gemm_runs", &kvserve::wxa8_gemm_runs, py::arg("rows"), py::arg("n"),
        py::arg("gemm_from") = 0, "whether wxa8_matmul runs these rows as its GEMM");
  m.def("wxa8_linear", &kvserve::wxa8_linear, release,
        "a W4A8/W8A8 layer: wxa8_matmul (its GEMM from gemm_from rows up), wxa8_amx_matmul "
        "from amx_from rows up, or dequantized_linear from dequantized_from rows up");
  // Module-local classes: a second build of these kernels (for another instruction set) can
  // load into the same process.
  using Kind = LinearWeights::Kind;
  py::class_<LinearWeights>(m, "LinearWeights", py::module_local())
      .def(py::init([](at::Tensor packed) { return LinearWeights{packed}; }),
           py::arg("packed"))
      .def(py::init([](at::Tensor weight, int64_t bits, at::Tensor scales,
                       at::Tensor zeros, c10::optional<at::Tensor> input_order,
                       int64_t group, int64_t amx_from, int64_t dequantized_from,
                       int64_t gemm_from) {
             return LinearWeights{weight, Kind::kWxA8, bits, scales, zeros, input_order,
                                  group, amx_from, dequantized_from, gemm_from};
           }),
           py::arg("weight"), py::arg("bits"), py::arg("scales"), py::arg("zeros"),
           py::arg("input_order"), py::arg("group"), py::arg("amx_from"),
           py::arg("dequantized_from"), py::arg("gemm_from"))
      .def_static(
          "int4",
          [](at::Tensor packed, at::Tensor scales_and_zeros, int64_t group,
             c10::optional<at::Tensor> input_order) {
            return LinearWeights{packed, Kind::kInt4, 4, scales_and_zeros, c10::nullopt,
                                 input_order, group};
          },
          py::arg("packed"), py::arg("scales_and_zeros"), py::arg("group"),
          py::arg("input_order"))
      .def_static(
          "int8",
          [](at::Tensor weight, at::Tensor scales,
             c10::optional<at::Tensor> zero_terms) {
            return LinearWeights{weight, Kind::kInt8, 8, scales, zero_terms};
          },
          py::arg("weight"), py::arg("scales"), py::arg("zero_terms"));
  py::class_<MoEWeights>(m, "MoEWeights", py::module_local())
      .def(py::init<LinearWeights, std::vector<LinearWeights>, std::vector<LinearWeights>,
                    int64_t, int64_t, bool, c10::optional<LinearWeights>,
                    c10::optional<LinearWeights>, c10::optional<LinearWeights>, int64_t>(),
           py::arg("router"), py::arg("gate_up"), py::arg("down"), py::arg("top_k"),
           py::arg("intermediate_size"), py::arg("renormalize"),
           py::arg("shared_gate_up") = py::none(), py::arg("shared_down") = py::none(),
           py::arg("shared_gate") = py::none(), py::arg("shared_intermediate_size") = 0)
      .def("__call__", &MoEWeights::operator(), py::arg("x"), py::arg("hidden_size"), release,
           "the block's output for x [rows, hidden_size]");
  py::class_<DecoderLayerWeights>(m, "DecoderLayerWeights", py::module_local())
      .def(py::init<at::Tensor, LinearWeights, LinearWeights, at::Tensor,
                    c10::optional<LinearWeights>, c10::optional<LinearWeights>,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                    c10::optional<at::Tensor>, c10::optional<MoEWeights>,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, bool, bool>(),
           py::arg("input_norm"), py::arg("qkv"), py::arg("o"), py::arg("post_norm"),
           py::arg("gate_up"), py::arg("down"), py::arg("qkv_bias") = py::none(),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("moe") = py::none(), py::arg("pre_mlp_norm") = py::none(),
           py::arg("post_mlp_norm") = py::none(), py::arg("full_attention") = false,
           py::arg("local_rotation") = false);
  py::class_<LlamaDecodeStack>(m, "LlamaDecodeStack", py::module_local())
      .def(py::init<std::vector<DecoderLayerWeights>, at::Tensor, int64_t, int64_t, int64_t,
                    int64_t, double, double, bool, double>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("intermediate_size"),
           py::arg("eps"), py::arg("scale"), py::arg("gelu") = false, py::arg("softcap") = 0.0)
      .def("forward", &LlamaDecodeStack::forward, py::arg("x"), py::arg("rotation"),
           py::arg("slot_mapping"), py::arg("kv_caches"), py::arg("block_tables"),
           py::arg("seq_lens"), py::arg("window"), py::arg("rows_share_sequences"),
           py::arg("local_rotation") = py::none(), release);
}
