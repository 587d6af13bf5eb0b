"""Attention for a step's multi-token chunks in one Triton launch (varlen, paged).

Each chunk's queries attend to its whole context in the paged pool (earlier chunks, cached
prefix blocks and the chunk itself, whose keys were written just before), causally and
within the sliding window. This serves chunked prefill and prefix-cache hits alike.

The work is a tile of `BLOCK_Q` consecutive queries of one sequence, times every query head
of one KV head (GQA), so each key tile is loaded once for the whole group. Sequence s owns
the tiles from `query_start[s] // BLOCK_Q + s` on, and a tile finds its sequence by a
binary search over those starts. A fixed number of programs (about two per SM) take the
(tile, KV head) pairs in turn, up to a count read on the device: the launch depends only on
the numbers of rows and of sequences, so a CUDA graph of a padded mixed step replays it
over any mix of chunks and decodes, and the sequences a graph pads with have no rows,
hence no tiles. Such a step's decodes, its leading sequences, are the split-K decode
kernel's: a decode's tile would fill GROUP of its 64 rows and read the whole context in one
program per KV head (at 256 decodes of 1,024 tokens beside a chunk, the step took twice as
long as eagerly on an H200). One program per tile would leave the empty ones to fill the
GPU in waves: at 8 warps and about 200 registers a thread, an H100 SM holds one program at
a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.triton.tiles import MASKED, NO_WINDOW, attend_tile, load_kv_tile
from kvserve.triton_precision import dot_precision

# Rows of a program's query tile: queries x the heads of a KV head.
TILE_ROWS = 64


@triton.jit
def _count_at_or_below(query_start_ptr, num_seqs, target, DIVISOR: tl.constexpr,
                       STEP: tl.constexpr):
    """How many of the first `num_seqs` sequences s have query_start[s] // DIVISOR + s * STEP
    at or below `target`: a binary search, the key rising with s."""
    low = tl.zeros([], tl.int32)
    high = low + num_seqs
    while low < high:
        mid = (low + high) // 2
        if tl.load(query_start_ptr + mid) // DIVISOR + mid * STEP <= target:
            low = mid + 1
        else:
            high = mid
    return low


@triton.jit(do_not_specialize=["num_seqs"])
def _varlen_kernel(
    q_ptr, kv_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr, positions_ptr,
    decode_count_ptr, out_ptr, scale, window, num_seqs,
    stride_qt, stride_qh, stride_kv, stride_kh, stride_kblk, stride_bt, stride_ot, stride_oh,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    SKIP_DECODES: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Each program takes every num_programs-th (tile, KV head) pair in turn."""
    # Every sequence but a padded step's trailing ones, which start at the last row's end.
    num_seqs = _count_at_or_below(query_start_ptr, num_seqs,
                                  tl.load(query_start_ptr + num_seqs) - 1, 1, 0)
    first_seq = tl.zeros([], tl.int32)
    if SKIP_DECODES:  # the leading decode_count[0] sequences, which the decode kernel serves
        first_seq = tl.load(decode_count_ptr).to(tl.int32)
    first_tile = tl.load(query_start_ptr + first_seq) // BLOCK_Q + first_seq
    num_tiles = tl.load(query_start_ptr + num_seqs) // BLOCK_Q + num_seqs - first_tile
    for work in range(tl.program_id(0), num_tiles * NUM_KV_HEADS, tl.num_programs(0)):
        tile = work // NUM_KV_HEADS + first_tile
        kv_head = work % NUM_KV_HEADS
        # The last sequence whose first tile is at or before this one.
        seq = _count_at_or_below(query_start_ptr, num_seqs, tile, BLOCK_Q, 1) - 1
        query_start = tl.load(query_start_ptr + seq)
        num_queries = tl.load(query_start_ptr + seq + 1) - query_start
        first_query = (tile - query_start // BLOCK_Q - seq) * BLOCK_Q
        if first_query < num_queries:  # a sequence's last tile may hold none of its queries
            _attend_query_tile(
                q_ptr, kv_ptr, block_tables_ptr + seq * stride_bt, positions_ptr, out_ptr,
                scale, window, query_start, num_queries, first_query,
                tl.load(seq_lens_ptr + seq), kv_head,
                stride_qt, stride_qh, stride_kv, stride_kh, stride_kblk, stride_ot, stride_oh,
                GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_Q, BLOCK_M, BLOCK_N, PRECISION,
                HAS_POSITIONS, SOFTCAP)


@triton.jit
def _attend_query_tile(
    q_ptr, kv_ptr, table, positions_ptr, out_ptr, scale, window, query_start, num_queries,
    first_query, seq_len, kv_head,
    stride_qt, stride_qh, stride_kv, stride_kh, stride_kblk, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, HAS_POSITIONS: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Queries first_query .. + BLOCK_Q - 1 of a sequence, each with the GROUP query heads
    of `kv_head`, over their context."""
    r = tl.arange(0, BLOCK_M)
    i = first_query + r // GROUP  # each row's query within the sequence
    head = kv_head * GROUP + r % GROUP
    is_query = (r < BLOCK_Q * GROUP) & (i < num_queries)
    rows = query_start + i
    d = tl.arange(0, HEAD_DIM)
    if HAS_POSITIONS:
        q_pos = tl.load(positions_ptr + rows, mask=is_query, other=-1)
    else:
        q_pos = tl.where(is_query, seq_len - num_queries + i, -1)
    last = tl.max(q_pos) + 1
    first = tl.maximum(tl.min(tl.where(is_query, q_pos, seq_len)) - window + 1, 0)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=is_query[:, None], other=0.0)
    first = first // BLOCK_N * BLOCK_N
    m = tl.full([BLOCK_M], MASKED, tl.float32)  # every query row sees at least itself
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = kv_ptr + kv_head.to(tl.int64) * stride_kh
    for start in range(first, last, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        in_context = t < last
        k, v = load_kv_tile(k_base, stride_kv, stride_kblk, table, t, in_context, BLOCK_SIZE,
                            HEAD_DIM)
        visible = ((t[None, :] <= q_pos[:, None]) & (t[None, :] > q_pos[:, None] - window)
                   & in_context[None, :])
        m, l_sum, acc = attend_tile(q, k, v, visible, m, l_sum, acc, scale, PRECISION,
                                    SOFTCAP)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=is_query[:, None])


def queries_per_tile(group: int) -> int:
    """BLOCK_Q: as many queries as fill a tile with their `group` heads each (at least one)."""
    return max(1, TILE_ROWS // group)


def tile_config(head_dim: int, block_size: int) -> dict[str, int]:
    """Key tile and warps per program: the largest key tile that 8 warps hold without
    spilling, compiled for an H100 as a launch specializes the kernel
    (`scripts/attention_sm90.py`): 64 keys up to head_dim 128 (209 registers at 128 under
    Triton 3.6), 32 at 256 (244); a tile twice as wide spills under 3.6 or 3.9."""
    keys = 64 if head_dim <= 128 else 32
    return {"BLOCK_N": max(keys, block_size), "num_warps": 8}


def paged_varlen_attention(q: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, window: int | None,
                           out: torch.Tensor, num_programs: int,
                           positions: torch.Tensor | None = None,
                           decode_count: torch.Tensor | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """q, out: [num_rows, Hq, D], rows of sequence i at query_start_loc[i] .. [i + 1] - 1,
    all within num_rows; kv_cache: [2, Hkv, num_blocks, block_size, D], already holding the
    new keys; block_tables: [num_seqs, ...]; seq_lens: [num_seqs] context lengths;
    positions: [num_rows] each row's position, when a sequence's queries are not its last
    ones. Rows outside every sequence are left as they are. At most `num_programs` programs
    share the work. `decode_count`, a [1] device tensor: the first decode_count[0]
    sequences are left out too, for the decode kernel. `softcap`: scores s become
    softcap * tanh(s / softcap)."""
    num_seqs = seq_lens.shape[0]
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    num_rows, num_heads, _ = q.shape
    assert q.stride(2) == 1 and kv_cache.is_contiguous() and block_tables.stride(1) == 1
    group = num_heads // num_kv_heads
    block_q = queries_per_tile(group)
    # The tiles from the first sequence's on: query_start_loc[-1] // block_q + num_seqs
    # at most, each for every KV head.
    grid = (min((num_rows // block_q + num_seqs) * num_kv_heads, num_programs),)
    _varlen_kernel[grid](
        q, kv_cache, block_tables, query_start_loc, seq_lens,
        positions if positions is not None else seq_lens,
        decode_count if decode_count is not None else seq_lens, out, scale,
        window or NO_WINDOW, num_seqs,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=max(TILE_ROWS, triton.next_power_of_2(group)),
        PRECISION=dot_precision(q.dtype), HAS_POSITIONS=positions is not None,
        SKIP_DECODES=decode_count is not None, SOFTCAP=softcap or 0.0,
        **tile_config(head_dim, block_size))
    return out
