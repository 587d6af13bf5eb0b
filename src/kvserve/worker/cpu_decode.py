"""Decode-only steps on CPU as one C++ call through all decoder layers: the CPU counterpart of
CUDA graphs.

A batch-1 decode step of a small model is ~300 short kernel calls; issued from Python, the
calls cost a third of the step. `LlamaDecodeStack` (csrc/llama_decode.cpp) runs the same
kernels in the same order from C++, so the hidden states are bit-identical to the eager
forward. It covers what those kernels cover: a single-rank Llama-family model (Qwen3's per-head
q/k norms, mixture-of-experts MLPs, and Gemma's norms around attention and the MLP, GELU,
local and global layers and softcapped attention scores included), every linear on the
blocked GEMM or on any of the CPU's quantized kernels, and the C++ attention backend. Steps
with a prefill chunk, and everything under `enforce_eager`, run the eager forward.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvserve.attention.cpu_paged import CpuPagedAttention
from kvserve.cpp_extension import cpu_kernels
from kvserve.layers.cpu_weights import linear_weights, runs_on_cpu_kernels
from kvserve.layers.linear import Linear
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.mlp import MLP
from kvserve.worker.input_batch import ModelInputs
from kvserve.worker.tensor_parallel import tp_group


class CpuDecodeStack:
    def __init__(self, model: LlamaForCausalLM, kernels: ModuleType) -> None:
        cfg = model.cfg
        self.model = model
        self.stack = kernels.LlamaDecodeStack(
            [_layer_weights(layer, kernels) for layer in model.layers], model.norm.weight,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.rms_norm_eps, model.layers[0].self_attn.scale,
            gelu=cfg.hidden_act == "gelu_pytorch_tanh",
            softcap=cfg.attn_logit_softcapping or 0.0)

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
            if not all(runs_on_cpu_kernels(lin) for lin in linears):
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
        rotation, local = (
            None if rotary is None else torch.view_as_real(rotary(inputs.positions)).contiguous()
            for rotary in (model.rotary, model.local_rotary))
        return self.stack.forward(
            model.embed_tokens[inputs.input_ids], rotation, meta.slot_mapping,
            [layer.self_attn.kv_cache for layer in model.layers], block_tables.contiguous(),
            seq_lens, meta.sliding_window or 0, meta.decode_rows_share_sequences, local)


def _layer_weights(layer: torch.nn.Module, kernels: ModuleType) -> object:
    attn, mlp = layer.self_attn, layer.mlp
    dense = isinstance(mlp, MLP)
    return kernels.DecoderLayerWeights(
        layer.input_layernorm.weight, linear_weights(attn.qkv_proj, kernels),
        linear_weights(attn.o_proj, kernels), layer.post_attention_layernorm.weight,
        linear_weights(mlp.gate_up_proj, kernels) if dense else None,
        linear_weights(mlp.down_proj, kernels) if dense else None,
        attn.qkv_proj.bias, _weight(attn.q_norm), _weight(attn.k_norm),
        None if dense else mlp.on_cpu_kernels,
        _weight(layer.pre_feedforward_layernorm), _weight(layer.post_feedforward_layernorm),
        attn.full_attention, layer.uses_local_rotary)


def _weight(norm: torch.nn.Module | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight
