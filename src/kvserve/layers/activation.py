"""Gated activations over a fused gate+up projection (one fused kernel on CUDA and CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.layers.fused import fused_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernels = fused_kernels(gate_up)
    if kernels is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
