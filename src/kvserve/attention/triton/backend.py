"""The CUDA attention backend: Triton kernels over the paged pool, nothing gathered.

A step costs three launches per layer: rotary fused with the KV write (and with Qwen3's
query and key norms), split-K decode attention for the decode rows, and one varlen launch
for all chunks. A mixed step padded to a CUDA graph's shape has its decode count on the
device: the decode launch covers as many sequences as could be decodes and splits those
that are as their number allows, and the varlen launch skips them.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, QKNorm
from kvserve.attention.triton.cache import rotary_and_cache
from kvserve.attention.triton.decode import (
    MAX_SPLITS,
    num_splits_for,
    paged_decode_attention,
)
from kvserve.attention.triton.varlen import paged_varlen_attention


class TritonPagedAttention(AttentionBackend):
    takes_padding_rows = True
    fuses_qk_norm = True

    def __init__(self, num_programs: int, softcap: float | None = None) -> None:
        # Decode splits aim to start this many programs; the varlen launch starts as many.
        self.num_programs = num_programs
        self.softcap = softcap  # Gemma 2's attention logit softcapping

    def forward(self, qk: torch.Tensor, v: torch.Tensor, freqs_cis: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                qk_norm: QKNorm | None = None) -> torch.Tensor:
        rotary_and_cache(qk, v, freqs_cis, kv_cache, meta.slot_mapping, qk_norm)
        num_kv_heads = kv_cache.shape[1]
        q = qk[:, :-num_kv_heads]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_decodes = meta.num_decodes
        if meta.decode_count is not None:
            slots = min(q.shape[0], meta.seq_lens.shape[0])
            paged_decode_attention(q[:slots], kv_cache, meta.block_tables[:slots],
                                   meta.seq_lens[:slots], scale, meta.sliding_window,
                                   MAX_SPLITS, out=out[:slots], decode_count=meta.decode_count,
                                   split_target=self.num_programs, softcap=self.softcap)
        elif num_decodes:
            splits = num_splits_for(num_decodes, num_kv_heads,
                                    int(meta.seq_lens_host[:num_decodes].max()),
                                    self.num_programs)
            paged_decode_attention(q[:num_decodes], kv_cache, meta.block_tables[:num_decodes],
                                   meta.seq_lens[:num_decodes], scale, meta.sliding_window,
                                   splits, out=out[:num_decodes], softcap=self.softcap)
        if meta.prefills or meta.decode_count is not None:
            paged_varlen_attention(
                q, kv_cache, meta.block_tables[num_decodes:],
                meta.query_start_loc[num_decodes:], meta.seq_lens[num_decodes:], scale,
                meta.sliding_window, out, self.num_programs, meta.query_positions,
                decode_count=meta.decode_count, softcap=self.softcap)
        return out.view(q.shape[0], -1)
