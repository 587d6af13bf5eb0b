"""Prefill attention for every chunk of a step in one Triton launch (varlen, paged).

Each chunk's queries attend to its whole context in the paged pool (earlier chunks, cached
prefix blocks and the chunk itself, whose keys were written just before), causally and
within the sliding window. One program handles a tile of one chunk's queries for one head;
the grid is (chunks, query tiles of the longest chunk, heads), and tiles past a chunk's end
return at once. This serves chunked prefill and prefix-cache hits alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.triton.tiles import MASKED, NO_WINDOW, attend_tile, load_kv_tile
from kvserve.triton_precision import dot_precision


@triton.jit
def _prefill_kernel(
    q_ptr, kv_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr, positions_ptr, out_ptr,
    scale, window,
    stride_qt, stride_qh, stride_kv, stride_kh, stride_kblk, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
):
    seq, tile, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    num_queries = tl.load(query_start_ptr + seq + 1) - query_start
    if tile * BLOCK_M >= num_queries:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    is_query = i < num_queries
    rows = query_start + i
    if HAS_POSITIONS:
        q_pos = tl.load(positions_ptr + rows, mask=is_query, other=0)
        last = tl.max(tl.where(is_query, q_pos, 0)) + 1
        first = tl.maximum(tl.min(tl.where(is_query, q_pos, seq_len)) - window + 1, 0)
    else:
        q_pos = seq_len - num_queries + i
        last = tl.minimum(seq_len, seq_len - num_queries + (tile + 1) * BLOCK_M)
        first = tl.maximum(seq_len - num_queries + tile * BLOCK_M - window + 1, 0)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=is_query[:, None], other=0.0)
    first = first // BLOCK_N * BLOCK_N
    m = tl.full([BLOCK_M], MASKED, tl.float32)  # every query row sees at least itself
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = kv_ptr + (head // GROUP).to(tl.int64) * stride_kh
    table = block_tables_ptr + seq * stride_bt
    for start in range(first, last, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        in_context = t < last
        k, v = load_kv_tile(k_base, stride_kv, stride_kblk, table, t, in_context, BLOCK_SIZE,
                            HEAD_DIM)
        visible = ((t[None, :] <= q_pos[:, None]) & (t[None, :] > q_pos[:, None] - window)
                   & in_context[None, :])
        m, l_sum, acc = attend_tile(q, k, v, visible, m, l_sum, acc, scale, PRECISION)
    out = acc / l_sum[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=is_query[:, None])


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, max_query_len: int, scale: float,
                            window: int | None, out: torch.Tensor,
                            positions: torch.Tensor | None = None) -> torch.Tensor:
    """q, out: [num_tokens, Hq, D], rows of chunk i at query_start_loc[i] .. [i + 1] - 1;
    kv_cache: [2, Hkv, num_blocks, block_size, D], already holding every chunk's new keys;
    block_tables: [num_chunks, ...]; seq_lens: [num_chunks] context lengths; positions:
    [num_tokens] each row's position, when chunks' queries are not their last ones."""
    num_chunks = seq_lens.shape[0]
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    assert q.stride(2) == 1 and kv_cache.is_contiguous() and block_tables.stride(1) == 1
    block_m = 64 if max_query_len > 32 else 16
    grid = (num_chunks, triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        q, kv_cache, block_tables, query_start_loc, seq_lens,
        positions if positions is not None else seq_lens, out, scale, window or NO_WINDOW,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=max(64, block_size),
        PRECISION=dot_precision(q.dtype),
        HAS_POSITIONS=positions is not None)
    return out
