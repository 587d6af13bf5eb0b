"""The Triton weight-only GEMM against dequantize-then-matmul: GPTQ/AWQ integers (4 and 8
bits, groups, act-order, zero points) and SqueezeLLM lookup tables with outliers. On the CPU
it runs in Triton's interpreter, in float32 (the interpreter gets bfloat16 dots wrong)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from kvserve.quantization import triton_gemm  # noqa: E402
from kvserve.quantization.gptq import gptq, rtn, sorted_by_group  # noqa: E402
from kvserve.quantization.squeezellm import squeezellm  # noqa: E402
from kvserve.quantization.torch_int4 import int4_weight  # noqa: E402
from kvserve.quantization.triton_gemm import (  # noqa: E402
    GEMV,
    TENSOR_CORES,
    TORCH_INT4,
    pack_for_triton,
)
from kvserve.triton_splits import split_counters  # noqa: E402
from tests.kernels.test_triton_attention import DEVICE  # noqa: E402

DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
IN, OUT = 256, 96


@pytest.fixture(autouse=True)
def one_tile_each(monkeypatch):
    """Each test runs one tile of each kernel: on a GPU, autotuning would compile and time
    every fitting tile for each shape, dtype and row bucket (minutes in all). Every tile is
    checked on its own in test_every_tile_the_gpu_may_pick_is_right."""
    for tuned, configs in ((triton_gemm._tuned_gemm, triton_gemm.TILE_CONFIGS),
                           (triton_gemm._tuned_gemv, triton_gemm.GEMV_CONFIGS)):
        narrowest = [c for c in configs if c.kwargs["BLOCK_K"] == triton_gemm.MIN_BLOCK_K]
        monkeypatch.setattr(tuned, "configs", narrowest[:1])


def layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, IN, generator=gen) * torch.linspace(0.2, 3, IN)
    return torch.randn(OUT, IN, generator=gen) * 0.05, 2 * x.t() @ x / len(x)


def check(shards, rows: int, dtype: torch.dtype, num_programs: int = 8) -> None:  # noqa: ANN001
    kernel = pack_for_triton(shards, dtype, torch.device(DEVICE), num_programs)
    assert kernel is not None
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
    weight = torch.cat([s.dequantize() for s in shards])
    want = x.to(dtype).float() @ weight.to(dtype).float().t()
    # Up to GEMV_MAX_ROWS rows either kernel may run: the faster on CUDA, the GEMV here.
    for chosen in (None, TENSOR_CORES) if 1 < rows <= triton_gemm.GEMV_MAX_ROWS else (None,):
        run = dataclasses.replace(kernel, kernel=chosen)
        got = run.matmul(x.to(DEVICE, dtype)).float().cpu()
        assert got.shape == want.shape
        assert not split_counters(torch.device(DEVICE)).any()  # split-K re-armed counters
        assert torch.equal(run.matmul(x.to(DEVICE, dtype)).float().cpu(), got)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        assert (got - want).abs().max() <= tolerance * want.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 33, 70])
@pytest.mark.parametrize("bits,group_size,sym", [(4, 32, True), (4, 128, False), (8, -1, False),
                                                 (8, 64, True), (3, 64, True)])
def test_integer_weights_match_their_dequantized_matmul(dtype, rows, bits, group_size, sym):
    w, _ = layer()
    q = rtn(w, bits, IN if group_size == -1 else group_size, sym)
    halves = [q.map_rows(lambda t: t[:64]), q.map_rows(lambda t: t[64:])]  # a fused layer
    check(halves, rows, dtype)


@pytest.mark.parametrize("group_size", [32, 128])
def test_every_tile_the_gpu_may_pick_is_right(group_size, monkeypatch):
    """On CUDA the autotuner picks among the tiles that fit a group (and, in the GEMV, its
    registers); the interpreter runs only the first, so each is run here alone: in the GEMV
    for one row and for five (eight, padded), and in the tensor-core kernel."""
    on_gpu = {"GROUP_SIZE": group_size, "x_ptr": SimpleNamespace(is_cuda=True)}
    w, _ = layer()
    q = rtn(w, 4, group_size, True)
    kernel = pack_for_triton([q], torch.float32, torch.device(DEVICE), 8)
    for rows, gemv, fitting in ((1, True, 8 if group_size == 32 else 15),
                                (5, True, 5 if group_size == 32 else 4),
                                (33, False, 4 if group_size == 32 else 8)):
        tuned = triton_gemm._tuned_gemv if gemv else triton_gemm._tuned_gemm
        configs = triton_gemm.GEMV_CONFIGS if gemv else triton_gemm.TILE_CONFIGS
        block_m = triton.next_power_of_2(rows) if gemv else 64
        tiles = triton_gemm._fitting_tiles(configs, on_gpu, BITS=4, BLOCK_M=block_m)
        assert len(tiles) == fitting
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
        want = x @ q.dequantize().t()
        for tile in tiles:
            assert group_size % tile.kwargs["BLOCK_K"] == 0
            monkeypatch.setattr(tuned, "configs", [tile])
            chosen = GEMV if gemv else TENSOR_CORES
            got = dataclasses.replace(kernel, kernel=chosen).matmul(x.to(DEVICE)).cpu()
            assert (got - want).abs().max() <= 1e-4 * want.abs().max()
            assert triton_gemm.chosen_tile(gemv).startswith(
                f"N{tile.kwargs['BLOCK_N']} K{tile.kwargs['BLOCK_K']} w{tile.num_warps} ")


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (8, 64)])
@pytest.mark.parametrize("offset", [0, 1])  # a 4-byte boundary, and an odd element offset
def test_the_gemv_reads_bfloat16_inputs_two_channels_at_a_time(bits, group_size, offset):
    """bfloat16 rows at a 4-byte boundary are read as 32-bit pairs of channels, others one
    channel at a time (the GEMV has no dot, which the interpreter runs in bfloat16 too)."""
    w, _ = layer()
    q = rtn(w, bits, group_size, sym=bits == 4)
    kernel = dataclasses.replace(
        pack_for_triton([q], torch.bfloat16, torch.device(DEVICE), 8), kernel=GEMV)
    for rows in (1, 3):
        padded = torch.randn(rows, IN + 1, generator=torch.Generator().manual_seed(rows))
        x = padded.to(DEVICE, torch.bfloat16)[:, offset:offset + IN]
        if rows == 1:
            assert x.is_contiguous() and x.data_ptr() % 4 == 2 * offset
        want = x.float().cpu() @ q.dequantize().to(torch.bfloat16).float().t()
        got = kernel.matmul(x).float().cpu()
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_the_gemv_takes_a_few_rows_only():
    w, _ = layer()
    kernel = pack_for_triton([rtn(w, 4, 32, True)], torch.float32, torch.device(DEVICE), 8)
    rows = triton_gemm.GEMV_MAX_ROWS + 1
    with pytest.raises(ValueError, match=f"GEMV kernel does not take {rows} rows"):
        dataclasses.replace(kernel, kernel=GEMV).matmul(torch.randn(rows, IN).to(DEVICE))


def with_int4_copy(q, device: torch.device):  # noqa: ANN001, ANN201
    """q in the Triton layout for bfloat16 rows, with its copy in PyTorch's int4 layout for
    `device` (on the CPU, its CPU kernel's)."""
    kernel = pack_for_triton([q], torch.bfloat16, torch.device(DEVICE), 8)
    intweight, order, group_size = sorted_by_group([q])
    copy = int4_weight(intweight, q.scales, q.zeros, group_size, order, device)
    return dataclasses.replace(kernel, torch_int4=copy)


@pytest.mark.parametrize("act_order", [False, True])
def test_the_torch_int4_copy_matches_the_dequantized_matmul(act_order):
    """PyTorch's int4 GEMM (tinygemm on CUDA, its CPU twin here) on a layer's copy, with the
    GPTQ zero points as its offsets: any rows up to TORCH_INT4_MAX_ROWS, none beyond."""
    w, hessian = layer()
    q = gptq(w, hessian, 4, 64, sym=False, act_order=act_order)
    kernel = with_int4_copy(q, torch.device(DEVICE))
    assert TORCH_INT4 in kernel.kernels(triton_gemm.TORCH_INT4_MAX_ROWS)
    assert TORCH_INT4 not in kernel.kernels(triton_gemm.TORCH_INT4_MAX_ROWS + 1)
    for rows in (1, 5, 16, 33):
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
        want = x.bfloat16().float() @ q.dequantize().bfloat16().float().t()
        got = dataclasses.replace(kernel, kernel=TORCH_INT4).matmul(
            x.to(DEVICE, torch.bfloat16)).float().cpu()
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    rows = triton_gemm.TORCH_INT4_MAX_ROWS + 1
    with pytest.raises(ValueError, match=f"torch int4 kernel does not take {rows} rows"):
        dataclasses.replace(kernel, kernel=TORCH_INT4).matmul(
            torch.randn(rows, IN, dtype=torch.bfloat16, device=DEVICE))


def test_a_layout_packs_its_int4_copy_for_timing_once_then_only_where_it_pays(monkeypatch):
    """The copy is packed to time it on the first layer of a layout; later layers of that
    layout pack it only where the timing kept it (under the interpreter the Triton kernels
    are always taken, so it never is)."""
    monkeypatch.setattr(triton_gemm, "_torch_int4_pays", {})
    w, hessian = layer()
    q = gptq(w, hessian, 4, 64, sym=True, act_order=False)
    copy = with_int4_copy(q, torch.device(DEVICE))
    packs = []

    def pack():  # noqa: ANN202
        packs.append(1)
        return copy.torch_int4

    plain = dataclasses.replace(copy, torch_int4=None)
    for _ in range(3):
        kept = triton_gemm._with_torch_int4(plain, pack)
        assert (kept.torch_int4 is not None) == next(iter(triton_gemm._torch_int4_pays.values()))
    assert len(packs) == (3 if DEVICE == "cuda" and kept.torch_int4 is not None else 1)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 2, 16, 40])
def test_on_cuda_the_fastest_kernel_of_each_row_count_is_right(rows):
    """Where a layer has its int4 copy, each row count's first call times the kernels that
    take it and runs the fastest; every one of them gives the dequantized result."""
    w, hessian = layer()
    q = gptq(w, hessian, 4, 128, sym=True, act_order=False)
    kernel = with_int4_copy(q, torch.device("cuda"))
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
    want = x.bfloat16().float() @ q.dequantize().bfloat16().float().t()
    assert TORCH_INT4 in kernel.kernels(rows)
    for chosen in (None, *kernel.kernels(rows)):
        got = dataclasses.replace(kernel, kernel=chosen).matmul(
            x.to("cuda", torch.bfloat16)).float().cpu()
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.parametrize("num_programs", [1, 64])  # one split, and as many as the input allows
def test_act_order_weights_gather_their_inputs(num_programs):
    w, hessian = layer()
    q = gptq(w, hessian, 4, 64, sym=True, act_order=True)
    assert not torch.equal(q.g_idx, torch.arange(IN) // 64)
    for rows in (1, 3):  # the GEMV and the GEMM
        check([q], rows, torch.float32, num_programs)


@pytest.mark.parametrize("bits,outlier_fraction", [(3, 0.01), (4, 0.0)])
def test_lookup_tables_with_outliers_match_their_dequantized_matmul(bits, outlier_fraction):
    w, _ = layer()
    fisher = torch.rand(w.shape, generator=torch.Generator().manual_seed(2))
    lut = squeezellm(w, fisher, bits, outlier_fraction, sensitive_fraction=0)
    kernel = pack_for_triton([lut], torch.float32, torch.device(DEVICE), 8)
    assert (kernel.outliers is not None) == (outlier_fraction > 0)
    for rows in (1, 20):
        check([lut.map_rows(lambda t: t[:32]), lut.map_rows(lambda t: t[32:])], rows,
              torch.float32)


def test_lookup_table_rows_reorder_with_their_outliers():
    w, _ = layer()
    lut = squeezellm(w, torch.rand(w.shape), 3, 0.02)
    order = torch.randperm(OUT, generator=torch.Generator().manual_seed(3))
    assert torch.equal(lut.map_rows(lambda t: t[order]).dequantize(), lut.dequantize()[order])


def test_layers_the_kernel_cannot_run_are_left_to_dequantize():
    w, _ = layer()
    device = torch.device(DEVICE)
    assert pack_for_triton([rtn(w, 4, 16, True)], torch.float32, device, 8) is None  # groups
    a, b = (gptq(w, layer(seed)[1], 4, 64, True, act_order=True) for seed in (0, 1))
    assert pack_for_triton([a, b], torch.float32, device, 8) is None  # different orders
