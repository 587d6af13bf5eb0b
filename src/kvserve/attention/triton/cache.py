"""Rotary embedding fused with the KV-cache write, in Triton: one pass over a step's new
queries and keys instead of a rotation, then a scatter of keys and values into the pool.
For models that norm each query and key head (Qwen3), the norm runs in the same pass, where
it would otherwise take a copy, a norm launch per side and a concatenation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.backend import QKNorm


@triton.jit
def _rotary_cache_kernel(
    qk_ptr, v_ptr, freqs_ptr, kv_ptr, slot_ptr, q_weight_ptr, k_weight_ptr, eps,
    stride_qkt, stride_qkh, stride_vt, stride_vh, stride_ft, stride_kv, stride_kh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    NORM: tl.constexpr,
):
    """One program per (token, query or key head): a decode step of one sequence still
    spreads over as many programs as the model has heads."""
    token, head = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, HALF)
    cos = tl.load(freqs_ptr + token * stride_ft + 2 * i)
    sin = tl.load(freqs_ptr + token * stride_ft + 2 * i + 1)
    pair = qk_ptr + token * stride_qkt + head * stride_qkh + 2 * i
    x0 = tl.load(pair)
    x1 = tl.load(pair + 1)
    if NORM:  # rounded where RMSNorm rounds: the normed value, then its product by the weight
        weight_ptr = q_weight_ptr if head < NUM_HEADS else k_weight_ptr
        a, b = x0.to(tl.float32), x1.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(a * a + b * b, 0) / (2 * HALF) + eps)
        w0 = tl.load(weight_ptr + 2 * i).to(tl.float32)
        w1 = tl.load(weight_ptr + 2 * i + 1).to(tl.float32)
        x0 = (w0 * (a * inv_rms).to(x0.dtype).to(tl.float32)).to(x0.dtype)
        x1 = (w1 * (b * inv_rms).to(x1.dtype).to(tl.float32)).to(x1.dtype)
    # Each interleaved pair is a complex number times e^(i * angle), computed in float32.
    re = x0.to(tl.float32) * cos - x1.to(tl.float32) * sin
    im = x0.to(tl.float32) * sin + x1.to(tl.float32) * cos
    re, im = re.to(x0.dtype), im.to(x0.dtype)
    tl.store(pair, re)  # queries and keys rotated in place
    tl.store(pair + 1, im)

    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        if head >= NUM_HEADS:  # a key head: its rotated key goes to the cache
            dest = kv_ptr + (head - NUM_HEADS).to(tl.int64) * stride_kh + slot * 2 * HALF + 2 * i
            tl.store(dest, re)
            tl.store(dest + 1, im)
        if head < NUM_KV_HEADS:  # the first heads' programs copy one value head each
            d = tl.arange(0, 2 * HALF)
            v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d)
            tl.store(kv_ptr + stride_kv + head.to(tl.int64) * stride_kh + slot * 2 * HALF + d,
                     v)


def rotary_and_cache(qk: torch.Tensor, v: torch.Tensor, freqs_cis: torch.Tensor,
                     kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     qk_norm: QKNorm | None = None) -> None:
    """qk: [N, Hq + Hkv, D] in interleaved pair order, normed (with `qk_norm`) and rotated
    in place; v: [N, Hkv, D]; freqs_cis: [N, 1, D / 2] complex; kv_cache: [2, Hkv,
    num_blocks, block_size, D] receives the rotated keys and the values at `slot_mapping` (a
    slot of -1 writes nothing)."""
    num_tokens, num_qk, head_dim = qk.shape
    num_kv_heads = kv_cache.shape[1]
    freqs = torch.view_as_real(freqs_cis)  # [N, 1, D / 2, 2]: cos, sin
    assert qk.stride(2) == 1 and v.stride(2) == 1 and kv_cache.is_contiguous()
    assert freqs.stride(2) == 2 and freqs.stride(3) == 1
    _rotary_cache_kernel[(num_tokens, num_qk)](
        qk, v, freqs, kv_cache, slot_mapping,
        qk_norm.q_weight if qk_norm else qk, qk_norm.k_weight if qk_norm else qk,
        qk_norm.eps if qk_norm else 0.0,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), freqs.stride(0),
        kv_cache.stride(0), kv_cache.stride(1),
        NUM_HEADS=num_qk - num_kv_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        NORM=qk_norm is not None, num_warps=1)
