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

from kvserve.attention.backend import AttentionMetadata, PrefillChunk, QKNorm
from kvserve.attention.torch_ref import TorchPagedAttention, prefill_chunks, rotate_and_cache


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self, kernel: ModuleType, softcap: float | None = None) -> None:
        super().__init__(softcap)
        self.kernel = kernel
        # The dtypes the prefill kernel runs in on this CPU.
        self.prefill_dtypes = {dtype for dtype in (torch.float32, torch.bfloat16)
                               if kernel.prefill_attention_supports(torch.empty(0, dtype=dtype))}

    def forward(self, qk: torch.Tensor, v: torch.Tensor, freqs_cis: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                qk_norm: QKNorm | None = None) -> torch.Tensor:
        """The decode rows are one fused kernel call (rotary, cache write, attention) whether
        or not prefill chunks share the step, so a decode computes the same bits in any
        batch; the prefill rows are rotated and cached in C++ too, then each chunk runs the
        prefill kernel (the reference's rotary, cache write and prefill where this CPU build
        has no prefill kernel for the dtype). What the kernels do not cover takes the
        reference path."""
        assert qk_norm is None, "qk is normed before a backend that does not fuse it"
        if not self._covers(qk):
            return super().forward(qk, v, freqs_cis, kv_cache, meta, scale)
        qk, v = _with_contiguous_heads(qk), _with_contiguous_heads(v)
        rotation = torch.view_as_real(freqs_cis).contiguous()
        num_rows, num_decodes = qk.shape[0], meta.num_decodes
        if not meta.prefills:
            return self._decode_rows(qk, v, rotation, kv_cache, meta, scale).view(num_rows, -1)
        out = qk.new_empty(num_rows, (qk.shape[1] - kv_cache.shape[1]) * qk.shape[2])
        if num_decodes:
            out[:num_decodes] = self._decode_rows(
                qk[:num_decodes], v[:num_decodes], rotation[:num_decodes], kv_cache, meta,
                scale).view(num_decodes, -1)
        qk, v, slots = qk[num_decodes:], v[num_decodes:], meta.slot_mapping[num_decodes:]
        kernel = qk.dtype in self.prefill_dtypes
        if kernel:
            q = self.kernel.rotate_and_cache(qk, v, rotation[num_decodes:], slots, kv_cache)
        else:
            q, k = rotate_and_cache(qk, v, freqs_cis[num_decodes:], kv_cache, slots)
        for chunk, rows, block_ids, positions in prefill_chunks(meta, kv_cache.shape[3]):
            own = slice(rows.start - num_decodes, rows.stop - num_decodes)
            if kernel:
                self._prefill_chunk(q[own], kv_cache, chunk, block_ids, meta.sliding_window,
                                    scale, positions, out[rows])
            else:
                out[rows] = super().prefill(q[own], k[own], v[own], kv_cache, chunk, block_ids,
                                            meta.sliding_window, scale, positions)
        return out

    def _decode_rows(self, qk: torch.Tensor, v: torch.Tensor, rotation: torch.Tensor,
                     kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
        block_tables, seq_lens = meta.decode_tables(kv_cache.shape[3])
        return self.kernel.rotate_cache_and_decode(
            qk, v, rotation, meta.slot_mapping[:qk.shape[0]], kv_cache,
            block_tables.contiguous(), seq_lens, scale, meta.sliding_window or 0,
            meta.decode_rows_share_sequences, self.softcap or 0.0)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        if not self._covers(q):
            return super().decode(q, kv_cache, meta, scale)
        block_tables, seq_lens = meta.decode_tables(kv_cache.shape[3])
        out = self.kernel.paged_decode_attention(
            q.contiguous(), kv_cache, block_tables.contiguous(), seq_lens, scale,
            meta.sliding_window or 0, self.softcap or 0.0)
        return out.view(q.shape[0], -1)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                chunk: PrefillChunk, block_ids: torch.Tensor, window: int | None,
                scale: float, positions: torch.Tensor | None = None) -> torch.Tensor:
        if q.dtype not in self.prefill_dtypes or not self._covers(q):
            return super().prefill(q, k, v, kv_cache, chunk, block_ids, window, scale,
                                   positions)
        return self._prefill_chunk(_with_contiguous_heads(q), kv_cache, chunk, block_ids,
                                   window, scale, positions)

    def _prefill_chunk(self, q: torch.Tensor, kv_cache: torch.Tensor, chunk: PrefillChunk,
                       block_ids: torch.Tensor, window: int | None, scale: float,
                       positions: torch.Tensor | None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernel.prefill_attention(
            q, kv_cache, block_ids.contiguous(), chunk.context_len, scale, window or 0,
            None if positions is None else positions.contiguous(), out, self.softcap or 0.0)

    @staticmethod
    def _covers(x: torch.Tensor) -> bool:
        return x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] % 16 == 0


def _with_contiguous_heads(x: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] as the kernel reads it: rows may be strided (views of the QKV projection),
    heads not."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
