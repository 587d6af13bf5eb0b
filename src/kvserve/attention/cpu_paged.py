"""The CPU attention backend: C++ kernels for paged decode and prefill attention.

Both kernels read keys and values where they lie in the block pool, so a step streams the
KV cache once instead of gathering it into a copy first. In a decode-only step the decode
kernel also rotates the new queries and keys and writes the new keys and values, in the
same call; prefill chunks run a flash-attention-style kernel on the GEMM's register tiles
(csrc/prefill_attention.cpp). They are compiled on first use (cached under
~/.cache/torch_extensions); if that fails, or for dtypes or head sizes they do not cover,
the reference path runs instead.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvserve.attention.backend import AttentionMetadata, PrefillChunk
from kvserve.attention.torch_ref import TorchPagedAttention


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self, kernel: ModuleType) -> None:
        self.kernel = kernel
        # The dtypes the prefill kernel runs in on this CPU: those of the blocked GEMM.
        self.prefill_dtypes = {dtype for dtype in (torch.float32, torch.bfloat16)
                               if kernel.gemm_supports(torch.empty(16, 2, dtype=dtype))}

    def forward(self, qk: torch.Tensor, v: torch.Tensor, freqs_cis: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """A decode-only step is one kernel call per layer: rotary, cache write and
        attention; a step with prefill chunks takes the reference path."""
        if meta.prefills or not self._covers(qk):
            return super().forward(qk, v, freqs_cis, kv_cache, meta, scale)
        block_tables, seq_lens = meta.decode_tables(kv_cache.shape[3])
        out = self.kernel.rotate_cache_and_decode(
            _with_contiguous_heads(qk), _with_contiguous_heads(v),
            torch.view_as_real(freqs_cis).contiguous(),
            meta.slot_mapping, kv_cache, block_tables.contiguous(), seq_lens, scale,
            meta.sliding_window or 0)
        return out.view(qk.shape[0], -1)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        if not self._covers(q):
            return super().decode(q, kv_cache, meta, scale)
        block_tables, seq_lens = meta.decode_tables(kv_cache.shape[3])
        out = self.kernel.paged_decode_attention(
            q.contiguous(), kv_cache, block_tables.contiguous(), seq_lens, scale,
            meta.sliding_window or 0)
        return out.view(q.shape[0], -1)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                chunk: PrefillChunk, block_ids: torch.Tensor, window: int | None,
                scale: float) -> torch.Tensor:
        if q.dtype not in self.prefill_dtypes or not self._covers(q):
            return super().prefill(q, k, v, kv_cache, chunk, block_ids, window, scale)
        return self.kernel.prefill_attention(_with_contiguous_heads(q), kv_cache,
                                             block_ids.contiguous(), chunk.context_len, scale,
                                             window or 0)

    @staticmethod
    def _covers(x: torch.Tensor) -> bool:
        return x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] % 16 == 0


def _with_contiguous_heads(x: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] as the kernel reads it: rows may be strided (views of the QKV projection),
    heads not."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
