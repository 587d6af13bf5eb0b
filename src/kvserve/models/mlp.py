"""The gated MLP of the Llama family: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.layers.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 reduced: bool = True) -> None:
        """`intermediate_size` is this tensor-parallel rank's columns. Unless `reduced`, the
        output is the rank's partial sum, which the caller sums over the ranks (the experts
        of a MoE layer: one sum for all of them)."""
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, False, dtype,
                                   parallel="column")
        self.down_proj = Linear(intermediate_size, [hidden_size], False, dtype,
                                parallel="row" if reduced else "row_partial")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up): the activation fused into gate_up's output on the CPU's
        blocked GEMM, into down's input elsewhere (see Linear)."""
        if self.gate_up_proj.form == "blocked":
            return self.down_proj(self.gate_up_proj.silu_and_mul(x))
        return self.down_proj.gated(self.gate_up_proj(x))
