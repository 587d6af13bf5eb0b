"""Which blocks each request holds: the scheduler's only view of the KV cache.

With prefix caching on, a request being admitted first looks up the longest run of its full
blocks already in the pool (`find_cached_prefix`) and holds those by reference instead of
computing them; after each step the blocks it completed are registered for others
(`cache_computed_blocks`). Only computed blocks are registered, so nobody can hit KV that a
failed or preempted step never wrote.

A request preempted by swap moves its computed blocks to a second pool of host blocks
(`swap_out`) and back into fresh device blocks when it resumes (`swap_in`); the scheduler
hands the (source, destination) pairs to the runner, which copies before the step's
forward. Host blocks a swap-in reads are released only once the runner has made the step's
copies, so that no swap-out of the same step can overwrite them first.
"""

from __future__ import annotations

from collections import Counter

from kvserve.core.kv_cache.block_pool import BlockPool
from kvserve.core.kv_cache.hashing import BlockHash, update_block_hashes
from kvserve.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks else None
        self.block_tables: dict[str, list[int]] = {}
        self.host_tables: dict[str, list[int]] = {}  # of requests swapped out
        self._host_releasing: list[int] = []  # read by this step's swap-ins
        self._num_cached: dict[str, int] = {}  # leading blocks of each table registered
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found computed in the pool
        self.peak_used_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    @property
    def num_used_host_blocks(self) -> int:
        pool = self.host_pool
        return 0 if pool is None else pool.num_blocks - pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(self, request: Request) -> list[BlockHash]:
        return update_block_hashes(request, self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The blocks of the longest cached run of the request's leading full blocks, short
        of its last token, which is always computed so that it has logits. None for a
        request that wants its prompt's logprobs: they need logits at every position."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        hashes = self.block_hashes(request)
        block_ids = []
        for block_hash in hashes[:(request.num_tokens - 1) // self.block_size]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[int] | None = None) -> bool:
        """Grows the request's block table to hold `num_computed_tokens + num_new_tokens`
        tokens, after the `cached_blocks` of a newly admitted request (which then count as
        computed). Returns False, changing nothing, when the pool lacks free blocks."""
        cached_blocks = cached_blocks or []
        table = self.block_tables.get(request.request_id, [])
        num_tokens = (request.num_computed_tokens + len(cached_blocks) * self.block_size
                      + num_new_tokens)
        needed = self.num_blocks_for(num_tokens) - len(table) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if needed + revived > self.pool.num_free_blocks:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            self._num_cached[request.request_id] = len(cached_blocks)
        table = self.block_tables.setdefault(request.request_id, table)
        table.extend(cached_blocks)
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return True

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Registers the request's full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request.request_id)
        if table is None:
            return
        hashes = self.block_hashes(request)
        start = self._num_cached.get(request.request_id, 0)
        end = min(request.num_computed_tokens // self.block_size, len(hashes))
        for index in range(start, end):
            self.pool.cache(table[index], hashes[index])
        self._num_cached[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Returns all of the request's blocks to the pool, last block first, so that a
        shared head outlives the private tail in the eviction order; and its swapped-out
        host blocks, if any."""
        table = self.block_tables.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.pool.free(table[::-1])
        if self.host_pool is not None:
            self.host_pool.free(self.host_tables.pop(request.request_id, []))

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.host_tables

    def can_swap_out(self, request: Request) -> bool:
        needed = self.num_blocks_for(request.num_computed_tokens)
        return (self.host_pool is not None and needed > 0
                and needed <= self.host_pool.num_free_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Moves the blocks holding the request's computed tokens to host blocks and frees
        its device blocks; returns the (device, host) copies to make before the next forward.
        Call only when `can_swap_out`."""
        assert self.host_pool is not None
        table = self.block_tables[request.request_id]
        device = table[:self.num_blocks_for(request.num_computed_tokens)]
        host = self.host_pool.allocate(len(device))
        self.host_tables[request.request_id] = host
        self.block_tables.pop(request.request_id)
        self._num_cached.pop(request.request_id, None)
        self.pool.free(table[::-1])
        return list(zip(device, host, strict=True))

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Gives a swapped-out request device blocks for its computed tokens plus
        `num_new_tokens`; returns the (host, device) copies to make before the next forward,
        or None, changing nothing, when the pool lacks free blocks."""
        if not self.allocate_slots(request, num_new_tokens):
            return None
        host = self.host_tables.pop(request.request_id)
        self._host_releasing.extend(host)
        return list(zip(host, self.block_tables[request.request_id], strict=False))

    def release_swapped_in(self) -> None:
        """Frees the host blocks of this step's swap-ins, which the runner has copied (or,
        on CUDA, queued on the stream that makes every later swap copy)."""
        if self._host_releasing:
            assert self.host_pool is not None
            self.host_pool.free(self._host_releasing)
            self._host_releasing = []

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def check_integrity(self) -> None:
        """Asserts that every block is either free or referenced exactly as often as block
        tables hold it, that no table holds a block twice, and that the hash index and the
        per-block hashes agree."""
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
        for block_hash, block_id in self.pool.cached.items():
            assert self.pool.block_hashes[block_id] == block_hash, f"block {block_id} hash"
        assert sum(h is not None for h in self.pool.block_hashes) == len(self.pool.cached)
        if self.host_pool is not None:
            host = [b for t in self.host_tables.values() for b in t] + self._host_releasing
            assert len(set(host)) == len(host), f"a host block is held twice: {host}"
            assert self.host_pool.num_free_blocks + len(host) == self.host_pool.num_blocks, (
                f"{self.host_pool.num_blocks - self.host_pool.num_free_blocks} host blocks "
                f"in use, {len(host)} held")
