"""The C++ CPU norm and activation kernels against the plain-torch layers they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.cpp_extension import cpu_kernels
from kvserve.layers.norm import RMSNorm

KERNELS = cpu_kernels()
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
             torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}  # one bfloat16 rounding


def test_the_kernels_build_on_this_machine():
    """CI machines have a compiler; a silent fallback to the slow path would hide a break."""
    assert KERNELS is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_the_plain_ops(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5, dtype)
    norm.weight.copy_(1 + torch.randn(96, generator=gen))
    x = torch.randn(5, 96, generator=gen).to(dtype)
    residual = torch.randn(5, 96, generator=gen).to(dtype)
    summed = x + residual
    torch.testing.assert_close(KERNELS.add_rms_norm(x, norm.weight, 1e-5), norm._norm(x),
                               **TOLERANCE[dtype])
    updated = residual.clone()
    out = KERNELS.add_rms_norm(x, norm.weight, 1e-5, updated)
    assert torch.equal(updated, summed)  # the residual add rounds as torch's does
    torch.testing.assert_close(out, norm._norm(summed), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_heads_norms_each_head_as_add_rms_norm_does(dtype):
    """The leading 5 + 2 heads of a [3, 9, 76] QKV projection (a strided view; 76 channels
    end in a partial vector register of 8 or 16 lanes), normed by the query or the key weight."""
    gen = torch.Generator().manual_seed(4)
    heads = torch.randn(3, 9, 76, generator=gen).to(dtype)
    q_weight, k_weight = (1 + torch.randn(2, 76, generator=gen)).to(dtype)
    out = KERNELS.rms_norm_heads(heads[:, :7], 5, q_weight, k_weight, 1e-6)
    q = KERNELS.add_rms_norm(heads[:, :5].reshape(-1, 76), q_weight, 1e-6).view(3, 5, 76)
    k = KERNELS.add_rms_norm(heads[:, 5:7].reshape(-1, 76), k_weight, 1e-6).view(3, 2, 76)
    assert out.is_contiguous() and torch.equal(out, torch.cat([q, k], dim=1))
    norm = RMSNorm(76, 1e-6, dtype)
    norm.weight.copy_(q_weight)
    torch.testing.assert_close(out[:, :5], norm._norm(heads[:, :5]), **TOLERANCE[dtype])
    with pytest.raises(RuntimeError, match="8 query heads of 7"):
        KERNELS.rms_norm_heads(heads[:, :7], 8, q_weight, k_weight, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_plain_ops(dtype):
    """83 channels: whole vector registers (8 or 16 lanes) and a masked last one; gates far
    past where e^-gate overflows float32 give silu's limits, 0 and the gate itself."""
    gate_up = torch.randn(3, 2 * 83, generator=torch.Generator().manual_seed(2)) * 4
    gate_up[0, :4] = torch.tensor([-1000.0, -89.0, 89.0, 1000.0])
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(KERNELS.silu_and_mul(gate_up), F.silu(gate) * up,
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_experts_matches_the_plain_ops(dtype, renormalize):
    """70 rows (two threads' share) of 64 experts, top 8: experts of the same logits in the
    same order as softmax then topk picks (bfloat16 ties may be broken otherwise), and their
    weights as those ops compute them."""
    logits = (torch.randn(70, 64, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    probs = torch.softmax(logits.float(), dim=-1)
    expected, expected_ids = torch.topk(probs, 8, dim=-1)
    if renormalize:
        expected = expected / expected.sum(dim=-1, keepdim=True)
    weights, ids = KERNELS.route_experts(logits, 8, renormalize)
    assert weights.dtype == dtype
    assert torch.equal(logits.gather(1, ids), logits.gather(1, expected_ids))
    torch.testing.assert_close(weights, expected.to(dtype), **TOLERANCE[dtype])


def test_route_experts_ranks_ties_by_index_and_nan_first():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [1.0, float("nan"), 3.0, 3.0]])
    weights, ids = KERNELS.route_experts(logits, 2, True)
    assert ids.tolist() == [[1, 2], [1, 2]]
    assert weights[0].tolist() == [0.5, 0.5]
    with pytest.raises(RuntimeError, match="top_k 5 of 4 experts"):
        KERNELS.route_experts(logits, 5, True)


def test_bad_rows_are_refused():
    with pytest.raises(RuntimeError, match="contiguous 2-D"):
        KERNELS.silu_and_mul(torch.randn(2, 3, 8))
