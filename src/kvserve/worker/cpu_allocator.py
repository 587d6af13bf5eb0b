"""Keeps a CPU step's freed temporaries in the process heap for the next step.

glibc serves each allocation above 128 KiB (a prefill step's activations: megabytes per
layer) with a fresh `mmap` and unmaps it on free, or hands a freed heap top back to the
kernel, so the next step touches new pages and takes a page fault per 4 KiB. A 2,048-token
bfloat16 prefill of a 30-layer model took 1,000-13,000 faults per step (at ~0.85 us each)
and ran 391-400 ms with them gone against 399-453 ms with them. Raising both thresholds
makes freed blocks stay in the heap, reused by the next step; what the process keeps is
the most one step held at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Larger than a 2,048-token step's biggest temporary on an 8B model (its 117 MB bfloat16
# gate/up output); allocations above it (KV pools, embeddings) still get their own mapping.
_MMAP_THRESHOLD_BYTES = 256 << 20
_TRIM_THRESHOLD_BYTES = 1 << 30


@functools.cache
def retain_freed_memory() -> bool:
    """Sets glibc's mmap and trim thresholds for this process, once; False where the C
    library is not glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
                and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))
