"""RMSNorm, computed in float32 with the reference implementations' order of operations,
optionally with the pre-norm block's residual add folded in.

Rows of hidden states go through one fused kernel that also does the residual add: Triton's
on CUDA, a C++ one on CPU. Elsewhere it is written out as plain ops, rather than as
`torch.rms_norm`, whose CPU path costs about 45 us per call on small rows (x10 the plain ops).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.layers.fused import cpu_fused_kernels, fused_kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: the normalized x. With it: (the normalized x + residual, and
        x + residual, the next residual)."""
        kernels = fused_kernels(x)
        if kernels is not None and x.dim() == 2 and x.is_contiguous():
            if residual is None:
                return kernels.add_rms_norm(x, self.weight, self.eps)
            residual = residual.contiguous()
            return kernels.add_rms_norm(x, self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rms_norm_heads(qk: torch.Tensor, num_q_heads: int, q_norm: RMSNorm, k_norm: RMSNorm
                   ) -> torch.Tensor:
    """Qwen3's per-head norms: each head's row of queries then keys [N, Hq + Hk, D] normed by
    q_norm (the first `num_q_heads`) or k_norm, as rows of [N * heads, D]. On CPU one C++ call
    (which the decode stack makes too) in place of two norms, their reshapes and a cat."""
    kernels = cpu_fused_kernels(qk)
    if kernels is not None and qk.stride(-1) == 1:
        return kernels.rms_norm_heads(qk, num_q_heads, q_norm.weight, k_norm.weight, q_norm.eps)
    rows, dim = qk.shape[0], qk.shape[-1]
    q = q_norm(qk[:, :num_q_heads].reshape(-1, dim)).view(rows, -1, dim)
    k = k_norm(qk[:, num_q_heads:].reshape(-1, dim)).view(rows, -1, dim)
    return torch.cat([q, k], dim=1)
