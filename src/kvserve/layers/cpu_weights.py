"""A linear layer's weights as the C++ kernels hold them (`LinearWeights` in
kvserve/csrc/kvserve_cpu.h), for the C++ code that runs many layers in one call: the decode
stack (worker/cpu_decode.py) and a mixture-of-experts block (models/moe.py)."""

from __future__ import annotations

from types import ModuleType

from kvserve.layers.linear import Linear
from kvserve.quantization.cpu_kernels import Int8Weight, IntegerWeight
from kvserve.quantization.torch_int4 import Int4Weight


def runs_on_cpu_kernels(linear: Linear) -> bool:
    """Whether `linear_weights` runs this layer as its forward does."""
    if linear.kernel is None:
        return linear.form == "blocked"
    return isinstance(linear.kernel, IntegerWeight)


def linear_weights(linear: Linear, kernels: ModuleType) -> object:
    q = linear.kernel
    if q is None:
        return kernels.LinearWeights(linear.weight)
    if isinstance(q, Int4Weight):
        return kernels.LinearWeights.int4(q.packed, q.scales_and_zeros, q.group_size,
                                          q.input_order)
    if isinstance(q, Int8Weight):
        return kernels.LinearWeights.int8(q.weight, q.scales, q.zero_terms)
    return kernels.LinearWeights(q.packed, q.bits, q.scales, q.zeros, q.input_order,
                                 q.group_size, q.amx_from or 0, q.dequantized_from or 0,
                                 q.gemm_from or 0)
