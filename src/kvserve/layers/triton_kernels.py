"""Triton kernels for the decoder's elementwise work on CUDA: the residual add fused into
RMSNorm, and SiLU-and-mul. Each reads its inputs once and writes once, where torch's ops
would make a pass per op. They round where the reference implementations round (the
residual sum, the normalized value and the SiLU output are stored in the model's dtype
before the next multiply), so they agree with the plain-torch layers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, eps, hidden,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    mask = i < hidden
    x = tl.load(x_ptr + row * hidden + i, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * hidden + i, mask=mask,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * hidden + i, x, mask=mask)  # the sum is the new residual
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    normed = (x32 * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + i, (weight * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of x ([N, hidden], contiguous), or of x + residual; then the sum
    is written into `residual` in place."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    _add_rms_norm_kernel[(x.shape[0],)](
        x, residual if residual is not None else x, weight, out, eps, hidden,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    return out


@triton.jit
def silu_times(gate, up):
    """silu(gate) * up in their dtype, rounded where the reference rounds."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (silu * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row, col = tl.program_id(0), tl.program_id(1)
    i = col * BLOCK + tl.arange(0, BLOCK)
    mask = i < width
    gate = tl.load(gate_up_ptr + row * 2 * width + i, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * width + width + i, mask=mask, other=0.0)
    tl.store(out_ptr + row * width + i, silu_times(gate, up), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2 * width] (gate, then up) -> silu(gate) * up, [N, width]."""
    assert gate_up.is_contiguous()
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block)
    return out
