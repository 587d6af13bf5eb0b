"""RMSNorm, computed in float32 with the reference implementations' order of operations.

Written out as four ops rather than `torch.rms_norm`, whose CPU path costs about 45 us per
call on small rows (x10 the plain ops), which adds up to ~3 ms per batch-1 decode step.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
