"""Decode-only steps on CPU as one C++ call through all decoder layers: the CPU counterpart of
CUDA graphs.

A batch-1 decode step of a small model is ~300 short kernel calls; issued from Python, the
calls cost a third of the step. `LlamaDecodeStack` (csrc/llama_decode.cpp) runs the same
kernels in the same order from C++, so the hidden states are bit-identical to the eager
forward. It covers what those kernels cover: a single-rank Llama-family model (Qwen3's per-head
q/k norms and mixture-of-experts MLPs included), every linear on the blocked GEMM or on any of
the CPU's quantized kernels, and the C++ attention backend. Steps with a prefill chunk, and
everything under `enforce_eager`, run the eager forward.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvserve.attention.cpu_paged import CpuPagedAttention
from kvserve.cpp_extension import cpu_kernels
from kvserve.layers.linear import Linear
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.mlp import MLP
from kvserve.models.moe import SparseMoeBlock
from kvserve.quantization.cpu_kernels import Int8Weight, IntegerWeight
from kvserve.quantization.torch_int4 import Int4Weight
from kvserve.worker.input_batch import ModelInputs
from kvserve.worker.tensor_parallel import tp_group


class CpuDecodeStack:
    def __init__(self, model: LlamaForCausalLM, kernels: ModuleType) -> None:
        cfg = model.cfg
        self.model = model
        self.stack = kernels.LlamaDecodeStack(
            [_layer_weights(layer, kernels) for layer in model.layers], model.norm.weight,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.rms_norm_eps, cfg.head_dim ** -0.5)

    @classmethod
    def build(cls, model: torch.nn.Module, enforce_eager: bool) -> CpuDecodeStack | None:
        """The model's stack, unless `enforce_eager`, the kernels did not build, the model
        has layers the stack does not cover, or it is split among ranks (the stack sums no
        partial outputs)."""
        kernels = cpu_kernels()
        if (enforce_eager or kernels is None or tp_group().size > 1
                or not cls.covers(model)):
            return None
        return cls(model, kernels)

    @staticmethod
    def covers(model: torch.nn.Module) -> bool:
        """Whether every layer of `model` runs on the kernels the stack composes."""
        if not isinstance(model, LlamaForCausalLM):
            return False
        for layer in model.layers:
            attn = layer.self_attn
            linears = [attn.qkv_proj, attn.o_proj, *(m for m in layer.mlp.modules()
                                                     if isinstance(m, Linear))]
            if not isinstance(attn.backend, CpuPagedAttention) or attn.head_dim % 16:
                return False
            if not all(_runs(lin) for lin in linears):
                return False
            if any(lin.bias is not None for lin in linears[1:]):  # only QKV has a bias
                return False
        return True

    def run(self, inputs: ModelInputs) -> torch.Tensor | None:
        """Hidden states of a decode-only step, or None for a step with prefill chunks."""
        meta = inputs.attn_metadata
        if meta.prefills:
            return None
        model = self.model
        block_tables, seq_lens = meta.decode_tables(model.layers[0].self_attn.kv_cache.shape[3])
        rotation = torch.view_as_real(model.rotary(inputs.positions)).contiguous()
        return self.stack.forward(
            model.embed_tokens[inputs.input_ids], rotation, meta.slot_mapping,
            [layer.self_attn.kv_cache for layer in model.layers], block_tables.contiguous(),
            seq_lens, meta.sliding_window or 0, meta.decode_rows_share_sequences)


def _runs(linear: Linear) -> bool:
    """Whether the stack runs this linear as its forward does."""
    if linear.kernel is None:
        return linear.form == "blocked"
    return isinstance(linear.kernel, IntegerWeight)


def _linear_weights(linear: Linear, kernels: ModuleType) -> object:
    q = linear.kernel
    if q is None:
        return kernels.LinearWeights(linear.weight)
    if isinstance(q, Int4Weight):
        return kernels.LinearWeights.int4(q.packed, q.scales_and_zeros, q.group_size,
                                          q.input_order)
    if isinstance(q, Int8Weight):
        return kernels.LinearWeights.int8(q.weight, q.scales, q.zero_terms)
    return kernels.LinearWeights(q.packed, q.bits, q.scales, q.zeros, q.input_order,
                                 q.group_size, q.amx_from or 0, q.dequantized_from or 0)


def _layer_weights(layer: torch.nn.Module, kernels: ModuleType) -> object:
    attn, mlp = layer.self_attn, layer.mlp
    dense = isinstance(mlp, MLP)
    return kernels.DecoderLayerWeights(
        layer.input_layernorm.weight, _linear_weights(attn.qkv_proj, kernels),
        _linear_weights(attn.o_proj, kernels), layer.post_attention_layernorm.weight,
        _linear_weights(mlp.gate_up_proj, kernels) if dense else None,
        _linear_weights(mlp.down_proj, kernels) if dense else None,
        attn.qkv_proj.bias, attn.q_norm.weight if attn.q_norm is not None else None,
        attn.k_norm.weight if attn.k_norm is not None else None,
        None if dense else _moe_weights(mlp, kernels))


def _moe_weights(moe: SparseMoeBlock, kernels: ModuleType) -> object:
    shared = moe.shared_expert
    return kernels.MoEWeights(
        _linear_weights(moe.gate, kernels),
        [_linear_weights(e.gate_up_proj, kernels) for e in moe.experts],
        [_linear_weights(e.down_proj, kernels) for e in moe.experts],
        moe.top_k, moe.experts[0].down_proj.in_features, moe.renormalize,
        *((None, None, None, 0) if shared is None or moe.shared_expert_gate is None else (
            _linear_weights(shared.gate_up_proj, kernels),
            _linear_weights(shared.down_proj, kernels),
            _linear_weights(moe.shared_expert_gate, kernels), shared.down_proj.in_features)))
