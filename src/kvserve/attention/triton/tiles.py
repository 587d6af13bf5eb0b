"""The inner loop that the decode and prefill kernels share: load a tile of keys and values
through a block table, and fold it into an online softmax (FlashAttention)."""

from __future__ import annotations

import triton
import triton.language as tl

# A masked score. Finite, so a row whose first tiles are all masked (outside its window)
# accumulates junk at m = MASKED, which its first visible key wipes out (alpha = 0).
MASKED = tl.constexpr(-1.0e30)
# The window of a model without one: wider than any context, so no key falls outside it.
NO_WINDOW = 1 << 30


@triton.jit
def load_kv_tile(kv_head_ptr, stride_kv, stride_kblk, table_ptr, t, valid,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Keys and values [len(t), HEAD_DIM] of context positions t (0 where not valid)."""
    d = tl.arange(0, HEAD_DIM)
    block = tl.load(table_ptr + t // BLOCK_SIZE, mask=valid, other=0)
    offset = block[:, None] * stride_kblk + (t % BLOCK_SIZE)[:, None] * HEAD_DIM + d[None, :]
    k = tl.load(kv_head_ptr + offset, mask=valid[:, None], other=0.0)
    v = tl.load(kv_head_ptr + stride_kv + offset, mask=valid[:, None], other=0.0)
    return k, v


@triton.jit
def scores(q, k, scale, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """q . k^T * scale; with SOFTCAP > 0 (Gemma 2's), capped to SOFTCAP * tanh(s / SOFTCAP),
    tanh(x) taken as 2 / (1 + e^-2x) - 1."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if SOFTCAP > 0:
        s = SOFTCAP * (2.0 / (1.0 + tl.exp(s * (-2.0 / SOFTCAP))) - 1.0)
    return s


@triton.jit
def attend_tile(q, k, v, visible, m, l_sum, acc, scale, PRECISION: tl.constexpr,
                SOFTCAP: tl.constexpr):
    """One online-softmax step of queries q over a key tile; returns the new running max,
    sum and unnormalized output."""
    s = tl.where(visible, scores(q, k, scale, PRECISION, SOFTCAP), MASKED)
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_sum, acc
