"""Emptying the CPU's caches before a timed call, so the call reads its weights from memory as
a decode step does: between two calls of one layer, every other layer's weights pass through
the caches. Timed back to back instead, a layer of a few MB runs from the last-level cache,
and a dense float32 weight looked faster than the quantized one with a quarter of its bytes
(a 2-core AVX2 EPYC with a 32 MB L3 ran llama3.2-1b's attention projections dense).

Where the weights are known, only they are evicted (`evict_from_caches`): in a decode step
the code, the buffers and the threads a call uses stay warm, and emptying all the caches
charges a call for them too, the more the more short steps it takes (on a 2-core AVX-512 EPYC,
a one-row W4A8 call of a 576 x 576 layer took 31.6 us after a full flush, 9.1 us between
other layers' calls, and a dense bfloat16 one 19.8 and 15.5)."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

import torch

from kvserve.cpp_extension import cpu_kernels

FALLBACK_CACHE_BYTES = 64 << 20  # where sysfs does not say
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def largest_cache_bytes() -> int:
    """The size of the first CPU's largest cache, from sysfs ("32768K")."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        if text[-1:] in _UNITS and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * _UNITS[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=FALLBACK_CACHE_BYTES)


@functools.cache
def _flush_buffer() -> torch.Tensor:
    return torch.ones(2 * largest_cache_bytes() // 4)


def flush_cpu_caches() -> None:
    """Reads twice the largest cache's bytes, which evicts whatever the caches held."""
    _flush_buffer().sum()


def evict_from_caches(tensors: Iterable[torch.Tensor]) -> None:
    """Drops these (contiguous) tensors' bytes from every cache level; with no CPU kernels to
    do it, empties the caches."""
    kernels = cpu_kernels()
    if kernels is None:
        flush_cpu_caches()
        return
    for t in tensors:
        kernels.evict_from_caches(t)
