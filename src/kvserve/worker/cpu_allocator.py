"""How the CPU runner's memory is mapped: a step's freed temporaries stay in the process
heap for the next step, and the KV pool lies on huge pages.

glibc serves each allocation above 128 KiB (a prefill step's activations: megabytes per
layer) with a fresh `mmap` and unmaps it on free, or hands a freed heap top back to the
kernel, so the next step touches new pages and takes a page fault per 4 KiB. A 2,048-token
bfloat16 prefill of a 30-layer model took 1,000-13,000 faults per step (at ~0.85 us each)
and ran 391-400 ms with them gone against 399-453 ms with them. Raising both thresholds
makes freed blocks stay in the heap, reused by the next step; what the process keeps is
the most one step held at once.

A decode step reads each sequence's KV blocks from anywhere in a pool of gigabytes: on 4 KiB
pages nearly every block is a TLB miss, which a 2 MiB page turns into a hit for 512 blocks'
worth of a head (64 decodes of 300 tokens, bfloat16, on a 2-core Xeon: attention 0.92-0.94x
the time).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Larger than a 2,048-token step's biggest temporary on an 8B model (its 117 MB bfloat16
# gate/up output); allocations above it (KV pools, embeddings) still get their own mapping.
_MMAP_THRESHOLD_BYTES = 256 << 20
_TRIM_THRESHOLD_BYTES = 1 << 30
_MADV_HUGEPAGE = 14  # (sys/mman.h, Linux)
_HUGE_PAGE_BYTES = 2 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


@functools.cache
def retain_freed_memory() -> bool:
    """Sets glibc's mmap and trim thresholds for this process, once; False where the C
    library is not glibc (nothing changed)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
                and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Asks the kernel to back the whole 2 MiB pages inside `tensor`'s memory with huge pages
    (transparent huge pages in `madvise` or `always` mode) when they are first touched;
    False where the C library or the kernel declines (nothing changed)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise"):
        return False
    first = -(-tensor.data_ptr() // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // _HUGE_PAGE_BYTES \
        * _HUGE_PAGE_BYTES
    if end <= first:
        return False
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(first, end - first, _MADV_HUGEPAGE) == 0
