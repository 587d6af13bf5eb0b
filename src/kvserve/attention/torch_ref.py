"""Paged attention in plain PyTorch: the CPU path, and the oracle for faster kernels.

Decode rows are computed together with batched matmuls over the GQA groups (SDPA is slow for
one-row queries on CPU); each prefill chunk uses SDPA over its own context.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from kvserve.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    PrefillChunk,
    QKNorm,
)


class TorchPagedAttention(AttentionBackend):
    # Gemma 2's: scores become softcap * tanh(scores / softcap) before the mask.
    softcap: float | None = None

    def __init__(self, softcap: float | None = None) -> None:
        self.softcap = softcap

    def forward(self, qk: torch.Tensor, v: torch.Tensor, freqs_cis: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                qk_norm: QKNorm | None = None) -> torch.Tensor:
        assert qk_norm is None, "qk is normed before a backend that does not fuse it"
        q, k = rotate_and_cache(qk, v, freqs_cis, kv_cache, meta.slot_mapping)
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            out[:meta.num_decodes] = self.decode(q[:meta.num_decodes], kv_cache, meta, scale)
        for chunk, rows, block_ids, positions in prefill_chunks(meta, kv_cache.shape[3]):
            out[rows] = self.prefill(q[rows], k[rows], v[rows], kv_cache, chunk, block_ids,
                                     meta.sliding_window, scale, positions)
        return out

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """Attention of one query token per sequence over its paged context."""
        return _decode(q, kv_cache, meta, scale, self.softcap)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                chunk: PrefillChunk, block_ids: torch.Tensor, window: int | None,
                scale: float, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of one prefill chunk (its rotated queries, keys and values, the
        latter already in the cache) over its context; its queries at `positions` when
        given."""
        return _prefill(q, k, v, kv_cache, chunk, block_ids, window, scale, positions,
                        self.softcap)


def rotate_and_cache(qk: torch.Tensor, v: torch.Tensor, freqs_cis: torch.Tensor,
                     kv_cache: torch.Tensor, slot_mapping: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated queries and keys of qk [N, Hq + Hkv, D], with the keys and v written to
    the cache at `slot_mapping`."""
    num_kv_heads, head_dim = kv_cache.shape[1], qk.shape[-1]
    qk = apply_rotary(qk, freqs_cis)  # q and k heads rotated in one op
    q, k = qk[:, :-num_kv_heads], qk[:, -num_kv_heads:]
    flat = kv_cache.view(2, num_kv_heads, -1, head_dim)
    flat[0].index_copy_(1, slot_mapping, k.transpose(0, 1))
    flat[1].index_copy_(1, slot_mapping, v.transpose(0, 1))
    return q, k


def prefill_chunks(meta: AttentionMetadata, block_size: int
                   ) -> Iterator[tuple[PrefillChunk, slice, torch.Tensor, torch.Tensor | None]]:
    """Each prefill chunk of the step with its rows, its context's blocks and its query
    positions (None: the context's last ones)."""
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.num_query_tokens)
        block_ids = meta.block_tables[chunk.seq, :-(-chunk.context_len // block_size)]
        positions = None if meta.query_positions is None else meta.query_positions[rows]
        yield chunk, rows, block_ids, positions


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim] in interleaved pair order; each pair is a complex number
    multiplied by its rotation, in float32."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis).flatten(-2).to(x.dtype)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
            scale: float, softcap: float | None = None) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    block_tables, seq_lens = meta.decode_tables(kv_cache.shape[3])
    # [Hkv, B, max_blocks, block_size, D] -> one [T, D] context per (kv head, sequence).
    keys = kv_cache[0][:, block_tables].view(num_kv_heads * batch, -1, head_dim)
    values = kv_cache[1][:, block_tables].view(num_kv_heads * batch, -1, head_dim)
    queries = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)
    queries = queries.reshape(num_kv_heads * batch, group, head_dim)
    bias = _decode_bias(seq_lens, keys.shape[1], meta.sliding_window, q.dtype)
    bias = bias.unsqueeze(1).repeat(num_kv_heads, 1, 1)
    if softcap is None:
        scores = torch.baddbmm(bias, queries, keys.transpose(1, 2), alpha=scale)
    else:
        scores = _capped(torch.bmm(queries, keys.transpose(1, 2)) * scale, softcap) + bias
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, values).view(num_kv_heads, batch, group, head_dim)
    return out.transpose(0, 1).reshape(batch, num_heads * head_dim)


def _decode_bias(seq_lens: torch.Tensor, width: int, window: int | None,
                 dtype: torch.dtype) -> torch.Tensor:
    """[num_decodes, width] additive mask: 0 for each sequence's visible keys, -inf for the
    block-table padding and for keys outside the sliding window."""
    lens = seq_lens.unsqueeze(1)
    key_pos = torch.arange(width, device=lens.device)
    visible = key_pos < lens
    if window is not None:
        visible &= key_pos >= lens - window
    bias = torch.zeros(visible.shape, dtype=dtype, device=lens.device)
    return bias.masked_fill_(~visible, float("-inf"))


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             chunk: PrefillChunk, block_ids: torch.Tensor, window: int | None,
             scale: float, positions: torch.Tensor | None, softcap: float | None = None
             ) -> torch.Tensor:
    num_q, ctx = chunk.num_query_tokens, chunk.context_len
    head_dim = q.shape[-1]
    if num_q == ctx and positions is None:  # the new keys are the whole context
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
    else:
        num_kv_heads = kv_cache.shape[1]
        keys = kv_cache[0][:, block_ids].view(num_kv_heads, -1, head_dim)[:, :ctx]
        values = kv_cache[1][:, block_ids].view(num_kv_heads, -1, head_dim)[:, :ctx]
    mask = None
    if (positions is not None or num_q != ctx or (window is not None and window < ctx)
            or softcap is not None):
        if positions is None:
            positions = torch.arange(ctx - num_q, ctx, device=q.device)
        mask = causal_mask(positions, ctx, window)
    if softcap is not None:  # beyond SDPA: the scores themselves
        group = q.shape[1] // keys.shape[0]
        scores = torch.matmul(q.transpose(0, 1), keys.repeat_interleave(group, 0).mT) * scale
        probs = _capped(scores, softcap).masked_fill(~mask, float("-inf")).softmax(-1)
        out = torch.matmul(probs, values.repeat_interleave(group, 0))
        return out.transpose(0, 1).reshape(num_q, -1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=q.shape[1] != keys.shape[0])
    return out.squeeze(0).transpose(0, 1).reshape(num_q, -1)


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(scores / softcap) * softcap


def causal_mask(positions: torch.Tensor, ctx: int, window: int | None) -> torch.Tensor:
    """Bool [queries, ctx]: the query at `positions[i]` sees key j iff j <= its position
    and, with a sliding window W, j > position - W."""
    pos = positions.unsqueeze(1)
    key = torch.arange(ctx, device=positions.device).unsqueeze(0)
    allowed = key <= pos
    if window is not None:
        allowed &= key > pos - window
    return allowed
