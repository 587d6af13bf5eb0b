"""A fixed pool of KV blocks: reference counts and an O(1) free list."""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Owns block ids 0..num_blocks-1 and how many holders reference each.

    Free blocks are kept in an insertion-ordered dict, which gives O(1) take-from-front,
    return-to-back and removal from the middle (the last one is what prefix caching needs to
    revive a cached free block).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Takes `count` blocks from the front of the free list, each with one reference."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with {len(self._free)} free")
        block_ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drops one reference from each block; blocks that reach zero go to the free list's
        back in the given order."""
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None

    def free_block_ids(self) -> list[int]:
        return list(self._free)
