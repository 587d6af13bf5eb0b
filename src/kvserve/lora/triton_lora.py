"""The batched LoRA matmul on CUDA, segmented by adapter (Punica's SGMV): rows are grouped by
their adapter's slot on the device (no sync), and each program multiplies a tile of one
adapter's rows by that adapter's A (shrink), then by its B (expand), adding into the layer's
output. Where the mask form (batch.py) multiplies every row by every loaded adapter, this
reads each adapter's weights once per tile of its own rows and does none of the other
adapters' work. Base-model rows (slot -1) are skipped. Nothing reads a device value back,
so a CUDA graph captures it: the grid depends only on the rows and the slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.lora.batch import LoRABatch
from kvserve.triton_precision import dot_precision
from kvserve.triton_splits import (
    check_split_groups,
    split_counters,
    splits_for_tiles,
    store_split_tile,
)


@triton.jit
def _segment_rows(order_ptr, starts_ptr, slot, tile, BLOCK_M: tl.constexpr):
    """The rows of a tile of `slot`'s segment, and which of its lanes hold one."""
    start = tl.load(starts_ptr + slot)
    end = tl.load(starts_ptr + slot + 1)
    m = start + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    is_row = m < end
    return tl.load(order_ptr + m, mask=is_row, other=0), is_row, start + tile * BLOCK_M < end


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, t_ptr, order_ptr, starts_ptr, partials_ptr, counters_ptr,
                   num_rows, in_features, width, stride_x, stride_a,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                   PRECISION: tl.constexpr):
    """t = x A_s for a tile of slot s's rows, over split `split` of the input channels: a
    decode step's few rows per adapter give few tiles, and each would otherwise walk the
    whole input alone. The last split of a tile to finish writes the sum (`triton_splits`)."""
    slot, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_splits = tl.num_programs(2)
    rows, is_row, any_row = _segment_rows(order_ptr, starts_ptr, slot, tile, BLOCK_M)
    if any_row:
        k_per_split = tl.cdiv(tl.cdiv(in_features, num_splits), BLOCK_K) * BLOCK_K
        k_end = tl.minimum((split + 1) * k_per_split, in_features)
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k0 in range(split * k_per_split, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                        mask=is_row[:, None] & (k[None, :] < k_end), other=0.0)
            a = tl.load(a_ptr + k[:, None] * stride_a + slot * width + r[None, :],
                        mask=(k[:, None] < k_end) & (r[None, :] < width), other=0.0)
            acc += tl.dot(x, a, input_precision=PRECISION)
        # Rows outside the segment become row num_rows, which the store masks.
        store_split_tile(acc, tl.where(is_row, rows, num_rows), r, num_rows, width, t_ptr,
                         partials_ptr, counters_ptr + slot * tl.num_programs(1) + tile, split,
                         num_splits)


@triton.jit
def _expand_kernel(t_ptr, b_ptr, out_ptr, order_ptr, starts_ptr, out_features, width,
                   stride_t, stride_b, stride_out,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   PRECISION: tl.constexpr):
    slot, tile, n_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, is_row, any_row = _segment_rows(order_ptr, starts_ptr, slot, tile, BLOCK_M)
    if any_row:
        r = tl.arange(0, BLOCK_R)
        n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.load(t_ptr + rows[:, None] * stride_t + r[None, :],
                    mask=is_row[:, None] & (r[None, :] < width), other=0.0)
        b = tl.load(b_ptr + (slot * width + r[:, None]) * stride_b + n[None, :],
                    mask=(r[:, None] < width) & (n[None, :] < out_features), other=0.0)
        out_ptrs = out_ptr + rows[:, None] * stride_out + n[None, :]
        mask = is_row[:, None] & (n[None, :] < out_features)
        acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.dot(t, b, input_precision=PRECISION)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def add_lora(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             batch: LoRABatch, num_programs: int) -> None:
    """out += x A_s B_s for each row whose adapter is slot s >= 0. a: [in, slots x width],
    b: [slots x width, out] (scaled), as the layer packs them. The shrink's input is split
    until its launch has about `num_programs` programs."""
    num_rows, in_features = x.shape
    num_slots = batch.num_slots
    width = a.shape[1] // num_slots
    x = x.contiguous()
    order, starts = batch.segments()
    block_m, block_r, block_k = 16, max(16, triton.next_power_of_2(width)), 64
    shrunk = x.new_empty(num_rows, width)
    tiles = triton.cdiv(num_rows, block_m)
    groups = num_slots * tiles
    splits = splits_for_tiles(groups, in_features, block_k, num_programs)
    if splits > 1:
        check_split_groups(groups)
    partials = shrunk if splits == 1 else torch.empty(splits, num_rows, width,
                                                      dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_slots, tiles, splits)](
        x, a, shrunk, order, starts, partials, split_counters(x.device), num_rows,
        in_features, width, x.stride(0), a.stride(0), BLOCK_M=block_m, BLOCK_K=block_k,
        BLOCK_R=block_r, PRECISION=dot_precision(x.dtype))
    block_n = 64
    _expand_kernel[(num_slots, tiles, triton.cdiv(out.shape[1], block_n))](
        shrunk, b, out, order, starts, out.shape[1], width, shrunk.stride(0), b.stride(0),
        out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        PRECISION=dot_precision(x.dtype))
