"""KV blocks in host memory: the swap space of requests preempted by swap, then the host
tier of prefix-cache blocks evicted from the device pool.

It has the device pool's layout, [layers, K/V, kv heads, blocks, block_size, head_dim], so a
run of consecutive blocks on both sides is one strided copy per (layer, K/V, head) slice of
`run_length * block_size * head_dim` elements; the block pool hands out consecutive blocks
where it can, which keeps a swap to a few such runs. On CUDA the host tier is pinned memory
and the copies run on their own stream, ordered after the compute stream's work so far and
before the next forward.
"""

from __future__ import annotations

import time

import torch

# (source block, destination block) pairs
BlockCopies = list[tuple[int, int]]


def contiguous_runs(copies: BlockCopies) -> list[tuple[int, int, int]]:
    """(first source, first destination, length) of each run of pairs whose sources and
    destinations both go up by one."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in copies:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            first_src, first_dst, length = runs[-1]
            runs[-1] = (first_src, first_dst, length + 1)
        else:
            runs.append((src, dst, 1))
    return runs


class HostKVCache:
    def __init__(self, device_cache: torch.Tensor, num_blocks: int) -> None:
        """`num_blocks` host blocks: the swap space's, then the host tier's."""
        self.device_cache = device_cache
        shape = list(device_cache.shape)
        shape[3] = num_blocks
        on_cuda = device_cache.device.type == "cuda"
        # Uninitialized: a host block is read only after a copy or a file has filled it.
        self.blocks = torch.empty(shape, dtype=device_cache.dtype, pin_memory=on_cuda)
        self.stream = torch.cuda.Stream(device_cache.device) if on_cuda else None
        self.num_copies = 0  # strided copies made, to see how well swaps coalesce
        self.num_blocks_copied = 0

    def block(self, host_block: int) -> torch.Tensor:
        """One host block, [layers, K/V, kv heads, block_size, head_dim] (a strided view)."""
        return self.blocks[:, :, :, host_block]

    def wait(self) -> None:
        """Waits for queued copies, before the host reads or writes blocks itself."""
        if self.stream is not None:
            self.stream.synchronize()

    def to_host(self, copies: BlockCopies) -> None:
        self._copy(copies, self.device_cache, self.blocks)

    def to_device(self, copies: BlockCopies) -> None:
        """Copies host blocks in; the next forward sees them."""
        self._copy(copies, self.blocks, self.device_cache)

    def _copy(self, copies: BlockCopies, src: torch.Tensor, dst: torch.Tensor) -> None:
        if not copies:
            return
        if self.stream is None:
            self._copy_runs(copies, src, dst)
            return
        compute = torch.cuda.current_stream(self.device_cache.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy_runs(copies, src, dst)
        compute.wait_stream(self.stream)

    def _copy_runs(self, copies: BlockCopies, src: torch.Tensor, dst: torch.Tensor) -> None:
        for first_src, first_dst, length in contiguous_runs(copies):
            dst[:, :, :, first_dst:first_dst + length].copy_(
                src[:, :, :, first_src:first_src + length], non_blocking=True)
            self.num_copies += 1
        self.num_blocks_copied += len(copies)

    def seconds_per_block(self, num_blocks: int = 16) -> float:
        """Times a run of blocks copied out and back in (median of three), per block and
        direction. The round trip leaves the device blocks as they were."""
        n = min(num_blocks, self.blocks.shape[3], self.device_cache.shape[3])
        pairs = [(i, i) for i in range(n)]
        times = []
        for _ in range(3):
            start = time.perf_counter()
            self.to_host(pairs)
            self.to_device(pairs)
            self.wait()
            times.append(time.perf_counter() - start)
        self.num_copies = self.num_blocks_copied = 0
        return sorted(times)[1] / (2 * n)
