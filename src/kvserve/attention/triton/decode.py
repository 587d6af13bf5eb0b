"""Paged decode attention (one query token per sequence) in Triton, split over the context.

FlashDecoding: each (sequence, KV head) pair's context is cut into `num_splits` pieces that
run as separate programs, so a small batch with long contexts still fills the GPU. Each piece
stores its partial softmax sums, and the last of a pair's programs to finish merges them
(`triton_splits`): no merge launch. Keys and values are read in place through
the block table (no gather copy), and one program serves every query head of a GQA group,
so each KV tile is loaded once for the whole group. Split boundaries are derived on the device
from each sequence's length, so a launch's grid depends only on the batch size: the kernels
are safe to capture in a CUDA graph. A sequence of length 0 (a graph's padding row) yields 0.
A graph of a step with chunks reads its number of decodes on the device too, and the number
of splits follows from it there.

Optionally (`unified_max`), FlashDecoding++'s asynchronized softmax: every score is
exponentiated against one fixed value instead of a running maximum, so no tile rescales what
came before it. A split whose largest score lands more than `UNIFIED_RANGE` away from that
value, where exp would overflow or lose every digit, is recomputed exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.triton.tiles import (
    MASKED,
    NO_WINDOW,
    attend_tile,
    load_kv_tile,
    scores,
)
from kvserve.triton_precision import dot_precision
from kvserve.triton_splits import arrives_last, check_split_groups, rearm, split_counters


@triton.jit
def _decode_split_kernel(
    q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr, decode_count_ptr, part_ptr, lse_ptr,
    out_ptr, counters_ptr, scale, window, split_target,
    stride_qb, stride_qh, stride_kv, stride_kh, stride_kblk, stride_bt, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr, MERGE_HEADS: tl.constexpr, PRECISION: tl.constexpr,
    UNIFIED: tl.constexpr, UNIFIED_RANGE: tl.constexpr, COUNTED: tl.constexpr,
    SOFTCAP: tl.constexpr, unified_max,
):
    """Program (i, kv_head, split). COUNTED: the first decode_count[0] sequences are the
    decodes, each split on the device into as many pieces (up to NUM_SPLITS) as give about
    `split_target` programs in all, and program i takes piece i % splits of decode
    i // splits; otherwise program i takes piece `split` of NUM_SPLITS of sequence i."""
    if COUNTED:
        num_decodes = tl.load(decode_count_ptr).to(tl.int32)
        # num_splits_for's rule (the eager step's), less its cap by context length: a
        # piece past a short context is empty, and the merge weighs it 0.
        wanted = tl.cdiv(split_target, tl.maximum(num_decodes, 1) * tl.num_programs(1))
        num_splits = tl.minimum(tl.maximum(wanted, 1), NUM_SPLITS)
        seq, split = tl.program_id(0) // num_splits, tl.program_id(0) % num_splits
        is_decode = seq < num_decodes
    else:
        seq, split, num_splits = tl.program_id(0), tl.program_id(2), NUM_SPLITS
        is_decode = True
    if is_decode:
        _attend_split(
            q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr, part_ptr, lse_ptr, out_ptr,
            counters_ptr, scale, window, unified_max, seq, tl.program_id(1), split,
            num_splits, stride_qb, stride_qh, stride_kv, stride_kh, stride_kblk, stride_bt,
            stride_ob, stride_oh, GROUP, BLOCK_G, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
            SPLITS_POW2, MERGE_HEADS, PRECISION, UNIFIED, UNIFIED_RANGE, SOFTCAP)


@triton.jit
def _attend_split(
    q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr, part_ptr, lse_ptr, out_ptr, counters_ptr,
    scale, window, unified_max, seq, kv_head, split, num_splits,
    stride_qb, stride_qh, stride_kv, stride_kh, stride_kblk, stride_bt, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_POW2: tl.constexpr,
    MERGE_HEADS: tl.constexpr, PRECISION: tl.constexpr, UNIFIED: tl.constexpr,
    UNIFIED_RANGE: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Piece `split` of `num_splits` of sequence `seq`'s context, for the heads of `kv_head`:
    written to the output directly when it is the only piece, else stored as a part that
    the last piece to finish merges."""
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    first = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=g[:, None] < GROUP, other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    k_base = kv_ptr + kv_head.to(tl.int64) * stride_kh
    table = block_tables_ptr + seq * stride_bt
    exact = True
    if UNIFIED:
        top = tl.full([BLOCK_G], MASKED, tl.float32)
        for tile in range(start, end, BLOCK_N):
            t = tile + tl.arange(0, BLOCK_N)
            valid = t < end
            k, v = load_kv_tile(k_base, stride_kv, stride_kblk, table, t, valid, BLOCK_SIZE,
                                HEAD_DIM)
            s = tl.where(valid[None, :], scores(q, k, scale, PRECISION, SOFTCAP), MASKED)
            top = tl.maximum(top, tl.max(s, 1))
            p = tl.exp(s - unified_max)
            l_sum += tl.sum(p, 1)
            acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = tl.zeros([BLOCK_G], tl.float32) + unified_max
        distance = tl.where(g < GROUP, tl.abs(top - unified_max), 0.0)
        exact = (end > start) & (tl.max(distance, 0) > UNIFIED_RANGE)
    if exact:
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for tile in range(start, end, BLOCK_N):
            t = tile + tl.arange(0, BLOCK_N)
            valid = t < end
            k, v = load_kv_tile(k_base, stride_kv, stride_kblk, table, t, valid, BLOCK_SIZE,
                                HEAD_DIM)
            m, l_sum, acc = attend_tile(q, k, v, valid[None, :], m, l_sum, acc, scale,
                                        PRECISION, SOFTCAP)

    keep = g < GROUP
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # an empty context gives 0
    out_rows = out_ptr + seq * stride_ob + head[:, None] * stride_oh + d[None, :]
    if num_splits == 1:
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=keep[:, None])
    else:
        # Each (head, split) leaves its softmax-weighted output and log-sum-exp; an empty
        # split leaves 0 and -inf, which the merge weighs 0.
        rows = (seq * num_heads + head) * num_splits
        tl.store(part_ptr + (rows + split)[:, None] * HEAD_DIM + d[None, :], out,
                 mask=keep[:, None])
        lse = tl.where(l_sum > 0, m + tl.log(tl.where(l_sum > 0, l_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + rows + split, lse, mask=keep)
        counter = counters_ptr + seq * tl.num_programs(1) + kv_head
        if arrives_last(counter, num_splits):
            for head0 in tl.static_range(0, GROUP, MERGE_HEADS):
                merged = head0 + tl.arange(0, MERGE_HEADS)
                merged_ok = merged < GROUP
                merged_head = kv_head * GROUP + merged
                merged_out = _merge_splits(part_ptr, lse_ptr, (seq * num_heads + merged_head)
                                           * num_splits, merged_ok, d, num_splits,
                                           SPLITS_POW2, HEAD_DIM)
                tl.store(out_ptr + seq * stride_ob + merged_head[:, None] * stride_oh
                         + d[None, :], merged_out.to(out_ptr.dtype.element_ty),
                         mask=merged_ok[:, None])
            rearm(counter)


@triton.jit
def _merge_splits(part_ptr, lse_ptr, rows, row_ok, d, num_splits,
                  SPLITS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The outputs [len(rows), HEAD_DIM] of heads whose splits' parts start at `rows`, each
    split weighted by its share of the softmax sum. Every split of every head is read in one
    load: one head after another, each head's read would wait for the store before it."""
    s = tl.arange(0, SPLITS_POW2)
    ok = row_ok[:, None] & (s < num_splits)[None, :]
    parts = rows[:, None] + s[None, :]
    lse = tl.load(lse_ptr + parts, mask=ok, other=float("-inf"), cache_modifier=".cg")
    part = tl.load(part_ptr + parts[:, :, None] * HEAD_DIM + d[None, None, :],
                   mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
    top = tl.max(lse, 1)
    weight = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top)[:, None])  # all empty: 0
    total = tl.sum(weight, 1)
    return tl.sum(part * weight[:, :, None], 1) / tl.where(total > 0, total, 1.0)[:, None]


MAX_SPLITS = 16
BLOCK_N = 64


def unified_range(dtype: torch.dtype) -> float:
    """How far the largest score may lie from the unified maximum: its exp (up to e^range
    per term, summed over a context) must stay finite in float32, and the probabilities, cast
    to the KV dtype for the second product, must stay normal numbers: float16 tops out at
    65504 (e^11), bfloat16 has float32's range."""
    return 8.0 if dtype == torch.float16 else 60.0


def merge_heads(group: int, num_splits: int, head_dim: int) -> int:
    """Heads of a group merged in one load: all of them, as long as their parts come to at
    most 8,192 floats (64 registers a thread in 4 warps)."""
    fitting = max(1, 8192 // (triton.next_power_of_2(num_splits) * head_dim))
    return min(triton.next_power_of_2(group), fitting)


def num_splits_for(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                   num_programs: int) -> int:
    """Enough splits to give `num_programs` programs work, none shorter than a tile."""
    wanted = -(-num_programs // max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, MAX_SPLITS, -(-max_seq_len // BLOCK_N)))


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, window: int | None,
                           num_splits: int, out: torch.Tensor | None = None,
                           unified_max: float | None = None, num_warps: int = 4,
                           decode_count: torch.Tensor | None = None,
                           split_target: int = 0, softcap: float | None = None
                           ) -> torch.Tensor:
    """q: [B, Hq, D] (head-contiguous rows); kv_cache: [2, Hkv, num_blocks, block_size, D];
    block_tables: [B, >= blocks of the longest sequence]; seq_lens: [B]. Returns [B, Hq, D].
    `unified_max` switches to the asynchronized softmax around that fixed value.
    `decode_count`, a [1] device tensor (a padded mixed step's, whose count the host does
    not give its graph): only the first decode_count[0] of the B rows are decodes, and only
    their rows of `out` are written; each is split into up to `num_splits` pieces, as many
    as give about `split_target` programs. `softcap`: scores s become
    softcap * tanh(s / softcap). Compiled for an H100, neither 4 nor 8 warps
    spill up to head_dim 256 (`scripts/attention_sm90.py`); `bench kernels` times both."""
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    assert q.stride(2) == 1 and kv_cache.is_contiguous() and block_tables.stride(1) == 1
    if decode_count is None:
        grid = (batch, num_kv_heads, num_splits)
        split_groups = batch * num_kv_heads
    else:
        # num_decodes x their splits <= num_decodes + split_target / num_kv_heads; a split
        # decode's group index stays below split_target.
        grid = (batch + -(-split_target // num_kv_heads), num_kv_heads, 1)
        split_groups = split_target
    if num_splits > 1:
        check_split_groups(split_groups)
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    assert out.stride(2) == 1
    part = lse = out  # one split writes the output directly
    if num_splits > 1:
        parts = grid[0] * num_heads * grid[2]
        part = torch.empty(parts, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(parts, dtype=torch.float32, device=q.device)
    _decode_split_kernel[grid](
        q, kv_cache, block_tables, seq_lens, decode_count if decode_count is not None
        else seq_lens, part, lse, out, split_counters(q.device), scale, window or NO_WINDOW,
        split_target,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=max(BLOCK_N, block_size), NUM_SPLITS=num_splits,
        SPLITS_POW2=triton.next_power_of_2(num_splits),
        MERGE_HEADS=merge_heads(group, num_splits, head_dim),
        PRECISION=dot_precision(q.dtype),
        UNIFIED=unified_max is not None, UNIFIED_RANGE=unified_range(q.dtype),
        COUNTED=decode_count is not None, SOFTCAP=softcap or 0.0,
        unified_max=unified_max or 0.0,
        num_warps=num_warps)
    return out
