"""Quantized matmuls on CPU for GPTQ and AWQ layers, through PyTorch's packed integer kernels
and one of ours:
- int4 (`_weight_int4pack_mm_for_cpu`, bfloat16 activations): values of at most 4 bits
  (3-bit ones too), with a scale and zero per group of 32-256 input channels.
- int8 (`_weight_int8pack_mm`, bfloat16 activations): values of up to 8 bits with one scale
  per output channel. The kernel has no zero points, so the integers are stored offset by
  128 and the zero's share, `scale * (zero - 128) * sum(x)`, is subtracted from the output.
- W4A8 and W8A8 (`kvserve/csrc/wxa8.cpp`): 4- and 8-bit layers with groups of a multiple of 64
  channels; each row's activations are quantized to int8 per group and the group's integer
  dot products run on VNNI (AVX-512's or AVX-VNNI's; AVX2's maddubs without either), as
  llama.cpp's Q4/Q8 x Q8 paths do. Each of a few rows costs a pass over the weight; from 16
  rows up with VNNI (on AVX2 alone from 16 where timed faster there at load, else 32) they
  run as a GEMM instead, over the weights transposed chunk by chunk in L1 into the
  instruction's operand layout (about 3x the dense float32 GEMM's rate at 64-256 rows on a
  2-core AVX-512 EPYC; with AVX-VNNI alone, 3-3.5x; with maddubs alone, 1.5x at 8 bits and
  2x at 4). Where the CPU has AMX (and groups are of a
  multiple of 128 channels), from a measured number of rows up the same products run on its
  int8 tiles instead, 16 rows to a tile. From another measured number up, the same bytes are
  dequantized block by block into the blocked GEMM's tiles (`kvserve/csrc/dequantize.h`,
  where that GEMM is built): its rate, once enough rows share each dequantized block.
Act-order layers, whose groups are scattered over the input channels, run with the channels
sorted by group and each input gathered into that order.

All stream a quarter (8-bit) or an eighth (4-bit) of the float32 weight bytes. Which is
fastest, and whether any beats the dense float32 GEMM, depends on the CPU (VNNI, bfloat16
support) and the shape, so the engine times them on each layer shape at load and keeps the
fastest for one-row steps, the case quantized models are served for (`kernels.py` makes the
choice), and for W4A8/W8A8 the row counts from which its integer GEMM, its AMX tiles and the
dequantizing GEMM are faster.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.cpp_extension import cpu_kernels
from kvserve.cpu_cache import evict_from_caches, flush_cpu_caches
from kvserve.quantization.gptq import QuantizedWeight, sorted_by_group
from kvserve.quantization.torch_int4 import Int4Weight, int4_weight, int4_weight_fits


@dataclass(frozen=True)
class Int8Weight:
    weight: torch.Tensor  # [out, in] int8: the integers minus 128
    scales: torch.Tensor  # [out] bfloat16
    zero_terms: torch.Tensor | None  # [out] float32, scale * (zero - 128); None if all 0

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).bfloat16()
        out = torch._weight_int8pack_mm(rows, self.weight, self.scales)
        if self.zero_terms is not None:
            out = out.float() - rows.float().sum(1, keepdim=True) * self.zero_terms
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


@dataclass(frozen=True)
class WxA8Weight:
    packed: torch.Tensor  # [out, in * bits / 8] uint8, in blocks of 64 channels (wxa8.cpp)
    scales: torch.Tensor  # [out, groups] float32
    # [out, groups] float32, or [1, groups] where every output has the same zero points (a
    # symmetric layer's): one row, read for every output, so the weights stream with their
    # scales alone.
    zeros: torch.Tensor
    group_size: int
    bits: int  # 4 or 8
    input_order: torch.Tensor | None  # act-order: the input channels sorted by group
    # From this many rows up, the integer GEMM runs it (None: from the build's own count).
    gemm_from: int | None = None
    # From this many rows up, the AMX int8 tiles run it (None: never).
    amx_from: int | None = None
    # From this many rows up, the dequantizing GEMM runs (None: never).
    dequantized_from: int | None = None

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.zeros))

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 8 // self.bits

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """On `wxa8_linear`, which the CPU decode stack runs too."""
        out = cpu_kernels().wxa8_linear(x.reshape(-1, x.shape[-1]), self.packed, self.scales,
                                        self.zeros, self.input_order, self.group_size,
                                        self.bits, self.amx_from or 0,
                                        self.dequantized_from or 0, self.gemm_from or 0)
        return out.reshape(*x.shape[:-1], -1)


IntegerWeight = Int4Weight | Int8Weight | WxA8Weight


def wxa8_packed(intweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The integers [out, in] in wxa8.cpp's layout: per 64 input channels, 4 bits as 32 bytes
    (channel j in the low nibble of byte j, channel j + 32 in its high one); 8 bits as they
    are."""
    packed = intweight.to(torch.uint8)
    if bits == 4:
        blocks = packed.reshape(packed.shape[0], -1, 2, 32)
        packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(packed.shape[0], -1)
    return packed.contiguous()


@dataclass(frozen=True)
class CpuCandidates:
    """The CPU kernels able to run a layer. Each packs the layer for itself only when called
    (and once), so a layer whose kernel was chosen on another layer of its shape packs only
    that one."""

    layout: tuple[int, int, int, bool]  # out_features, bits, group size, act-order
    packers: dict[type[IntegerWeight], Callable[[], IntegerWeight]]

    def packed(self) -> list[IntegerWeight]:
        return [pack() for pack in self.packers.values()]


def cpu_candidates(shards: list[QuantizedWeight]) -> CpuCandidates:
    """The CPU kernels that can run the shards (a fused layer's, in output order)."""
    grouped = sorted_by_group(shards)
    if grouped is None:
        return CpuCandidates((0, 0, 0, False), {})
    intweight, order, group_size = grouped
    bits = 4 if int(intweight.max()) <= 15 else 8
    scales = torch.cat([s.scales for s in shards], dim=1)
    zeros = torch.cat([s.zeros for s in shards], dim=1).float()
    out_features = intweight.shape[0]
    packers: dict[type[IntegerWeight], Callable[[], IntegerWeight]] = {}
    if bits == 4 and int4_weight_fits(intweight.shape, group_size, torch.device("cpu")):
        def int4() -> Int4Weight:
            return int4_weight(intweight, scales, zeros, group_size, order,
                               torch.device("cpu"))
        packers[Int4Weight] = int4
    if bits == 8 and len(scales) == 1 and hasattr(torch, "_weight_int8pack_mm"):
        def int8() -> Int8Weight:
            weight = (intweight.to(torch.int16) - 128).to(torch.int8).contiguous()
            # The output's scale is the bfloat16 one the kernel applies.
            bf16_scales = scales[0].bfloat16().contiguous()
            return Int8Weight(weight, bf16_scales, None if bool((zeros == 128).all())
                              else bf16_scales.float() * (zeros[0] - 128))
        packers[Int8Weight] = int8
    if group_size % 64 == 0 and cpu_kernels() is not None:
        def wxa8() -> WxA8Weight:
            by_output = zeros.t()
            shared = bool((by_output == by_output[:1]).all())
            return WxA8Weight(wxa8_packed(intweight, bits), scales.t().contiguous(),
                              (by_output[:1] if shared else by_output).contiguous(), group_size,
                              bits, order)
        packers[WxA8Weight] = wxa8
    return CpuCandidates((out_features, bits, group_size, order is not None),
                         {kind: functools.cache(pack) for kind, pack in packers.items()})


# By input size, layout, kernels and dtype: the chosen candidate's index (past the end: the dense
# GEMM), and W4A8/W8A8's measured row crossovers (its fields ROW_CROSSOVERS).
_decisions: dict[tuple[object, ...], tuple[int, dict[str, int | None]]] = {}
ROW_CROSSOVERS = ("gemm_from", "amx_from", "dequantized_from")
# How much slower on one row W4A8/W8A8 may be than the fastest kernel and still be chosen,
# where its integer GEMM, AMX tiles or dequantizing GEMM serve many rows: the others have no fast
# path for them (torch's int4 took 28x one row's time for 64 rows of a 2,048 x 128,256 LM
# head, 1.07x as fast as W4A8 on one row; W4A8 through the dequantizing GEMM 3.5x).
ONE_ROW_SLACK = 1.25
# How much faster on one row the dense GEMM must be for a quantized layer to run dequantized:
# its weight takes 2-4x the memory. A close call flipped between runs on the 1,024 experts'
# down projections of an 8-layer Qwen3-30B-A3B-shaped 4-bit model; where it went dense, a
# token streamed 145 MB more (TPOT 13.0-13.9 ms against 11.7) and the model held 2.3 GB more.
DENSE_MARGIN = 1.25


def fastest(candidates: CpuCandidates,
            dense: Callable[[], Callable[[torch.Tensor], torch.Tensor]] | None,
            in_features: int, dtype: torch.dtype) -> IntegerWeight | None:
    """The candidate fastest on one row of this shape, or None where the dense matmul `dense`
    builds (if given; called only to time it) beats them all by DENSE_MARGIN; measured once
    per shape, the median of a few runs each. W4A8/W8A8, where it runs many rows as an
    integer GEMM or its AMX tiles or dequantizing GEMM are faster from some row count up, is
    preferred to a kernel at most ONE_ROW_SLACK faster on one row, and switches to the
    latter from those row counts."""
    kinds = list(candidates.packers)
    key = (in_features, dense is None, dtype, candidates.layout, *kinds)
    if key not in _decisions:
        packed = candidates.packed()
        x = torch.randn(1, in_features, dtype=dtype)
        times = [_median_time(c.matmul, x) for c in packed]
        if dense is not None:
            times.append(DENSE_MARGIN * _median_time(dense(), x))
        index = min(range(len(times)), key=times.__getitem__)
        crossovers: dict[str, int | None] = {}
        wxa8 = kinds.index(WxA8Weight) if WxA8Weight in kinds else None
        if (wxa8 is not None and index < len(packed)
                and times[wxa8] <= ONE_ROW_SLACK * times[index]):
            routed = row_crossovers(packed[wxa8], dtype)
            crossovers = {name: getattr(routed, name) for name in ROW_CROSSOVERS}
            if (routed.amx_from is not None or routed.dequantized_from is not None
                    or integer_gemm_runs(routed)):
                index = wxa8
        _decisions[key] = index, crossovers
    index, crossovers = _decisions[key]
    if index == len(kinds):
        return None
    chosen = candidates.packers[kinds[index]]()
    if isinstance(chosen, WxA8Weight):
        return dataclasses.replace(chosen, **crossovers)
    return chosen


CROSSOVER_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# The fewest rows at which the integer GEMM is timed against the few-rows kernel. On a 2-core
# AVX2 EPYC (Zen 3), where the build starts the GEMM at 32 rows, 4-bit layers of 256-768
# channels (weights in the caches) ran 16 rows in 0.36-0.59x the few-rows kernel's time, 4 in
# 0.53-0.90x; the load-time timing chose the GEMM from 2-8 rows on some of
# `qwen3-moe-small`'s layers, but its batch-8 decode steps then ran 1.09-1.14x slower than
# with the few-rows kernel, and 0.96x with the GEMM from 16 rows.
GEMM_TIMED_FROM = 16


def dequantized_gemm_runs(in_features: int, dtype: torch.dtype) -> bool:
    """Whether this CPU build has the blocked GEMM the dequantizing path runs on."""
    gemm = cpu_kernels()
    return gemm is not None and gemm.dequantized_linear_supports(
        torch.empty(1, in_features, dtype=dtype))


def integer_gemm_runs(kernel: WxA8Weight) -> bool:
    """Whether this CPU build runs the W4A8/W8A8 layer's many rows as its integer GEMM (VNNI
    or AVX2)."""
    gemm = cpu_kernels()
    return gemm is not None and gemm.wxa8_gemm_runs(CROSSOVER_ROWS[-1], kernel.packed.shape[0])


def amx_int8_runs(kernel: WxA8Weight) -> bool:
    """Whether this CPU build runs the W4A8/W8A8 layer on AMX's int8 tiles."""
    gemm = cpu_kernels()
    return gemm is not None and gemm.wxa8_amx_runs(kernel.in_features, kernel.packed.shape[0],
                                                   kernel.group_size)


def row_crossovers(kernel: WxA8Weight, dtype: torch.dtype) -> WxA8Weight:
    """The W4A8/W8A8 layer with its gemm_from, amx_from and dequantized_from measured: the
    fewest rows (of CROSSOVER_ROWS) at which its integer GEMM beats its few-rows kernel (from
    GEMM_TIMED_FROM, below the count the build starts it from), then at which the AMX tiles beat
    both, then at which the dequantizing GEMM beats all; None where one never does or is not
    built (for `dtype`)."""
    kernel = dataclasses.replace(kernel, gemm_from=None, amx_from=None, dequantized_from=None)
    earlier = _earlier_gemm_rows(kernel)
    if earlier:
        kernel = dataclasses.replace(kernel, gemm_from=_first_faster(
            dataclasses.replace(kernel, gemm_from=earlier[0]), kernel, dtype, earlier))
    if amx_int8_runs(kernel):
        kernel = dataclasses.replace(kernel, amx_from=_first_faster(
            dataclasses.replace(kernel, amx_from=1), kernel, dtype))
    if dequantized_gemm_runs(kernel.in_features, dtype):
        kernel = dataclasses.replace(kernel, dequantized_from=_first_faster(
            dataclasses.replace(kernel, dequantized_from=1), kernel, dtype))
    return kernel


def _earlier_gemm_rows(kernel: WxA8Weight) -> tuple[int, ...]:
    """The counts of CROSSOVER_ROWS from GEMM_TIMED_FROM up that the integer GEMM could run
    this layer's rows from but this build does not by itself."""
    gemm, n = cpu_kernels(), kernel.packed.shape[0]
    return tuple(rows for rows in CROSSOVER_ROWS if rows >= GEMM_TIMED_FROM
                 and gemm.wxa8_gemm_runs(rows, n, rows) and not gemm.wxa8_gemm_runs(rows, n))


def _first_faster(challenger: WxA8Weight, kernel: WxA8Weight, dtype: torch.dtype,
                  counts: tuple[int, ...] = CROSSOVER_ROWS) -> int | None:
    """The fewest row `counts` at which `challenger` is faster, or None. Its lead grows with
    the rows (it reads the weight once for more of them), so one slower at the most rows is
    not timed at fewer: where VNNI's GEMM beat the dequantizing one at every row count, the
    whole sweep added 3-4 s to a 4-bit llama3.2-1b's load (10.3-11.2 s, now 7.3)."""
    def faster(rows: int) -> bool:
        x = torch.randn(rows, kernel.in_features, dtype=dtype)
        return _median_time(challenger.matmul, x, 3) < _median_time(kernel.matmul, x, 3)

    if not faster(counts[-1]):
        return None
    return next(rows for rows in counts if rows == counts[-1] or faster(rows))


def _median_time(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 runs: int = 15) -> float:
    """Each run with the weights out of the caches: they come from memory, as in a step. The
    weights are the tensors of the object `fn` is a method of (a kernel, or the layer whose
    dense forward it is); where it has none, the caches are emptied."""
    owner = getattr(fn, "__self__", None)
    weights = [t for t in getattr(owner, "__dict__", {}).values()
               if isinstance(t, torch.Tensor) and t.is_contiguous()]
    fn(x)
    times = []
    for _ in range(runs):
        if weights:
            evict_from_caches(weights)
        else:
            flush_cpu_caches()
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
