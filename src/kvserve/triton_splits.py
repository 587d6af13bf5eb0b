"""Work split over several programs and finished by the last of them to arrive, so the
reduction needs no launch of its own (at decode sizes a launch costs more than the
reduction): split-K GEMMs and FlashDecoding's context splits.

Each program stores its part, then counts itself in on the group's counter; the program
that arrives last reads every part back and writes the result, then re-arms the counter.
One counter buffer per device serves every kernel: launches on a stream run one after
another, and each leaves the counters at zero. It is made on a kernel's first call, which
is eager: CUDA graphs are captured after a warm-up step."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_GROUPS = 4096  # split groups one launch may have: far above the programs that make
# splitting worth it


@triton.jit
def arrives_last(counter_ptr, num_parts):
    """Counts this program's part in (once every thread's part is stored); whether it was
    the last of the group's `num_parts`. Parts are then read from L2 (`.cg`): other SMs
    wrote them."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1) == num_parts - 1  # acq_rel, GPU scope


@triton.jit
def rearm(counter_ptr):
    tl.atomic_xchg(counter_ptr, 0)  # ready for the next call


@functools.cache
def split_counters(device: torch.device) -> torch.Tensor:
    """[MAX_GROUPS] int32 counters on `device`, zero between launches."""
    return torch.zeros(MAX_GROUPS, dtype=torch.int32, device=device)


def check_split_groups(num_groups: int) -> None:
    if num_groups > MAX_GROUPS:
        raise ValueError(f"a split launch takes at most {MAX_GROUPS} groups of programs, "
                         f"got {num_groups}")


@triton.jit
def store_split_tile(acc, rows, cols, M, N, out_ptr, partials_ptr, counter_ptr, split,
                     num_splits):
    """Stores a split-K GEMM's [BM, BN] float32 tile of the [M, N] output: directly, or as one
    split's partial sum that the last split of the tile to arrive adds up."""
    offsets = rows[:, None] * N + cols[None, :]
    out_ok = (rows < M)[:, None] & (cols < N)[None, :]
    if num_splits > 1:
        tl.store(partials_ptr + split * M * N + offsets, acc, mask=out_ok)
        if arrives_last(counter_ptr, num_splits):
            acc = tl.zeros(acc.shape, tl.float32)
            for other in range(num_splits):
                acc += tl.load(partials_ptr + other * M * N + offsets, mask=out_ok, other=0.0,
                               cache_modifier=".cg")
            tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
            rearm(counter_ptr)
    else:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=out_ok)


def splits_for_tiles(num_tiles: int, k: int, block_k: int, num_programs: int) -> int:
    """Splits of the input dimension (k) that bring a launch of `num_tiles` output tiles near
    `num_programs` programs, each split at least four input tiles long and none empty."""
    splits = max(1, min(-(-num_programs // num_tiles), k // (4 * block_k)))
    return triton.cdiv(k, triton.cdiv(triton.cdiv(k, splits), block_k) * block_k)
