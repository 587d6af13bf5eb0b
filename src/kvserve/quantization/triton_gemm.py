"""Weight-only quantized GEMM in Triton for CUDA: the MARLIN idea of streaming packed integer
weights and dequantizing them in registers, next to the multiply.

Two kernels share the unpacking, the group's scale and zero and the split-K epilogue:
- a few rows (decode), a GEMV on the CUDA cores in float32: the weights are used in the
  registers they are unpacked in. One row always takes it; up to GEMV_MAX_ROWS rows,
  whichever kernel a layer's first call with as many rows times faster;
- any number of rows, tiles on the tensor cores, whose weight operand is staged in shared
  memory.

Both serve two weight kinds, which differ only in how a tile is dequantized:
- integers with a scale and zero per group of input channels (GPTQ, AWQ; W4A16, W8A16):
  w = (q - zero[group]) * scale[group]: on the tensor cores each weight is dequantized
  (`_dequantized`); in the GEMV the zero is subtracted as the integer becomes a float
  (`_integers_less`) and the scale multiplies a tile's sums;
- indices into a per-output-channel lookup table (SqueezeLLM): w = table[row, q], plus the
  sparse outliers, added by a sparse matmul.

Weights are repacked at load into the kernel's layout: int32 words along the input dimension
holding 8 values of 4 bits (2- and 3-bit values widened to 4) or 4 of 8 bits. Act-order
layers have their input channels sorted by group, and the kernel reads each input in that
order (no gather launch of its own), so a tile of the input dimension always falls in one
group. For few rows (decode), the input
dimension is split over several programs (split-K): each stores its float32 partial sum, and
the last of a tile's programs to finish adds them and writes the output (`triton_splits`).

On CUDA the tile shape, warps and pipeline depth are timed once per layer shape and bucket of
rows (`triton.autotune`, at the first call: before CUDA graphs are captured); the
interpreter runs the first tile that fits.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.quantization.gptq import QuantizedWeight, sorted_by_group
from kvserve.quantization.packing import pack_rows
from kvserve.quantization.squeezellm import LutWeight
from kvserve.quantization.torch_int4 import Int4Weight, int4_weight, int4_weight_fits
from kvserve.triton_precision import dot_precision
from kvserve.triton_splits import (
    check_split_groups,
    split_counters,
    splits_for_tiles,
    store_split_tile,
)
from kvserve.triton_timing import fastest

MIN_BLOCK_K = 32  # a group must hold whole tiles of the input dimension


@triton.jit
def _word_tile(words_ptr, k0, cols, col_ok, N, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The packed words of input channels k0 ... k0 + BLOCK_K - 1 as [BLOCK_K / PER_WORD,
    BN]: word row w holds channels w * PER_WORD ... w * PER_WORD + PER_WORD - 1. (The input
    dimension is a whole number of tiles: a tile lies in one group.)"""
    PER_WORD: tl.constexpr = 32 // BITS
    word_rows = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
    return tl.load(words_ptr + word_rows[:, None] * N + cols[None, :], mask=col_ok[None, :],
                   other=0)


@triton.jit
def _unpacked_tile(words_ptr, k0, cols, col_ok, N, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The integers of a word tile as [BLOCK_K / PER_WORD, PER_WORD, BN], each word loaded
    once and unpacked in registers."""
    words = _word_tile(words_ptr, k0, cols, col_ok, N, BITS, BLOCK_K)
    shifts = tl.arange(0, 32 // BITS) * BITS
    return (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)


@triton.jit
def _integers_less(src, position, offset, BITS: tl.constexpr):
    """Value `position` (a tensor that broadcasts against `src`) of the low 16 bits of each
    word in `src`, less `offset` (a zero point), in float32. Masked in place, the value
    becomes the low mantissa bits of a float whose exponent gives its lowest bit a weight of
    one, 2^(23 - BITS * position) + value, from which that power of two and the offset are
    subtracted: one logic op (a LOP3: the mask and the exponent together) and one add per
    value, where shifting it down, masking it, converting it and subtracting the zero take
    four or more. Exact for integer offsets."""
    exponent = (127 + 23 - BITS * position) << 23  # the bits of 2^(23 - BITS * position)
    field = src & (((1 << BITS) - 1) << (BITS * position))
    return ((field | exponent).to(tl.float32, bitcast=True)
            - (exponent.to(tl.float32, bitcast=True) + offset))


@triton.jit
def _input_channels(ks, input_order_ptr, ORDERED: tl.constexpr):
    """The input's channels for the weight's input channels ks: the same, or, for act-order
    layers (whose channels are sorted by group), read through their order."""
    if ORDERED:
        return tl.load(input_order_ptr + ks)
    return ks


@triton.jit
def _table_values(q, cols, col_ok, table_ptr, BITS: tl.constexpr):
    """The float32 weights of lookup-table indices `q` ([..., BN], columns `cols`)."""
    return tl.load(table_ptr + cols * (1 << BITS) + q, mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _group_scale_zero(k0, cols, col_ok, scales_ptr, zeros_ptr, N, GROUP_SIZE: tl.constexpr):
    """The float32 scale and zero of columns `cols` in the group of input offset k0."""
    group = k0 // GROUP_SIZE  # the whole tile lies in one group
    scale = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
    zero = tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
    return scale, zero


@triton.jit
def _dequantized(q, k0, cols, col_ok, scales_ptr, zeros_ptr, N, GROUP_SIZE: tl.constexpr,
                 BITS: tl.constexpr):
    """The float32 weights of integers `q` ([BLOCK_K, BN]) at input offset k0: written into
    a float's mantissa, 1 + q / 2^BITS (exact, no int-to-float conversion), then one fused
    multiply-add applies the group's scale and zero."""
    scale, zero = _group_scale_zero(k0, cols, col_ok, scales_ptr, zeros_ptr, N, GROUP_SIZE)
    unit = ((q << (23 - BITS)) | 0x3F800000).to(tl.float32, bitcast=True)
    return unit * (scale * (1 << BITS)) - (zero + (1 << BITS)) * scale


@triton.jit
def _weight_only_gemm_kernel(x_ptr, input_order_ptr, words_ptr, scales_ptr, zeros_ptr,
                             table_ptr, out_ptr, partials_ptr, counters_ptr,
                             M, N, K, GROUP_SIZE: tl.constexpr,
                             BITS: tl.constexpr, LUT: tl.constexpr, ORDERED: tl.constexpr,
                             PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """Rows of x on the tensor cores: each weight tile is dequantized once per BLOCK_M rows
    (`_dequantized`). Feeding the integers to the multiply as they are and scaling each
    tile's sums instead, as the GEMV does, ran 25-40% slower on an H100 at 16 and 32 rows."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_splits = tl.num_programs(2)
    k_per_split = tl.cdiv(tl.cdiv(K, num_splits), BLOCK_K) * BLOCK_K
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        x_cols = _input_channels(k0 + tl.arange(0, BLOCK_K), input_order_ptr, ORDERED)
        x = tl.load(x_ptr + rows[:, None] * K + x_cols[None, :], mask=row_ok[:, None],
                    other=0.0)
        q = tl.reshape(_unpacked_tile(words_ptr, k0, cols, col_ok, N, BITS, BLOCK_K),
                       [BLOCK_K, BLOCK_N])
        if LUT:
            w = _table_values(q, cols[None, :], col_ok[None, :], table_ptr, BITS)
        else:
            w = _dequantized(q, k0, cols[None, :], col_ok[None, :], scales_ptr, zeros_ptr, N,
                             GROUP_SIZE, BITS)
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    store_split_tile(acc, rows, cols, M, N, out_ptr, partials_ptr,
                     counters_ptr + pid_m * tl.num_programs(1) + pid_n, split, num_splits)


@triton.jit
def _weight_only_gemv_kernel(x_ptr, input_order_ptr, words_ptr, scales_ptr, zeros_ptr,
                             table_ptr, out_ptr, partials_ptr, counters_ptr,
                             M, N, K, GROUP_SIZE: tl.constexpr,
                             BITS: tl.constexpr, LUT: tl.constexpr, ORDERED: tl.constexpr,
                             PAIRS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             STAGES: tl.constexpr):
    """A few rows of x (decode) on the CUDA cores, in float32: the weights are used in the
    registers they are unpacked in, where a tensor-core operand would first go through
    shared memory, one 16-bit store per weight.

    Every tensor has the word tile's shape [BLOCK_K / PER_WORD, BN] (times the rows): value
    j of each word is taken out with constant masks, one position at a time, so nothing is
    reshaped or reduced in the loop. The zero point is subtracted as the value becomes a
    float (`_integers_less`), and the scale multiplies a tile's sums: per weight a logic op
    and an add, then a multiply-add per row. Each thread loads the x of its own words: with
    `PAIRS` (bfloat16 x) two channels in one 32-bit load, each widened by a shift or a mask.
    The loop is software-pipelined (`tl.range` stages: without a dot, Triton pipelines a
    loop's loads only when asked), so the next tiles' words are in flight while one is
    summed."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    num_splits = tl.num_programs(1)
    k_per_split = tl.cdiv(tl.cdiv(K, num_splits), BLOCK_K) * BLOCK_K
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER_WORD
    HALF: tl.constexpr = 16 // BITS
    pairs_ptr = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    acc = tl.zeros([BLOCK_M, WORDS, BLOCK_N], tl.float32)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        words = _word_tile(words_ptr, k0, cols, col_ok, N, BITS, BLOCK_K)
        high = words >> 16
        if not LUT:
            scale, zero = _group_scale_zero(k0, cols, col_ok, scales_ptr, zeros_ptr, N,
                                            GROUP_SIZE)
        tile = tl.zeros([BLOCK_M, WORDS, BLOCK_N], tl.float32)
        for pair_index in tl.static_range(PER_WORD // 2):
            if PAIRS:
                pair_cols = (k0 + tl.arange(0, WORDS) * PER_WORD) // 2 + pair_index
                pair = tl.load(pairs_ptr + rows[:, None] * (K // 2) + pair_cols[None, :],
                               mask=row_ok[:, None], other=0)
            for odd in tl.static_range(2):
                if PAIRS:  # a bfloat16's bits are a float32's high half
                    if odd:
                        x = (pair & 0xFFFF0000).to(tl.float32, bitcast=True)
                    else:
                        x = (pair << 16).to(tl.float32, bitcast=True)
                else:
                    ks = k0 + tl.arange(0, WORDS) * PER_WORD + 2 * pair_index + odd
                    x_cols = _input_channels(ks, input_order_ptr, ORDERED)
                    x = tl.load(x_ptr + rows[:, None] * K + x_cols[None, :],
                                mask=row_ok[:, None], other=0.0).to(tl.float32)
                if LUT:
                    q = (words >> (BITS * (2 * pair_index + odd))) & ((1 << BITS) - 1)
                    w = _table_values(q, cols[None, :], col_ok[None, :], table_ptr, BITS)
                else:
                    position = tl.full([1, 1], (2 * pair_index + odd) % HALF, tl.int32)
                    if 2 * pair_index + odd < HALF:
                        w = _integers_less(words, position, zero[None, :], BITS)
                    else:
                        w = _integers_less(high, position, zero[None, :], BITS)
                tile += x[:, :, None] * w[None, :, :]
        if LUT:
            acc += tile
        else:
            acc += scale[None, None, :] * tile
    store_split_tile(tl.sum(acc, axis=1), rows, cols, M, N, out_ptr, partials_ptr,
                     counters_ptr + pid_n, split, num_splits)


def _configs(block_ns: tuple[int, ...], shapes: tuple[tuple[int, int], ...]
             ) -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps,
                          num_stages=stages)
            for block_n in block_ns for block_k in (MIN_BLOCK_K, 64, 128)
            for warps, stages in shapes]


TILE_CONFIGS = _configs((64, 128), ((4, 3), (8, 4)))
# The GEMV's loop has no dot: Triton pipelines it only at the stages the loop is given.
GEMV_CONFIGS = [triton.Config({**c.kwargs, "STAGES": c.num_stages}, num_warps=c.num_warps)
                for c in _configs((64, 128, 256, 512), ((4, 3), (8, 3)))]


def _fitting_tiles(configs: list[triton.Config], named_args: dict, **kwargs: object
                   ) -> list[triton.Config]:
    """Tiles of the two largest input widths that lie in one group of input channels (and,
    for the GEMV, whose accumulator over its rows stays within 32 floats a thread); under
    the interpreter, which has nothing to time, only the first of the largest."""
    def fits(c: triton.Config) -> bool:
        if named_args["GROUP_SIZE"] % c.kwargs["BLOCK_K"]:
            return False
        if "STAGES" not in c.kwargs:  # the tensor-core tile: its accumulator is [BM, BN]
            return True
        words = c.kwargs["BLOCK_K"] * kwargs["BITS"] // 32
        return kwargs["BLOCK_M"] * words * c.kwargs["BLOCK_N"] <= 32 * 32 * c.num_warps

    widths = sorted({c.kwargs["BLOCK_K"] for c in configs if fits(c)})[-2:]
    fitting = sorted((c for c in configs if fits(c) and c.kwargs["BLOCK_K"] in widths),
                     key=lambda c: -c.kwargs["BLOCK_K"])
    return fitting if named_args["x_ptr"].is_cuda else fitting[:1]


def _tuned(kernel: triton.JITFunction, configs: list[triton.Config]
           ) -> triton.runtime.Autotuner:
    return triton.autotune(
        configs, key=["N", "K", "GROUP_SIZE", "BITS", "LUT", "ORDERED", "BLOCK_M"],
        prune_configs_by={"early_config_prune": _fitting_tiles},
        do_bench=lambda call, quantiles: triton.testing.do_bench(call, warmup=5, rep=25,
                                                                 quantiles=quantiles),
    )(kernel)


_tuned_gemm = _tuned(_weight_only_gemm_kernel, TILE_CONFIGS)
_tuned_gemv = _tuned(_weight_only_gemv_kernel, GEMV_CONFIGS)
GEMV_MAX_ROWS = 8  # each row costs the GEMV a multiply-add per weight: beyond, tensor cores
TORCH_INT4_MAX_ROWS = 64  # tinygemm reads the weights again for every 16 rows
GEMV, TENSOR_CORES, TORCH_INT4 = "GEMV", "tensor cores", "torch int4"


def chosen_tile(gemv: bool) -> str:
    """The tile the autotuner picked at the last call of the GEMV or the tensor-core kernel,
    as `kvserve bench quantized` reports it."""
    tile = getattr(_tuned_gemv if gemv else _tuned_gemm, "best_config", None)
    if tile is None:
        return ""
    return (f"N{tile.kwargs['BLOCK_N']} K{tile.kwargs['BLOCK_K']} "
            f"w{tile.num_warps} s{tile.kwargs.get('STAGES', tile.num_stages)}")


@dataclass(frozen=True)
class TritonQuantizedWeight:
    words: torch.Tensor  # [in * BITS / 32, out] int32, input channels in group order
    bits: int  # 4 or 8: the kernel's width per value
    group_size: int  # input channels per scale (the whole input: one group)
    scales: torch.Tensor | None  # [groups, out] in the activations' dtype
    zeros: torch.Tensor | None  # [groups, out], the same dtype
    table: torch.Tensor | None  # [out, 2^bits] lookup table, the activations' dtype
    outliers: torch.Tensor | None  # [out, in] sparse CSR float32
    input_order: torch.Tensor | None  # act-order: the input channels sorted by group
    num_programs: int  # split-K aims to start this many programs
    # The same integers in PyTorch's int4 layout, kept where its tensor-core GEMM (tinygemm)
    # times faster than the Triton kernels for few rows (`_with_torch_int4`).
    torch_int4: Int4Weight | None = None
    # The kernel of every call (GEMV, TENSOR_CORES or TORCH_INT4); None: of the kernels that
    # take as many rows, the one the first call with that many rows times fastest.
    kernel: str | None = None

    @property
    def num_bytes(self) -> int:
        """The bytes one call reads (of either copy: both are as large)."""
        parts = [self.words, self.scales, self.zeros, self.table]
        total = sum(t.numel() * t.element_size() for t in parts if t is not None)
        if self.outliers is not None:
            total += sum(t.numel() * t.element_size() for t in (
                self.outliers.crow_indices(), self.outliers.col_indices(),
                self.outliers.values()))
        return total

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        kernel = self.kernel or self.fastest_kernel(rows)
        if kernel not in self.kernels(len(rows)):
            raise ValueError(f"the {kernel} kernel does not take {len(rows)} rows here (the "
                             f"GEMV takes at most {GEMV_MAX_ROWS}, torch int4 at most "
                             f"{TORCH_INT4_MAX_ROWS} where the layer has its copy)")
        result = self._run(rows, kernel)
        if self.outliers is not None:
            result = result + torch.sparse.mm(self.outliers, rows.t().float()).t().to(x.dtype)
        return result.reshape(*x.shape[:-1], result.shape[1])

    def kernels(self, m: int) -> list[str]:
        """The kernels that take m rows: the GEMV up to GEMV_MAX_ROWS, the tensor cores,
        PyTorch's int4 up to TORCH_INT4_MAX_ROWS where the layer has its copy."""
        return [kernel for kernel, takes in (
            (GEMV, m <= GEMV_MAX_ROWS), (TENSOR_CORES, True),
            (TORCH_INT4, self.torch_int4 is not None and m <= TORCH_INT4_MAX_ROWS)) if takes]

    def fastest_kernel(self, rows: torch.Tensor) -> str:
        """Of the kernels that take as many rows (one row: not the tensor cores, 16 times
        its work), under the interpreter the first; on CUDA the one the first call with as
        many rows (rounded up to a power of two) times fastest. A call inside a CUDA graph
        capture, which cannot time, takes the tensor cores, or for one row the GEMV."""
        kernels = [k for k in self.kernels(len(rows)) if len(rows) > 1 or k != TENSOR_CORES]
        if not rows.is_cuda or len(kernels) == 1:
            return kernels[0]
        key = ("w4a16", self.words.shape, self.bits, self.group_size, self.table is not None,
               self.input_order is not None, self.torch_int4 is not None,
               triton.next_power_of_2(len(rows)), rows.dtype, rows.device)
        untimed = kernels.index(TENSOR_CORES) if TENSOR_CORES in kernels else 0
        return kernels[fastest(key, [lambda k=k: self._run(rows, k) for k in kernels],
                               untimed)]

    def _run(self, rows: torch.Tensor, kernel: str) -> torch.Tensor:
        if kernel == TORCH_INT4:
            return self.torch_int4.matmul(rows)
        return self._launch(rows, kernel == GEMV)

    def _launch(self, rows: torch.Tensor, gemv: bool) -> torch.Tensor:
        m, k = rows.shape
        n = self.words.shape[1]
        block_m = (triton.next_power_of_2(m) if gemv
                   else 16 if m <= 16 else 32 if m <= 32 else 64)
        tuned = _tuned_gemv if gemv else _tuned_gemm

        def splits(block_n: int, block_k: int) -> int:
            tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
            return splits_for_tiles(tiles, k, block_k, self.num_programs)

        def grid(tile: dict) -> tuple[int, ...]:
            tiles = (triton.cdiv(n, tile["BLOCK_N"]), splits(tile["BLOCK_N"], tile["BLOCK_K"]))
            return tiles if gemv else (triton.cdiv(m, block_m), *tiles)

        most_splits = max(splits(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"])
                          for c in tuned.configs)  # room for any tile
        result = torch.empty(m, n, device=rows.device, dtype=rows.dtype)
        partials = result if most_splits == 1 else torch.empty(
            most_splits, m, n, device=rows.device, dtype=torch.float32)
        lut = self.table is not None
        ordered = self.input_order is not None
        pointers = (rows, self.input_order if ordered else self.words, self.words,
                    self.scales if not lut else self.table, self.zeros if not lut else self.table,
                    self.table if lut else self.words, result, partials,
                    split_counters(rows.device))
        kind = {"BITS": self.bits, "LUT": lut, "ORDERED": ordered, "BLOCK_M": block_m}
        if gemv:
            # bfloat16 inputs at a 4-byte boundary load two channels at once.
            pairs = (rows.dtype == torch.bfloat16 and not ordered
                     and rows.data_ptr() % 4 == 0)
            tuned[grid](*pointers, m, n, k, self.group_size, **kind, PAIRS=pairs)
        else:
            tuned[grid](*pointers, m, n, k, self.group_size, **kind,
                        PRECISION=dot_precision(rows.dtype))
        return result


def pack_for_triton(shards: list[QuantizedWeight] | list[LutWeight], dtype: torch.dtype,
                    device: torch.device, num_programs: int, torch_int4: bool = False
                    ) -> TritonQuantizedWeight | None:
    """The shards (a fused layer's, in output order) in the kernel's layout on `device`, or
    None where it cannot run them: groups not a multiple of 32 input channels, shards
    ordering their inputs differently, or tables of more than 256 entries. `torch_int4`: also
    in PyTorch's int4 layout, where that runs them and times faster (`_with_torch_int4`)."""
    # Split-K runs only where tiles are fewer than num_programs: each tile takes a counter.
    check_split_groups(num_programs)
    if isinstance(shards[0], LutWeight):
        parts = _lut_parts(shards, dtype)
        return None if parts is None else _on_device(parts, device, num_programs)
    grouped = sorted_by_group(shards)
    if grouped is None or grouped[2] % MIN_BLOCK_K:
        return None
    intweight, order, group_size = grouped
    scales = torch.cat([s.scales for s in shards], dim=1)
    zeros = torch.cat([s.zeros for s in shards], dim=1)
    bits = 4 if int(intweight.max()) <= 15 else 8
    weight = _on_device({
        "words": pack_rows(intweight.t(), bits), "bits": bits, "group_size": group_size,
        "scales": scales.to(dtype).contiguous(), "zeros": zeros.to(dtype).contiguous(),
        "table": None, "outliers": None,
        "input_order": None if order is None else order.to(torch.int32)}, device, num_programs)
    if (torch_int4 and bits == 4 and dtype == torch.bfloat16
            and int4_weight_fits(intweight.shape, group_size, device)):
        return _with_torch_int4(weight, lambda: int4_weight(intweight, scales, zeros,
                                                            group_size, order, device))
    return weight


def _on_device(parts: dict, device: torch.device, num_programs: int) -> TritonQuantizedWeight:
    return TritonQuantizedWeight(**{
        name: value.to(device) if isinstance(value, torch.Tensor) else value
        for name, value in parts.items()}, num_programs=num_programs)


TORCH_INT4_TIMED_ROWS = (1, 16)  # a decode of one sequence, and a full tile of tinygemm's
# By layer layout and device: whether its copy in PyTorch's int4 layout pays.
_torch_int4_pays: dict[tuple[object, ...], bool] = {}


def _with_torch_int4(weight: TritonQuantizedWeight, pack: Callable[[], Int4Weight]
                     ) -> TritonQuantizedWeight:
    """`weight` with its copy in PyTorch's int4 layout (which `pack` builds) where that copy
    times faster than the Triton kernels on one row or on 16, timed on the first layer of
    its layout: the copy takes as much memory again as the packed layer, so a layer keeps
    it only where it pays, and the other layers of a layout pack it only then."""
    device = weight.words.device
    key = (weight.words.shape, weight.bits, weight.group_size, weight.input_order is not None,
           device)
    copy = None
    if key not in _torch_int4_pays:
        copy = pack()
        candidate = dataclasses.replace(weight, torch_int4=copy)
        in_features = weight.words.shape[0] * 32 // weight.bits
        _torch_int4_pays[key] = any(
            candidate.fastest_kernel(torch.randn(m, in_features, dtype=torch.bfloat16,
                                                 device=device)) == TORCH_INT4
            for m in TORCH_INT4_TIMED_ROWS)
    if not _torch_int4_pays[key]:
        return weight
    return dataclasses.replace(weight, torch_int4=copy or pack())


def _lut_parts(shards: list[LutWeight], dtype: torch.dtype) -> dict | None:
    levels = shards[0].lookup_table.shape[1]
    if levels > 256 or any(s.lookup_table.shape[1] != levels for s in shards):
        return None
    bits = 4 if levels <= 16 else 8
    indices = torch.cat([s.indices for s in shards])
    table = torch.cat([s.lookup_table for s in shards]).to(dtype)
    outliers = None
    if any(len(s.sparse_values) for s in shards):
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            outliers = torch.cat([s.sparse_matrix() for s in shards]).to_sparse_csr()
    return {"words": pack_rows(indices.t(), bits), "bits": bits,
            "group_size": indices.shape[1], "scales": None, "zeros": None,
            "table": torch.nn.functional.pad(table, (0, 2**bits - levels)).contiguous(),
            "outliers": outliers, "input_order": None}
