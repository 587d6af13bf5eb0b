"""The CPU attention backend: the reference's prefill path plus a C++ paged decode kernel.

The kernel reads keys and values where they lie in the block pool, so a decode step streams
the KV cache once instead of gathering it into a copy first. It is compiled on first use
(about a minute, cached under ~/.cache/torch_extensions); if that fails, or for dtypes or head
sizes it does not cover, the plain-torch path runs instead.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.torch_ref import TorchPagedAttention

logger = logging.getLogger(__name__)


@functools.cache
def load_kernel() -> ModuleType | None:
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        source = Path(__file__).parent / "csrc" / "paged_decode.cpp"
        logger.info("loading the CPU attention kernel (compiled on first use, about a minute)")
        return load(name="kvserve_paged_decode", sources=[str(source)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 (any build failure means: use the torch path)
        logger.warning("kvserve: CPU attention kernel unavailable (%s); using plain torch", e)
        return None


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self, kernel: ModuleType) -> None:
        self.kernel = kernel

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        if q.dtype != torch.float32 or q.shape[-1] % 16:
            return super().decode(q, kv_cache, meta, scale)
        block_tables, seq_lens = meta.decode_tables(kv_cache.shape[3])
        out = self.kernel.paged_decode_attention(
            q.contiguous(), kv_cache, block_tables.contiguous(), seq_lens, scale,
            meta.sliding_window or 0)
        return out.view(q.shape[0], -1)
