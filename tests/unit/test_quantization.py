"""Quantized weights: hub packing layouts, RTN, GPTQ and SqueezeLLM, and reading bad files."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

import kvserve.quantization.cpu_kernels as cpu_kernels_module
from kvserve.config import cpu_flags
from kvserve.cpp_extension import CSRC, build, cpu_kernels
from kvserve.errors import CheckpointError
from kvserve.quantization.cpu_kernels import (
    Int8Weight,
    WxA8Weight,
    amx_int8_runs,
    cpu_candidates,
    dequantized_gemm_runs,
    wxa8_packed,
)
from kvserve.quantization.gptq import gptq, rtn, sorted_by_group
from kvserve.quantization.hub_format import QuantConfig, dequantize_checkpoint
from kvserve.quantization.packing import (
    pack_awq,
    pack_gptq,
    pack_rows,
    unpack_awq,
    unpack_gptq,
    unpack_rows,
)
from kvserve.quantization.squeezellm import _nearest, squeezellm
from kvserve.quantization.torch_int4 import Int4Weight, cuda_nibble_pairs, int4_weight_fits

GEN = torch.Generator().manual_seed(0)


def reference_pack(intweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Packing along dim 0 written out word by word as AutoGPTQ's packer does it, with 3-bit
    values straddling words at positions 10 and 21 of every 32."""
    iw = intweight.numpy().astype(np.uint32)
    words = np.zeros((iw.shape[0] // 32 * bits, iw.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < words.shape[0]:
        if bits != 3:
            for j in range(32 // bits):
                words[row] |= iw[i + j] << (bits * j)
            i, row = i + 32 // bits, row + 1
            continue
        for shift in (0, 1, 2):
            for j in range(10):
                words[row] |= iw[i + j] << (3 * j + shift)
            i += 10
            if shift < 2:  # the straddling value: its low bits end this word
                words[row] |= iw[i] << (30 + shift)
                words[row + 1] |= (iw[i] >> (2 - shift)) & ((1 << (shift + 1)) - 1)
                i += 1
            row += 1
    return torch.from_numpy(words.astype(np.int32))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_bit_streams_round_trip_and_match_autogptq_words(bits):
    values = torch.randint(0, 2**bits, (64, 5), generator=GEN)
    packed = pack_rows(values, bits)
    assert packed.dtype == torch.int32 and packed.shape == (64 * bits // 32, 5)
    unpacked = unpack_rows(packed, bits)
    assert unpacked.dtype == torch.uint8 and torch.equal(unpacked.long(), values)
    assert torch.equal(packed, reference_pack(values, bits))


def test_gptq_and_awq_layouts_round_trip():
    intweight = torch.randint(0, 16, (24, 64), generator=GEN)  # [out, in]
    zeros = torch.randint(1, 16, (2, 24), generator=GEN)  # [groups, out]
    qweight, qzeros = pack_gptq(intweight, zeros, 4)
    assert qweight.shape == (8, 24) and qzeros.shape == (2, 3)
    assert all(torch.equal(a, b) for a, b in zip(unpack_gptq(qweight, qzeros, 4),
                                                 (intweight, zeros), strict=True))
    awq = torch.randint(0, 16, (64, 24), generator=GEN)
    assert torch.equal(unpack_awq(pack_awq(awq)), awq)
    scales = torch.rand(2, 24, generator=GEN)
    expected = (scales[torch.arange(64) // 32] * (awq - 3)).t()
    config = QuantConfig.from_hf({"quant_method": "awq", "bits": 4, "group_size": 32})
    got = config.unpack("layer", {"qweight": pack_awq(awq), "scales": scales,
                                  "qzeros": pack_awq(torch.full((2, 24), 3))})
    torch.testing.assert_close(got.dequantize(), expected)


def _hessian(x: torch.Tensor) -> torch.Tensor:
    return 2 * x.t() @ x / x.shape[0]


def correlated_layer():
    w = torch.randn(96, 256, generator=GEN) * 0.05
    x = torch.randn(2048, 256, generator=GEN) @ (torch.randn(256, 256, generator=GEN) * 0.2)
    x[:, :8] *= 10  # a few outlier input channels, as in real activations
    return w, x, _hessian(x)


@pytest.mark.parametrize("bits,act_order", [(4, False), (3, False), (3, True)])
def test_gptq_output_error_beats_rtn_on_the_calibration_inputs(bits, act_order):
    w, x, hessian = correlated_layer()

    def output_error(q):
        return float(((x @ (q.dequantize() - w).t()) ** 2).mean())

    baseline = rtn(w, bits, 128, sym=True)
    ours = gptq(w, hessian, bits, 128, sym=True, act_order=act_order)
    assert output_error(ours) < 0.5 * output_error(baseline)
    assert ours.intweight.max() < 2**bits and ours.intweight.min() >= 0
    if act_order:  # groups follow the permuted order, so g_idx is not sorted
        assert not torch.equal(ours.g_idx, torch.sort(ours.g_idx).values)


def test_rtn_dequantizes_within_half_a_step():
    w = torch.randn(8, 64, generator=GEN)
    q = rtn(w, 4, 32, sym=False)
    step = q.scales.t()[:, q.g_idx]
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("raw,message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 5}, "gptq with bits=5 is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size must be -1 or"),
])
def test_unsupported_configs_are_refused_by_name(raw, message):
    with pytest.raises(CheckpointError, match=message):
        QuantConfig.from_hf(raw)


def test_incomplete_or_unexpected_quantized_tensors_are_refused():
    config = QuantConfig.from_hf({"quant_method": "gptq", "bits": 4, "group_size": 32})
    qweight, qzeros = pack_gptq(torch.zeros(8, 64, dtype=torch.long),
                                torch.ones(2, 8, dtype=torch.long), 4)
    parts = [("layers.0.mlp.up_proj.qweight", qweight), ("layers.0.mlp.up_proj.qzeros", qzeros)]
    with pytest.raises(CheckpointError, match="'layers.0.mlp.up_proj' lacks g_idx, scales"):
        list(dequantize_checkpoint(iter(parts), config))
    with pytest.raises(CheckpointError, match="is quantized but config.json has no"):
        list(dequantize_checkpoint(iter(parts), None))
    bad = parts + [("layers.0.mlp.up_proj.scales", torch.ones(2, 8)),
                   ("layers.0.mlp.up_proj.g_idx", torch.zeros(48, dtype=torch.int32))]
    with pytest.raises(CheckpointError, match="has inconsistent tensors"):
        list(dequantize_checkpoint(iter(bad), config))


def _broken(layer, field: str, fn):  # noqa: ANN001, ANN202
    return dataclasses.replace(layer, **{field: fn(getattr(layer, field))})


@pytest.mark.parametrize(("field", "fn", "message"), [
    ("scales", lambda t: t[:, :-1], r"scales \[2, 7\] and zeros \[2, 8\] must both be"),
    ("zeros", lambda t: t[:1], r"and zeros \[1, 8\] must both be \[groups, 8\]"),
    ("g_idx", lambda t: t[:-1], r"g_idx \[63\] must be \[64\]"),
    ("g_idx", lambda t: t + 1, "g_idx must name groups 0 to 1"),
])
def test_quantized_parts_that_do_not_fit_are_named(field, fn, message):
    q = rtn(torch.randn(8, 64, generator=GEN), 4, 32, sym=True)
    q.check()
    with pytest.raises(ValueError, match=message):
        _broken(q, field, fn).check()


@pytest.mark.parametrize(("field", "fn", "message"), [
    ("lookup_table", lambda t: t[:-1], r"lookup_table \[7, 8\] must be \[8, 2\^bits\]"),
    ("lookup_table", lambda t: t[:, :4], "indices must be below 4"),
    ("sparse_rows", lambda t: t[:-1], r"sparse_rows \[8\] must be the CSR pointers of 8"),
    ("sparse_rows", lambda t: t.flip(0), "must be the CSR pointers"),
    ("sparse_cols", lambda t: t + 64, "sparse_cols must be below 64"),
])
def test_lookup_table_parts_that_do_not_fit_are_named(field, fn, message):
    lut = squeezellm(torch.randn(8, 64, generator=GEN), torch.ones(8, 64), 3,
                     outlier_fraction=4 / 512, sensitive_fraction=0)
    lut.check()
    with pytest.raises(ValueError, match=message):
        _broken(lut, field, fn).check()


@pytest.mark.parametrize("act_order", [False, True])
def test_input_slices_are_the_layers_columns(act_order):
    """A row-parallel rank's share of a quantized layer: its input channels, with the groups
    they use (contiguous groups stay whole and sorted, so the CPU kernels still run them)."""
    w = torch.randn(16, 128, generator=GEN)
    q = gptq(w, _hessian(torch.randn(256, 128, generator=GEN)), 4, 32, sym=False,
             act_order=act_order)
    lut = squeezellm(w, torch.ones_like(w), 3, outlier_fraction=0.05, sensitive_fraction=0)
    for start, end in ((0, 64), (64, 128)):
        part = q.input_slice(start, end)
        part.check()
        assert torch.equal(part.dequantize(), q.dequantize()[:, start:end])
        assert act_order or (part.scales.shape[0] == 2 and sorted_by_group([part]) is not None)
        lut_part = lut.input_slice(start, end)
        lut_part.check()
        assert 0 < len(lut_part.sparse_values) < len(lut.sparse_values)
        assert torch.equal(lut_part.dequantize(), lut.dequantize()[:, start:end])


def test_squeezellm_keeps_sensitive_weights_closer_and_outliers_exact():
    w = torch.randn(40, 96, generator=GEN)
    w[3, 7], w[20, 50] = 25.0, -30.0  # outliers far outside every row's range
    fisher = torch.rand(40, 96, generator=GEN) ** 8  # a few weights matter much more
    weighted = squeezellm(w, fisher, 3, outlier_fraction=2 / w.numel(), sensitive_fraction=0)
    flat = squeezellm(w, torch.ones_like(w), 3, outlier_fraction=2 / w.numel(),
                      sensitive_fraction=0)
    error = {name: float((fisher * (q.dequantize() - w) ** 2).sum())
             for name, q in (("weighted", weighted), ("flat", flat))}
    assert error["weighted"] < 0.8 * error["flat"]
    got = weighted.dequantize()
    assert abs(got[3, 7] - 25.0) < 0.02 and abs(got[20, 50] + 30.0) < 0.02
    assert weighted.sparse_cols.tolist() == [7, 50]
    assert weighted.lookup_table.shape == (40, 8) and int(weighted.indices.max()) < 8
    # The most sensitive weight beyond the outliers joins the sparse part, exactly.
    both = squeezellm(w, fisher, 3, outlier_fraction=2 / w.numel(),
                      sensitive_fraction=1 / w.numel())
    fisher[3, 7] = fisher[20, 50] = 0
    row, col = divmod(int(fisher.argmax()), w.shape[1])
    assert int(both.sparse_rows[-1]) == 3
    assert abs(both.dequantize()[row, col] - w[row, col]) < 2e-3


def test_squeezellm_finds_each_weights_nearest_centroid():
    """The k-means finds each weight's nearest centroid by a binary search among the
    midpoints of its row's ascending centroids: the value argmin over all of them picks (the
    lower of two as near), with 256 centroids, and with repeated ones at whole numbers, the
    weights at halves: on a centroid or exactly between two."""
    centroids = torch.randn(6, 256, generator=GEN).sort(dim=1).values
    centroids[:2] = torch.randint(-3, 4, (2, 256), generator=GEN).sort(dim=1).values.float()
    w = torch.randn(6, 512, generator=GEN)
    w[:2] = torch.randint(-8, 9, (2, 512), generator=GEN) / 2
    distances = (w.unsqueeze(2) - centroids.unsqueeze(1)).abs()
    nearest = centroids.gather(1, distances.argmin(dim=2))
    assert torch.equal(centroids.gather(1, _nearest(w, centroids)), nearest)


def _bf16_reference(x: torch.Tensor, q) -> torch.Tensor:  # noqa: ANN001
    """What the kernels compute: bfloat16 activations times the dequantized weight."""
    return x.bfloat16().float() @ q.dequantize().t()


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("rows", [1, 6])  # WxA8 serves up to 4 rows per pass
def test_4bit_kernels_match_the_dequantized_weight(act_order, rows):
    torch.manual_seed(0)
    w, x = torch.randn(48, 128), torch.randn(rows, 128)
    q = gptq(w, _hessian(torch.randn(256, 128)), 4, 64, sym=False, act_order=act_order)
    assert not act_order or not torch.equal(q.g_idx, torch.arange(128) // 64)
    halves = [q.map_rows(lambda t: t[:16]), q.map_rows(lambda t: t[16:])]
    kernels = cpu_candidates(halves).packed()
    assert {type(k) for k in kernels} == {Int4Weight} | ({WxA8Weight} if cpu_kernels() else set())
    want = _bf16_reference(x, q)
    for kernel in kernels:
        assert (kernel.input_order is not None) == act_order
        # bfloat16 activations, or int8 ones with a scale per row and group of 64
        assert (kernel.matmul(x) - want).abs().max() < 0.02 * want.abs().max()


def test_cuda_int4_input_holds_even_channels_in_the_high_nibble():
    """`_convert_weight_to_int4pack` on CUDA takes [out, in / 2] bytes, channel 2j in the high
    nibble (torchao and gpt-fast pack so): a swap would pair each weight with its neighbour's
    input."""
    w = torch.tensor([[1, 2, 3, 4], [15, 0, 7, 8]])
    assert cuda_nibble_pairs(w).tolist() == [[0x12, 0x34], [0xF0, 0x78]]
    assert cuda_nibble_pairs(w).dtype == torch.uint8


def test_torch_int4_fits_its_kernels_group_sizes_and_widths():
    cpu = torch.device("cpu")
    assert int4_weight_fits((96, 256), 64, cpu)
    assert not int4_weight_fits((96, 256), 16, cpu)  # no kernel variant for groups of 16
    assert not int4_weight_fits((40, 256), 64, cpu)  # outputs not a multiple of 16
    assert not int4_weight_fits((96, 256), 64, torch.device("meta"))


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("rows", [1, 6])
def test_8bit_kernels_match_the_dequantized_weight(sym, rows):
    torch.manual_seed(0)
    w, x = torch.randn(40, 128), torch.randn(rows, 128) + 1  # a mean: zero points matter
    q = rtn(w, 8, 128, sym=sym)
    kernels = cpu_candidates([q]).packed()
    assert {type(k) for k in kernels} == {Int8Weight} | ({WxA8Weight} if cpu_kernels() else set())
    assert all(k.zero_terms is None for k in kernels if isinstance(k, Int8Weight)) == sym
    want = _bf16_reference(x, q)
    for kernel in kernels:
        assert (kernel.matmul(x) - want).abs().max() < 0.02 * want.abs().max()
    grouped = cpu_candidates([rtn(w, 8, 64, sym=sym)]).packed()  # groups: only W8A8 runs them
    assert [type(k) for k in grouped] == ([WxA8Weight] if cpu_kernels() else [])


def _wxa8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, group: int) -> torch.Tensor:
    """What the W4A8/W8A8 kernel computes, in float64: each row's activations rounded to int8
    per group (scale max|x| / 127), times the integers q [out, in] less their group's zero,
    times its scale."""
    rows, groups = x.shape[0], x.shape[1] // group
    x_groups = x.reshape(rows, groups, group)
    amax = x_groups.abs().amax(-1, keepdim=True)
    # The kernel's float32 127 / amax, rounded once: torch's own float32 division by a tensor
    # can be an ulp off it, which moves a level that lands near a half.
    levels = (x_groups * (127 / amax.double()).float()).round()
    x_int8 = (levels * (amax / 127)).double().reshape(rows, -1)
    weight = (q.double() - zeros.double().repeat_interleave(group, 1)) * \
        scales.double().repeat_interleave(group, 1)
    return x_int8 @ weight.t()


@pytest.mark.parametrize("bits", [4, 8])
def test_wxa8_kernel_computes_its_integer_products_exactly(bits):
    """See _check_wxa8_products: on this CPU's own build of the kernels."""
    gemm = cpu_kernels()
    if gemm is None:
        pytest.skip("no CPU kernels")
    _check_wxa8_products(gemm, bits)


WXA8_MODULE = Path(__file__).parent / "wxa8_module.cpp"


@pytest.fixture(scope="module", params=["avx2", "avx_vnni"])
def avx2_kernels(request) -> tuple[str, ModuleType]:
    """The W4A8/W8A8 kernels built as for a CPU with AVX2 and nothing newer (no AVX-512 or
    AMX), with AVX-VNNI or without (named): code paths this CPU's own build leaves out."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or cpu_kernels() is None:
        pytest.skip("this CPU's own build is the AVX2 one, or there is none")
    flags = ["-mno-avx512f", "-mno-amx-tile"]
    if request.param == "avx2":
        flags.append("-mno-avxvnni")
    elif "avx_vnni" not in cpu_flags():
        pytest.skip("no AVX-VNNI on this CPU")
    sources = [CSRC / name for name in ("gemm.cpp", "norm_activation.cpp", "wxa8.cpp")]
    built = build("kvserve_wxa8", [*sources, WXA8_MODULE], f"{request.param} W4A8/W8A8 kernels",
                  [f"-I{CSRC}", *flags])
    assert built is not None
    return request.param, built


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
def test_wxa8_kernel_computes_its_integer_products_exactly_on_avx2(avx2_kernels, bits):
    """AVX2's GEMM runs from 32 rows up with maddubs alone, from 16 with AVX-VNNI."""
    isa, kernels = avx2_kernels
    first = 16 if isa == "avx_vnni" else 32
    assert kernels.wxa8_gemm_runs(first, 8) and not kernels.wxa8_gemm_runs(first - 1, 8)
    _check_wxa8_products(kernels, bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_w4a8_layer_runs_its_integer_gemm_from_its_gemm_from_rows(bits):
    """gemm_from moves the integer GEMM's start to fewer rows than the build's own, on every
    path a layer's rows take (wxa8_linear, as the decode stack runs it): below it the few-rows
    kernel, from it the GEMM, to the bit; the two agree to float32 rounding. A layer whose
    outputs the GEMM does not tile keeps the few-rows kernel."""
    gemm = cpu_kernels()
    if gemm is None or not gemm.wxa8_gemm_runs(256, 16):
        pytest.skip("no integer GEMM in this build")
    torch.manual_seed(0)
    kernel = cpu_candidates([rtn(torch.randn(64, 256), bits, 64, sym=False)]).packers[
        WxA8Weight]()
    args = (kernel.packed, kernel.scales, kernel.zeros, 64, bits)
    for m in (2, 3, 5):
        x = torch.randn(m, 256)
        assert gemm.wxa8_gemm_runs(m, 64, m) and not gemm.wxa8_gemm_runs(m - 1, 64, m)
        few_rows, integer_gemm = (gemm.wxa8_matmul(x, *args, gemm_from=g) for g in (m + 1, m))
        assert torch.allclose(integer_gemm, few_rows, rtol=1e-5, atol=1e-5)
        assert torch.equal(dataclasses.replace(kernel, gemm_from=m).matmul(x), integer_gemm)
        assert torch.equal(dataclasses.replace(kernel, gemm_from=m + 1).matmul(x), few_rows)
    assert not gemm.wxa8_gemm_runs(256, 12, 2)  # not a whole number of the GEMM's outputs


def test_a_w4a8_layer_times_where_its_integer_gemm_starts_below_the_builds_count(monkeypatch):
    """row_crossovers times the GEMM against the few-rows kernel only at the counts from
    GEMM_TIMED_FROM up that the build leaves to the few-rows kernel (fake timings: the GEMM a
    fixed cost plus a little per row, the few-rows kernel a pass per row), and keeps the first
    it wins at."""
    gemm = cpu_kernels()
    if gemm is None:
        pytest.skip("no CPU kernels")
    kernel = cpu_candidates([rtn(torch.randn(64, 256), 4, 64, sym=False)]).packers[
        WxA8Weight]()
    timed = []

    def fake_time(fn, x, runs):
        rows = x.shape[0]
        on_gemm = gemm.wxa8_gemm_runs(rows, 64, fn.__self__.gemm_from or 0)
        timed.append((rows, on_gemm))
        return 10 + rows if on_gemm else 4 * rows

    monkeypatch.setattr(cpu_kernels_module, "_median_time", fake_time)
    monkeypatch.setattr(cpu_kernels_module, "amx_int8_runs", lambda kernel: False)
    monkeypatch.setattr(cpu_kernels_module, "dequantized_gemm_runs", lambda k, dtype: False)
    routed = cpu_kernels_module.row_crossovers(kernel, torch.float32)
    earlier = [rows for rows in (16, 32, 64, 128, 256)
               if gemm.wxa8_gemm_runs(rows, 64, rows) and not gemm.wxa8_gemm_runs(rows, 64)]
    if not earlier:  # no GEMM, or one from 16 rows (VNNI): nothing to time
        assert routed.gemm_from is None and not timed
        return
    assert routed.gemm_from == earlier[0] == 16
    assert timed == [(16, True), (16, False)]
    monkeypatch.setattr(cpu_kernels_module, "_median_time",
                        lambda fn, x, runs: 1.0 if fn.__self__.gemm_from else 0.5)
    assert cpu_kernels_module.row_crossovers(kernel, torch.float32).gemm_from is None


def _check_wxa8_products(gemm: ModuleType, bits: int) -> None:
    """Groups of 1 to 16 blocks of 64 channels (the AVX2 per-row path without AVX-VNNI sums up
    to 4 blocks in int16 lanes; the GEMM transposes 256 or 512 channels at a time, a group's
    zero point applied once), group counts around its 8 at a time, 1 to 5 rows (4 per pass),
    the many-row GEMM's 16 (VNNI, AVX-VNNI) or 32 (AVX2) rows and more (VNNI: tiles of 4 rows x
    64 outputs, 80 outputs leave a 16-output tile and 24 keep the per-row kernel; AVX2: tiles
    of 2 rows x 32 outputs, 80 outputs leave a 16-output tile and 24 are one of 24), and the
    largest products every lane can hold: weights at their maximum, activations all at 127,
    and weights at zero, activations at -127 (without AVX-VNNI, AVX2's GEMM sums 8 channel
    quads of 4-bit values, or of 8-bit values' nibbles, in int16 lanes before widening, and on
    one or two rows multiplies 8-bit weights as q - 128 by the activations given their signs).
    With AVX512-VNNI, 4-bit weights on few rows run over pairs of blocks, 4 or 2 outputs at a
    time: 21 outputs leave one over, and 9 groups of 64 channels a block without a pair.
    Without VNNI, 8-bit weights on one or two rows go over each thread's outputs as 4 (2) runs
    side by side: 21 and 80 outputs leave some over; 4-bit weights on one row go 4 outputs at
    a time, adjacent rows up to 512 bytes and 4 runs apart above (2,176 channels). A 4-bit
    row has the same bits alone as beside up to 3 others. Zeros given as one row for every
    output (a symmetric layer's) give the bits that row repeated for each output gives.
    bfloat16 rows give the float32 rows' output rounded to bfloat16."""
    torch.manual_seed(0)
    top = (1 << bits) - 1
    for (group, groups), n in itertools.product(
            ((64, 9), (128, 8), (128, 17), (192, 3), (256, 1), (512, 2), (1024, 1)),
            (21, 24, 80)):
        k = group * groups
        scales, zeros = torch.rand(n, groups) + 0.5, torch.randint(0, top + 1, (n, groups))
        shared_zeros = zeros[:1].float()
        for q, x in ((torch.randint(0, top + 1, (n, k)), torch.randn(35, k)),
                     (torch.full((n, k), top), torch.ones(35, k)),
                     (torch.zeros(n, k, dtype=torch.long), -torch.ones(35, k))):
            packed = wxa8_packed(q, bits)
            for rows in (1, 2, 3, 4, 5, 16, 23, 32, 35):
                got = gemm.wxa8_matmul(x[:rows].contiguous(), packed, scales, zeros.float(),
                                       group, bits)
                want = _wxa8_reference(x[:rows], q, scales, zeros.float(), group)
                assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), \
                    (group, groups, rows)
                assert torch.equal(
                    gemm.wxa8_matmul(x[:rows].contiguous(), packed, scales, shared_zeros, group,
                                     bits),
                    gemm.wxa8_matmul(x[:rows].contiguous(), packed, scales,
                                     shared_zeros.expand(n, -1).contiguous(), group, bits)), \
                    (group, groups, rows)
                if rows == 1:
                    one_row = got
                elif rows <= 4 and bits == 4:  # a row's bits, whatever its company in a pass
                    assert torch.equal(got[:1], one_row), (group, groups, rows)
    # bfloat16 rows, read and rounded in the kernel's own loops, as torch would convert them
    x = torch.randn(20, 576).bfloat16()
    q = torch.randint(0, top + 1, (48, 576))
    scales, zeros = torch.rand(48, 9) + 0.5, torch.randint(0, top + 1, (48, 9)).float()
    for rows in (1, 3, 20):
        got = gemm.wxa8_linear(x[:rows], wxa8_packed(q, bits), scales, zeros, None, 64, bits, 0,
                               0, 0)
        want = gemm.wxa8_linear(x[:rows].float(), wxa8_packed(q, bits), scales, zeros, None, 64,
                                bits, 0, 0, 0)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16()), rows


def test_w4a8_keeps_one_row_of_zeros_for_a_symmetric_layer():
    """A symmetric layer's zero points are the same for every output, so one row of them is
    kept: its 4-bit weights in groups of 64 channels take 36 bytes a group, not 40, and give
    the bits the full zeros give. Zeros of another number of rows are refused by name."""
    gemm = cpu_kernels()
    if gemm is None:
        pytest.skip("no CPU kernels")
    torch.manual_seed(0)
    w, x = torch.randn(48, 256), torch.randn(3, 256)
    sym = cpu_candidates([rtn(w, 4, 64, sym=True)]).packers[WxA8Weight]()
    asym = cpu_candidates([rtn(w, 4, 64, sym=False)]).packers[WxA8Weight]()
    assert sym.zeros.shape == (1, 4) and asym.zeros.shape == (48, 4)
    assert sym.num_bytes == 48 * 4 * (32 + 4) + 4 * 4
    full = dataclasses.replace(sym, zeros=sym.zeros.expand(48, -1).contiguous())
    for rows in (1, 3):
        assert torch.equal(sym.matmul(x[:rows]), full.matmul(x[:rows]))
    with pytest.raises(RuntimeError, match=r"zeros of \[n, k / group\], or of \[1, k / group\]"):
        gemm.wxa8_matmul(x, asym.packed, asym.scales, asym.zeros[:2].contiguous(), 64, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantizing_gemm_gives_the_dense_gemms_bits(dtype, bits):
    """Each block dequantized into the GEMM's tiles is the packed dequantized weight: the same
    bits as the dense GEMM over it, for few rows, a tile's 6, and over 256 (the AMX path
    that splits rows between threads), with a partial last block (40 outputs), and with a
    zero point per output and group or (symmetric) one row of them for all."""
    if not dequantized_gemm_runs(256, dtype):
        pytest.skip(f"no blocked GEMM for {dtype} on this CPU")
    torch.manual_seed(0)
    gemm = cpu_kernels()
    for (out_features, group), sym in itertools.product(((40, 64), (96, 128)), (False, True)):
        q = rtn(torch.randn(out_features, 256), bits, group, sym=sym)
        kernel = cpu_candidates([q]).packers[WxA8Weight]()
        assert len(kernel.zeros) == (1 if sym else out_features)
        packed = gemm.pack_weight([q.dequantize().to(dtype)], dtype)
        for rows in (1, 6, 33, 300):
            x = torch.randn(rows, 256).to(dtype)
            got = gemm.dequantized_linear(x, kernel.packed, kernel.scales, kernel.zeros,
                                          kernel.group_size, kernel.bits)
            assert torch.equal(got, gemm.blocked_linear(x, packed, out_features, None))


def test_w4a8_layers_run_many_rows_through_the_dequantizing_gemm():
    if not dequantized_gemm_runs(128, torch.float32):
        pytest.skip("no blocked GEMM on this CPU")
    torch.manual_seed(0)
    w = torch.randn(48, 128)
    q = gptq(w, _hessian(torch.randn(256, 128)), 4, 64, sym=False, act_order=True)
    kernel = cpu_candidates([q]).packers[WxA8Weight]()
    routed = dataclasses.replace(kernel, dequantized_from=4)
    dense = q.dequantize()
    few, many = torch.randn(3, 128), torch.randn(5, 128)
    assert torch.equal(routed.matmul(few), kernel.matmul(few))  # int8 activations
    gemm = cpu_kernels()
    packed = gemm.pack_weight([dense[:, kernel.input_order].contiguous()], dense.dtype)
    assert torch.equal(routed.matmul(many), gemm.blocked_linear(  # the act-order input too
        many[:, kernel.input_order].contiguous(), packed, 48, None))
    assert not torch.equal(routed.matmul(many), kernel.matmul(many))


@pytest.mark.parametrize("bits", [4, 8])
def test_amx_int8_tiles_give_the_w4a8_kernels_products(bits):
    """The same integer products as the VNNI kernel, scaled in another order: one partial slab
    of 16 rows, several, and (8,192 channels) more rows than one pass keeps in L2, in groups of
    one, two and four 128-channel tile pairs, with zero points per output or (symmetric) one
    row of them for all; shapes it cannot take are left to VNNI."""
    torch.manual_seed(0)
    probe = cpu_candidates([rtn(torch.randn(48, 256), bits, 128, sym=False)]).packed()
    if not probe or not amx_int8_runs(probe[-1]):
        pytest.skip("no AMX int8 tiles on this CPU")
    gemm = cpu_kernels()
    for out_features, in_features, group, rows, sym in (
            (48, 256, 128, (1, 5, 16, 17, 40), False), (48, 256, 128, (17,), True),
            (32, 512, 256, (3, 33), False), (32, 512, 512, (3, 33), True),
            (16, 8192, 128, (70,), False)):
        q = rtn(torch.randn(out_features, in_features), bits, group, sym=sym)
        kernel = cpu_candidates([q]).packers[WxA8Weight]()
        for m in rows:
            x = torch.randn(m, in_features) + 0.5
            args = (x, kernel.packed, kernel.scales, kernel.zeros, group, bits)
            want = gemm.wxa8_matmul(*args)
            got = gemm.wxa8_amx_matmul(*args)
            # float32 rounding of large cancelling zero terms: a channel laid out wrongly is
            # off by a whole product
            assert (got - want).abs().max() <= 1e-4 * want.abs().max()
            routed = dataclasses.replace(kernel, amx_from=m)
            assert torch.equal(routed.matmul(x), got)
            assert torch.equal(dataclasses.replace(kernel, amx_from=m + 1).matmul(x), want)
    grouped_64 = cpu_candidates([rtn(torch.randn(48, 256), bits, 64, sym=False)])
    grouped_64 = grouped_64.packers[WxA8Weight]()
    assert not amx_int8_runs(grouped_64)
    odd_outputs = cpu_candidates([rtn(torch.randn(40, 256), bits, 128, sym=False)])
    odd_outputs = odd_outputs.packers[WxA8Weight]()
    assert not amx_int8_runs(odd_outputs)


def test_dequantize_gives_each_channel_its_groups_scale_and_zero():
    """Contiguous groups take the broadcast path, act-order ones the per-channel gather: both
    compute (q - zero[g_idx]) * scale[g_idx] to the bit."""
    torch.manual_seed(0)
    w = torch.randn(24, 256)
    for q in (rtn(w, 4, 64, sym=False),
              gptq(w, _hessian(torch.randn(512, 256)), 4, 64, sym=False, act_order=True)):
        want = (q.intweight.float() - q.zeros.t().float()[:, q.g_idx]) * \
            q.scales.t().float()[:, q.g_idx]
        assert torch.equal(q.dequantize(), want)


def test_layers_no_kernel_fits_stay_dense():
    torch.manual_seed(0)
    w = torch.randn(48, 128)
    assert cpu_candidates([rtn(w, 8, 32, sym=True)]).packed() == []  # int8 takes one group per row
    # 40 outputs (not 16-aligned for int4) in groups of 32 (W4A8 takes multiples of 64)
    assert cpu_candidates([rtn(w[:40], 4, 32, sym=True)]).packed() == []
    a, b = (gptq(w, _hessian(torch.randn(256, 128) * s), 4, 32, True, act_order=True)
            for s in (torch.ones(128), torch.linspace(0.1, 2, 128)))
    assert cpu_candidates([a, b]).packed() == []  # shards ordering their inputs differently


@pytest.mark.parametrize(("crossover", "timed_rows"), [(64, [256, 1, 2, 4, 8, 16, 32, 64]),
                                                        (None, [256])])
def test_a_crossover_is_searched_only_where_the_challenger_wins_at_the_most_rows(
        monkeypatch, crossover, timed_rows):
    """The fewest rows from which a kernel beats another, and a kernel slower at the most rows
    is timed there only (each timing is the per-row cost each fake kernel is given)."""
    timed = []

    class Kernel:
        in_features = 64

        def __init__(self, cost):
            self.cost = cost

        def matmul(self, x):
            return self.cost(x.shape[0])

    def fake_time(fn, x, runs):
        if fn.__self__ is challenger:
            timed.append(x.shape[0])
        return fn(x)

    challenger = Kernel(lambda rows: 1.0 if crossover and rows >= crossover else 3.0)
    monkeypatch.setattr(cpu_kernels_module, "_median_time", fake_time)
    assert cpu_kernels_module._first_faster(challenger, Kernel(lambda rows: 2.0),
                                            torch.float32) == crossover
    assert timed == timed_rows


def test_a_timed_kernel_reads_its_own_weights_from_memory_and_nothing_else_is_evicted(
        monkeypatch):
    """A layer's timing evicts the tensors of the kernel (or layer) whose method it times, so
    its weights come from memory as in a decode step while its code and buffers stay warm; a
    callable with no such owner empties the caches."""
    evicted, flushes = [], []
    monkeypatch.setattr(cpu_kernels_module, "evict_from_caches",
                        lambda tensors: evicted.append([t.data_ptr() for t in tensors]))
    monkeypatch.setattr(cpu_kernels_module, "flush_cpu_caches", lambda: flushes.append(1))
    intweight = torch.randint(0, 16, (32, 128), dtype=torch.uint8)
    kernel = Int8Weight(intweight.to(torch.int8), torch.ones(32, dtype=torch.bfloat16), None)
    cpu_kernels_module._median_time(kernel.matmul, torch.randn(1, 128), runs=3)
    assert evicted == [[kernel.weight.data_ptr(), kernel.scales.data_ptr()]] * 3 and not flushes
    cpu_kernels_module._median_time(lambda x: x @ intweight.float().t(), torch.randn(1, 128),
                                    runs=3)
    assert len(evicted) == 3 and len(flushes) == 3
    if cpu_kernels() is not None:  # any size, the last line included; contiguous ones only
        for t in (torch.empty(0), torch.ones(3, dtype=torch.uint8), torch.ones(1000)):
            cpu_kernels().evict_from_caches(t)
        with pytest.raises(RuntimeError, match="contiguous"):
            cpu_kernels().evict_from_caches(torch.ones(4, 4).t())


@pytest.mark.parametrize("gemm_runs", [True, False])
def test_w4a8_within_its_one_row_slack_is_chosen_where_its_integer_gemm_serves_many_rows(
        monkeypatch, gemm_runs):
    """PyTorch's int4 kernel, 1.2x as fast on one row (stubbed timings), has no fast path for
    many rows: W4A8 is kept where its integer GEMM runs them, and loses where nothing does."""
    if cpu_kernels() is None or not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("no W4A8 or no int4 kernel in this build")
    candidates = cpu_candidates([rtn(torch.randn(64, 256), 4, 128, sym=False)])
    assert set(candidates.packers) == {Int4Weight, WxA8Weight}
    one_row = {Int4Weight: 1.0, WxA8Weight: 1.2}
    monkeypatch.setattr(cpu_kernels_module, "_decisions", {})
    monkeypatch.setattr(cpu_kernels_module, "_median_time",
                        lambda fn, x, runs=15: one_row[type(fn.__self__)])
    monkeypatch.setattr(cpu_kernels_module, "row_crossovers", lambda kernel, dtype: kernel)
    monkeypatch.setattr(cpu_kernels_module, "integer_gemm_runs", lambda kernel: gemm_runs)
    chosen = cpu_kernels_module.fastest(candidates, None, 256, torch.float32)
    assert isinstance(chosen, WxA8Weight if gemm_runs else Int4Weight)
