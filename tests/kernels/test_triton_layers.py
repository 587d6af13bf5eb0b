"""The decoder's Triton kernels against the plain-torch layers they replace on CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve.layers import triton_kernels  # noqa: E402
from kvserve.layers.norm import RMSNorm  # noqa: E402
from tests.kernels.test_triton_attention import DEVICE, bf16_close  # noqa: E402

# The norm and SiLU-and-mul round twice: once inside, once at the end.
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: bf16_close(2)}


def torch_norm(size: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(size, 1e-5, dtype)
    norm.weight.copy_(1 + torch.randn(size, generator=torch.Generator().manual_seed(1)))
    return norm.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 576])
def test_add_rms_norm_matches_the_layer(dtype, hidden):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype)
    norm = torch_norm(hidden, dtype)
    expected, expected_sum = norm._norm(x + residual), x + residual
    fused_residual = residual.clone()
    got = triton_kernels.add_rms_norm(x, norm.weight, 1e-5, fused_residual)
    torch.testing.assert_close(fused_residual, expected_sum, **TOLERANCE[dtype])
    if dtype == torch.float32 or DEVICE == "cuda":  # the interpreter truncates the sum
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(triton_kernels.add_rms_norm(x, norm.weight, 1e-5),
                               norm._norm(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(dtype):
    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(2))
    gate_up = gate_up.to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(triton_kernels.silu_and_mul(gate_up),
                               torch.nn.functional.silu(gate) * up, **TOLERANCE[dtype])
