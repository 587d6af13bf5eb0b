"""Emptying the CPU's caches before a timed call, so the call reads its weights from memory as
a decode step does: between two calls of one layer, every other layer's weights pass through
the caches. Timed back to back instead, a layer of a few MB runs from the last-level cache,
and a dense float32 weight looked faster than the quantized one with a quarter of its bytes
(a 2-core AVX2 EPYC with a 32 MB L3 ran llama3.2-1b's attention projections dense)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

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
