"""The blocked CPU GEMM of the linear layers against torch's matmul on the same weights."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import cpu_flags
from kvserve.cpp_extension import cpu_kernels
from kvserve.layers.linear import Linear

GEMM = cpu_kernels()
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-4},
             torch.bfloat16: {"rtol": 1.6e-2, "atol": 2e-2}}  # one bfloat16 rounding


def test_the_kernel_builds_on_this_machine():
    """CI machines have a compiler; a silent fallback to oneDNN would hide a break."""
    assert GEMM is not None


def _needs(dtype: torch.dtype) -> None:
    if not GEMM.gemm_supports(torch.empty(16, 2, dtype=dtype)):
        pytest.skip(f"this CPU has no blocked GEMM for {dtype} (AVX-512 / AVX512-BF16)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 17, 40])
@pytest.mark.parametrize(("n", "k"), [(16, 2), (70, 34), (200, 96), (48, 64)])
def test_blocked_linear_matches_matmul(dtype, rows, n, k):
    """Row counts around the 6-row register tile and the 16- and 32-row AMX tiles, output
    counts off the 16- and 64-wide blocks, widths on and off AMX's 32-channel steps."""
    _needs(dtype)
    gen = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    expected = x.float() @ w.float().t() + bias.float()
    packed = GEMM.pack_weight([w], dtype)
    torch.testing.assert_close(GEMM.blocked_linear(x, packed, n, bias).float(), expected,
                               **TOLERANCE[dtype])
    torch.testing.assert_close(GEMM.blocked_linear(x, packed, n, None).float(),
                               expected - bias.float(), **TOLERANCE[dtype])


def test_amx_runs_where_the_cpu_has_it():
    """A build without the AMX tiles would fall back to the 8x slower VDPBF16PS ones."""
    if "amx_bf16" not in cpu_flags():
        pytest.skip("this CPU has no AMX")
    assert GEMM.amx_in_use()


def test_many_rows_over_weights_larger_than_one_cache_group():
    """A prefill-sized product walks the weights in groups that fit in L2 (on AMX): every
    output is computed once, the groups' edges and the last short row step included."""
    _needs(torch.bfloat16)
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(330, 4096, generator=gen).to(torch.bfloat16)
    x = torch.randn(300, 4096, generator=gen).to(torch.bfloat16)
    got = GEMM.blocked_linear(x, GEMM.pack_weight([w], w.dtype), 330, None).float()
    torch.testing.assert_close(got, x.float() @ w.float().t(), rtol=1.6e-2, atol=0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_layer_runs_on_the_blocked_gemm(dtype):
    _needs(dtype)
    layer = Linear(32, [48, 16], bias=True, dtype=dtype)
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(size, 32, generator=gen).to(dtype) for size in (48, 16)]
    for shard, w in enumerate(weights):
        layer.load("weight", shard, w)
        layer.load("bias", shard, torch.full((w.shape[0],), float(shard), dtype=dtype))
    layer.prepare()
    assert layer.form == "blocked"
    x = torch.randn(3, 32, generator=gen).to(dtype)
    expected = x.float() @ torch.cat(weights).float().t() + torch.tensor([0.0] * 48 + [1.0] * 16)
    torch.testing.assert_close(layer(x).float(), expected, **TOLERANCE[dtype])


def test_bfloat16_shards_widen_to_float32_as_they_are_packed():
    """A float32 model keeps a bfloat16 checkpoint's weights as they are until it packs
    them: the packed weight is that of the widened shards, bit for bit."""
    _needs(torch.float32)
    gen = torch.Generator().manual_seed(4)
    shards = [torch.randn(size, 40, generator=gen).to(torch.bfloat16) for size in (24, 17)]
    widened = GEMM.pack_weight(shards, torch.float32)
    assert torch.equal(widened, GEMM.pack_weight([s.float() for s in shards], torch.float32))
    layer = Linear(40, [24, 17], bias=False, dtype=torch.float32)
    for shard, w in enumerate(shards):
        layer.load("weight", shard, w)
    layer.prepare()
    assert layer.weight.dtype == torch.float32
    x = torch.randn(3, 40, generator=gen)
    torch.testing.assert_close(layer(x), x @ torch.cat(shards).float().t(),
                               **TOLERANCE[torch.float32])
    with pytest.raises(RuntimeError, match="cannot pack Half as Float"):
        GEMM.pack_weight([torch.randn(16, 8).half()], torch.float32)


def test_an_input_of_the_wrong_width_is_refused():
    _needs(torch.float32)
    packed = GEMM.pack_weight([torch.randn(16, 8)], torch.float32)
    with pytest.raises(RuntimeError, match="input width 6"):
        GEMM.blocked_linear(torch.randn(2, 6), packed, 16, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 33, 300])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (48, 96), (24, 64), (640, 2048)])
def test_gate_up_with_silu_is_the_two_ops_bit_for_bit(dtype, rows, n, k):
    """The MLP's fused gate/up projection and activation (on AMX: silu in the GEMM's store):
    row counts around the tiles and the prefill grouping, a half not a whole block (24:
    the two ops), a weight larger than one cache group."""
    _needs(dtype)
    gen = torch.Generator().manual_seed(rows + n + k)
    packed = GEMM.pack_weight([torch.randn(2 * n, k, generator=gen).to(dtype)], dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    two_ops = GEMM.silu_and_mul(GEMM.blocked_linear(x, packed, 2 * n, None))
    assert torch.equal(GEMM.blocked_linear_silu_and_mul(x, packed, n), two_ops)


def test_gate_up_with_silu_refuses_a_weight_of_another_width():
    _needs(torch.bfloat16)
    if not GEMM.amx_in_use():
        pytest.skip("the fused store runs on AMX only")
    packed = GEMM.pack_weight([torch.randn(64, 32).to(torch.bfloat16)], torch.bfloat16)
    with pytest.raises(RuntimeError, match="2 x 16 outputs, got 64"):
        GEMM.blocked_linear_silu_and_mul(torch.randn(2, 32).to(torch.bfloat16), packed, 16)
