"""The split-K linear kernel for a few rows against F.linear, and the choice between it and
cuBLAS. Without CUDA it runs in Triton's interpreter, in float32 (the interpreter gets
bfloat16 dots wrong)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kvserve.layers import triton_linear  # noqa: E402
from kvserve.layers.activation import silu_and_mul  # noqa: E402
from kvserve.layers.linear import Linear  # noqa: E402
from kvserve.triton_splits import split_counters  # noqa: E402
from tests.kernels.test_triton_attention import DEVICE  # noqa: E402

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
             torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


@pytest.fixture(autouse=True)
def one_tile(monkeypatch):
    """One tile of 32 outputs and 64 inputs, so that the small layers below have several
    tiles and several splits: on a GPU, autotuning every tile would take minutes."""
    tile = next(c for c in triton_linear.TILE_CONFIGS
                if (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) == (32, 64))
    monkeypatch.setattr(triton_linear._tuned, "configs", [tile])


def operands(rows: int, in_features: int, out_features: int, dtype: torch.dtype,
             gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, 2 * in_features if gated else in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5
    return x.to(DEVICE, dtype), weight.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("num_programs", [1, 8, 64])
def test_split_k_linear_matches_f_linear(dtype, rows, num_programs):
    # 80 outputs: three tiles, the last one partial; 512 inputs: up to 2 splits of 4 tiles.
    x, weight = operands(rows, 512, 80, dtype)
    got = triton_linear.split_k_linear(x, weight, num_programs)
    torch.testing.assert_close(got, F.linear(x, weight), **TOLERANCE[dtype])
    assert not split_counters(x.device).any()  # the last split re-armed each counter
    assert torch.equal(triton_linear.split_k_linear(x, weight, num_programs), got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_gated_input_is_silu_and_mul_then_the_layer(dtype, rows):
    gate_up, weight = operands(rows, 256, 64, dtype, gated=True)
    got = triton_linear.split_k_linear(gate_up, weight, 8, gated=True)
    torch.testing.assert_close(got, F.linear(silu_and_mul(gate_up), weight),
                               **TOLERANCE[dtype])


def test_the_kernel_refuses_what_it_cannot_run():
    x, weight = operands(17, 128, 32, torch.float32)
    with pytest.raises(AssertionError):
        triton_linear.split_k_linear(x, weight, 8)  # more rows than a tile
    x, weight = operands(2, 96, 32, torch.float32)
    with pytest.raises(AssertionError):
        triton_linear.split_k_linear(x, weight, 8)  # inputs not whole tiles


def test_choice_follows_kvserve_dense_kernel(monkeypatch):
    x, weight = operands(4, 128, 32, torch.float32)
    monkeypatch.setenv("KVSERVE_DENSE_KERNEL", "triton")
    assert triton_linear.split_k_runs(x, weight, 8, gated=False)
    wide, _ = operands(17, 128, 32, torch.float32)
    assert not triton_linear.split_k_runs(wide, weight, 8, gated=False)
    odd, odd_weight = operands(2, 96, 32, torch.float32)
    assert not triton_linear.split_k_runs(odd, odd_weight, 8, gated=False)
    monkeypatch.setenv("KVSERVE_DENSE_KERNEL", "cublas")
    assert not triton_linear.split_k_runs(x, weight, 8, gated=False)
    monkeypatch.setenv("KVSERVE_DENSE_KERNEL", "auto")
    assert triton_linear.split_k_runs(x, weight, 8, gated=False) in (True, False)
    monkeypatch.setenv("KVSERVE_DENSE_KERNEL", "fast")
    with pytest.raises(ValueError, match="KVSERVE_DENSE_KERNEL must be one of auto, cublas"):
        triton_linear.split_k_runs(x, weight, 8, gated=False)


def out_major_layer(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A layer in the form CUDA gives it (the checkpoint's [out, in] weight for F.linear),
    on this test's device."""
    layer = Linear(weight.shape[1], [weight.shape[0]], bias is not None, weight.dtype)
    layer.form, layer.weight, layer.num_programs = "out_major", weight, 8
    if bias is not None:
        layer.bias = bias
    return layer


@pytest.mark.parametrize("choice", ["triton", "cublas"])
def test_linear_runs_either_kernel_to_the_same_result(monkeypatch, choice):
    monkeypatch.setenv("KVSERVE_DENSE_KERNEL", choice)
    gate_up, weight = operands(3, 128, 64, torch.float32, gated=True)
    bias = torch.linspace(-1, 1, 64, device=DEVICE)
    layer = out_major_layer(weight, bias)
    torch.testing.assert_close(layer.gated(gate_up),
                               F.linear(silu_and_mul(gate_up), weight, bias),
                               **TOLERANCE[torch.float32])
    x = gate_up[:, :128].contiguous()
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), **TOLERANCE[torch.float32])
    assert layer(x[:, None]).shape == (3, 1, 64)  # leading dimensions kept
