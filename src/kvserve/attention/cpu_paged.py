"""The CPU attention backend: the reference's prefill path plus a C++ paged decode kernel.

The kernel reads keys and values where they lie in the block pool, so a decode step streams
the KV cache once instead of gathering it into a copy first. It is compiled on first use
(about a minute, cached under ~/.cache/torch_extensions); if that fails, or for dtypes or head
sizes it does not cover, the plain-torch path runs instead.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.torch_ref import TorchPagedAttention
from kvserve.cpp_extension import build


@functools.cache
def load_kernel() -> ModuleType | None:
    return build("kvserve_paged_decode", Path(__file__).parent / "csrc" / "paged_decode.cpp",
                 "CPU attention kernel")


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self, kernel: ModuleType) -> None:
        self.kernel = kernel

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        if q.dtype not in (torch.float32, torch.bfloat16) or q.shape[-1] % 16:
            return super().decode(q, kv_cache, meta, scale)
        block_tables, seq_lens = meta.decode_tables(kv_cache.shape[3])
        out = self.kernel.paged_decode_attention(
            q.contiguous(), kv_cache, block_tables.contiguous(), seq_lens, scale,
            meta.sliding_window or 0)
        return out.view(q.shape[0], -1)
