"""KV blocks in host memory: the swap space of requests preempted by swap, then the host
tier of prefix-cache blocks evicted from the device pool.

Host blocks are laid out block-major, [blocks, layers, K/V, kv heads, block_size, head_dim],
so a run of consecutive host blocks is one contiguous region, and a file of the disk tier is
one block's bytes as they lie. On CUDA a transfer moves one such run whatever device blocks
it pairs with: to host, the device blocks are gathered into one staging tensor on the device
and copied over in one transfer; to the device, the run goes over in one transfer and is
scattered into its blocks there. The host pools hand out consecutive blocks, so a swap of a
request whose device blocks lie scattered is still a few large transfers. The host blocks
are pinned and the copies run on their own stream, ordered after the compute stream's work
so far and before the next forward. On CPU, where there is no transfer to save, each block
is one memcpy into or out of its host block: 5x faster there than gathering first.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

# (source block, destination block) pairs
BlockCopies = list[tuple[int, int]]
# Blocks per transfer at most, which bounds the staging tensor on the device.
MAX_RUN_BLOCKS = 64


def host_runs(copies: BlockCopies, host_side: int) -> list[tuple[int, list[int]]]:
    """(first host block, the device blocks in host order) of each run of pairs whose host
    blocks go up by one; `host_side` says which element of a pair is the host block."""
    runs: list[tuple[int, list[int]]] = []
    for pair in copies:
        host, device = pair[host_side], pair[1 - host_side]
        if runs and host == runs[-1][0] + len(runs[-1][1]) and len(runs[-1][1]) < MAX_RUN_BLOCKS:
            runs[-1][1].append(device)
        else:
            runs.append((host, [device]))
    return runs


class HostKVCache:
    def __init__(self, device_cache: torch.Tensor, num_blocks: int) -> None:
        """`num_blocks` host blocks: the swap space's, then the host tier's."""
        self.device_cache = device_cache  # [layers, K/V, kv heads, blocks, block_size, dim]
        layers, kv, heads, _, size, dim = device_cache.shape
        on_cuda = device_cache.device.type == "cuda"
        # Uninitialized: a host block is read only after a copy or a file has filled it.
        self.blocks = torch.empty(num_blocks, layers, kv, heads, size, dim,
                                  dtype=device_cache.dtype, pin_memory=on_cuda)
        self.stream = torch.cuda.Stream(device_cache.device) if on_cuda else None
        self.gather_runs = on_cuda  # one staged transfer per run, else a memcpy per block
        self.num_copies = 0  # transfers (CUDA) or memcpys (CPU) made
        self.num_blocks_copied = 0

    def block(self, host_block: int) -> torch.Tensor:
        """One host block, [layers, K/V, kv heads, block_size, head_dim], contiguous."""
        return self.blocks[host_block]

    def wait(self) -> None:
        """Waits for queued copies, before the host reads or writes blocks itself."""
        if self.stream is not None:
            self.stream.synchronize()

    def to_host(self, copies: BlockCopies) -> None:
        """Copies (device, host) block pairs out."""
        self._on_stream(self._gather, host_runs(copies, host_side=1), len(copies))

    def to_device(self, copies: BlockCopies) -> None:
        """Copies (host, device) block pairs in; the next forward sees them."""
        self._on_stream(self._scatter, host_runs(copies, host_side=0), len(copies))

    def _gather(self, first: int, device_blocks: list[int]) -> int:
        """Copies device blocks into host blocks `first...`; returns the copies made."""
        if not self.gather_runs:
            for offset, block in enumerate(device_blocks):
                self.blocks[first + offset].copy_(self.device_cache[:, :, :, block])
            return len(device_blocks)
        ids = torch.tensor(device_blocks, device=self.device_cache.device)
        staged = self.device_cache.index_select(3, ids).permute(3, 0, 1, 2, 4, 5)
        self.blocks[first:first + len(device_blocks)].copy_(staged, non_blocking=True)
        return 1

    def _scatter(self, first: int, device_blocks: list[int]) -> int:
        """Copies host blocks `first...` into device blocks; returns the copies made."""
        if not self.gather_runs:
            for offset, block in enumerate(device_blocks):
                self.device_cache[:, :, :, block].copy_(self.blocks[first + offset])
            return len(device_blocks)
        ids = torch.tensor(device_blocks, device=self.device_cache.device)
        staged = self.blocks[first:first + len(device_blocks)].to(self.device_cache.device,
                                                                   non_blocking=True)
        self.device_cache.index_copy_(3, ids, staged.permute(1, 2, 3, 0, 4, 5))
        return 1

    def _on_stream(self, copy: Callable[[int, list[int]], int],
                   runs: list[tuple[int, list[int]]], num_blocks: int) -> None:
        if not runs:
            return
        if self.stream is None:
            self.num_copies += sum(copy(first, blocks) for first, blocks in runs)
        else:
            compute = torch.cuda.current_stream(self.device_cache.device)
            self.stream.wait_stream(compute)
            with torch.cuda.stream(self.stream):
                self.num_copies += sum(copy(first, blocks) for first, blocks in runs)
            compute.wait_stream(self.stream)
        self.num_blocks_copied += num_blocks

    def seconds_per_block(self, num_blocks: int = 16) -> float:
        """Times a run of blocks copied out and back in (median of three), per block and
        direction. The round trip leaves the device blocks as they were."""
        n = min(num_blocks, self.blocks.shape[0], self.device_cache.shape[3])
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
