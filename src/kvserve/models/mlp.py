"""The gated MLP of the Llama family: down(silu(gate(x)) * up(x)); Gemma's has GELU (tanh
approximation) for SiLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 reduced: bool = True, act: str = "silu") -> None:
        """`intermediate_size` is this tensor-parallel rank's columns. Unless `reduced`, the
        output is the rank's partial sum, which the caller sums over the ranks (the experts
        of a MoE layer: one sum for all of them)."""
        super().__init__()
        self.act = act
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, False, dtype,
                                   parallel="column")
        self.down_proj = Linear(intermediate_size, [hidden_size], False, dtype,
                                parallel="row" if reduced else "row_partial")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up): the activation fused into gate_up's output on the CPU's
        blocked GEMM, into down's input elsewhere (see Linear). GELU runs unfused."""
        if self.act != "silu":
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if self.gate_up_proj.form == "blocked":
            return self.down_proj(self.gate_up_proj.silu_and_mul(x))
        return self.down_proj.gated(self.gate_up_proj(x))
