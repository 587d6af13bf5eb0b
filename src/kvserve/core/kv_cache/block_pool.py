"""A fixed pool of KV blocks: reference counts, an O(1) free list, and the prefix cache.

A full block whose KV has been computed can be registered under its content hash. When its
last holder frees it, it keeps that hash and stays findable until the pool reuses it: the
free list is the eviction order, oldest release first (LRU), and blocks without a hash go to
its front because nothing can ever hit them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvserve.core.kv_cache.hashing import BlockHash


class BlockPool:
    """Owns block ids 0..num_blocks-1, how many holders reference each, and which computed
    blocks are known by their hash."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Told of each cached block that allocation is about to reuse, while its KV is intact.
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached or not: all of them can be allocated."""
        return len(self._free)

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """Takes `count` blocks, each with one reference, evicting whatever they cached: first
        the blocks right after block `after` while they are free and cache nothing (so a
        growing request's blocks stay consecutive), then from the front of the free list,
        in ascending order. Consecutive blocks make a swap or a transfer a few large copies
        instead of one per block."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with {len(self._free)} free")
        block_ids = []
        if after is not None:
            block_id = after + 1
            while (len(block_ids) < count and block_id in self._free
                   and self.block_hashes[block_id] is None):
                del self._free[block_id]
                block_ids.append(block_id)
                block_id += 1
        taken = []
        for _ in range(count - len(block_ids)):
            block_id, _ = self._free.popitem(last=False)
            block_hash = self.block_hashes[block_id]
            if block_hash is not None and self.on_evict is not None:
                self.on_evict(block_id, block_hash)
            self._evict(block_id)
            taken.append(block_id)
        block_ids += sorted(taken)
        for block_id in block_ids:
            self.ref_counts[block_id] = 1
        return block_ids

    def touch(self, block_ids: list[int]) -> None:
        """Adds a holder to each (cached) block, taking free ones off the free list."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drops one reference from each block. Blocks that reach zero join the free list in
        the given order: cached ones at the back (evicted last), the rest at the front."""
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self.block_hashes[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Registers a computed full block under its hash; a hash already cached keeps its
        first block, and this one stays private."""
        if block_hash not in self.cached and self.block_hashes[block_id] is None:
            self.cached[block_hash] = block_id
            self.block_hashes[block_id] = block_hash

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def reset_cache(self) -> None:
        """Forgets every cached block; blocks in use stay with their holders."""
        for block_id in list(self.cached.values()):
            self._evict(block_id)

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hashes[block_id] = None

    def free_block_ids(self) -> list[int]:
        return list(self._free)
