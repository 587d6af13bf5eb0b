"""Which blocks each request holds: the scheduler's only view of the KV cache."""

from __future__ import annotations

from collections import Counter

from kvserve.core.kv_cache.block_pool import BlockPool
from kvserve.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grows the request's block table to hold `num_computed_tokens + num_new_tokens`
        tokens. Returns False, changing nothing, when the pool lacks free blocks."""
        table = self.block_tables.setdefault(request.request_id, [])
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request.request_id]
            return False
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        """Returns all of the request's blocks to the pool, last block first."""
        table = self.block_tables.pop(request.request_id, [])
        self.pool.free(table[::-1])

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def check_integrity(self) -> None:
        """Asserts that every block is either free or referenced exactly as often as block
        tables hold it, and that no table holds a block twice."""
        held = Counter(b for table in self.block_tables.values() for b in table)
        for table in self.block_tables.values():
            assert len(set(table)) == len(table), f"block table holds a block twice: {table}"
        free = set(self.pool.free_block_ids())
        assert len(free) == self.pool.num_free_blocks
        for block_id in range(self.pool.num_blocks):
            refs = self.pool.ref_counts[block_id]
            assert refs == held.get(block_id, 0), (
                f"block {block_id}: {refs} references, held by {held.get(block_id, 0)} tables")
            assert (refs == 0) == (block_id in free), f"block {block_id} free list mismatch"
