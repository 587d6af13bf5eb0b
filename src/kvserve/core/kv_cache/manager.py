"""Which blocks each request holds: the scheduler's only view of the KV cache.

With prefix caching on, a request being admitted first looks up the longest run of its full
blocks already computed (`find_cached_prefix`): in the device pool, where it holds them by
reference, or in the host tier of offloaded blocks (offload.py), which are loaded into fresh
blocks; blocks only the disk tier holds are promoted to the host tier first, and the request
waits a step for them. After each step the blocks a request completed are registered for
others (`cache_computed_blocks`). Only computed blocks are registered, so nobody can hit KV
that a failed or preempted step never wrote.

A request preempted by swap moves its computed blocks to a pool of host blocks (`swap_out`)
and back into fresh device blocks when it resumes (`swap_in`). Every copy a step needs is
collected in `KVTransfers` for the runner, which makes them before the step's forward; host
blocks read in a step are released only after it (`end_step`), so that no copy of the same
step can overwrite them first.

A blended prompt (CacheBlend) reuses the KV of its chunks computed on their own, kept in the
same pool under `chunk_block_hashes` and offloaded like any cached block. While it is blended
the request holds its chunks' blocks (`hold_segments`), so that none is evicted between
computing a missing chunk and copying it in, and lets go after (`release_segments`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvserve.core.kv_cache.block_pool import BlockPool
from kvserve.core.kv_cache.hashing import (
    BlockHash,
    chunk_block_hashes,
    salt_keys,
    update_block_hashes,
)
from kvserve.core.kv_cache.offload import OffloadTiers
from kvserve.core.scheduler.output import ChunkCopy, KVTransfers
from kvserve.request import Request


@dataclass
class CachedPrefix:
    """A request's leading full blocks already computed somewhere."""

    blocks: list[int | None] = field(default_factory=list)  # device block, or None: host tier
    hashes: list[BlockHash] = field(default_factory=list)  # of those blocks
    on_disk: list[BlockHash] = field(default_factory=list)  # the next ones, in the disk tier

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass
class SegmentKV:
    """A reused chunk of a blended prompt: its tokens `start .. start + num_tokens - 1`, and
    their KV computed on its own from position 0 in blocks of its own (the last maybe
    partial)."""

    start: int
    num_tokens: int
    hashes: list[BlockHash]
    blocks: list[int] = field(default_factory=list)  # device blocks, once held
    computed: bool = False  # its KV is in the pool or a tier (else computed when held)
    num_filled: int = 0  # of a chunk being computed, the tokens done


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, num_offload_blocks: int = 0,
                 num_disk_blocks: int = 0, sink_blocks: int = 0, window_blocks: int = 0
                 ) -> None:
        """`num_host_blocks` of swap space, then `num_offload_blocks` of host tier for
        evicted prefix blocks (host block ids after the swap space's) and a disk tier of
        `num_disk_blocks`. With `window_blocks`, every request keeps its first `sink_blocks`
        and its newest `window_blocks` (StreamingLLM)."""
        self.block_size = block_size
        self.sink_blocks = sink_blocks
        self.window_blocks = window_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks else None
        self.transfers = KVTransfers()
        self.tiers = None
        if num_offload_blocks and enable_prefix_caching:
            self.tiers = OffloadTiers(num_offload_blocks, num_host_blocks, num_disk_blocks,
                                      self.transfers)
            self.pool.on_evict = self.tiers.offload
        self.block_tables: dict[str, list[int]] = {}
        self.host_tables: dict[str, list[int]] = {}  # of requests swapped out
        self._host_releasing: list[int] = []  # read by this step's swap-ins
        self._incoming: set[int] = set()  # host blocks of KV sent ahead of a migrating request
        self._num_cached: dict[str, int] = {}  # leading blocks of each table registered
        self.segment_holds: dict[str, list[int]] = {}  # blended request id -> chunk blocks
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found computed (in any tier)
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

    def tier_hits(self, tier: str) -> int:
        """Prompt tokens whose KV was loaded from the host or the disk tier."""
        return self.tiers.hits[tier] * self.block_size if self.tiers is not None else 0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(self, request: Request) -> list[BlockHash]:
        return update_block_hashes(request, self.block_size)

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest run of the request's leading full blocks that the device pool or the
        host tier holds, short of its last token, which is always computed so that it has
        logits; and the blocks after it that only the disk tier holds. Nothing for a request
        that wants its prompt's logprobs: they need logits at every position."""
        prefix = CachedPrefix()
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return prefix
        hashes = self.block_hashes(request)[:(request.num_tokens - 1) // self.block_size]
        tiers = self.tiers
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None and (tiers is None or tiers.host_block(block_hash) is None):
                break
            prefix.blocks.append(block_id)
            prefix.hashes.append(block_hash)
        if tiers is not None:
            for block_hash in hashes[len(prefix):]:
                if not tiers.on_disk(block_hash):
                    break
                prefix.on_disk.append(block_hash)
        return prefix

    def promote(self, block_hashes: list[BlockHash]) -> None:
        """Brings disk-tier blocks into the host tier during this step."""
        assert self.tiers is not None
        self.tiers.promote(block_hashes)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix: CachedPrefix | None = None) -> bool:
        """Grows the request's block table to hold `num_computed_tokens + num_new_tokens`
        tokens, after the `prefix` blocks of a newly admitted request (which then count as
        computed; those in the host tier are loaded into fresh blocks). Returns False,
        changing nothing, when the pool lacks free blocks."""
        if prefix is None or not prefix.blocks:
            return self._grow(request, num_new_tokens)
        cached = prefix.blocks
        held = [b for b in cached if b is not None]
        table = self.block_tables.get(request.request_id, [])
        num_tokens = (request.num_cached_tokens + len(cached) * self.block_size
                      + num_new_tokens)
        needed = self.num_blocks_for(num_tokens) - len(table) - len(held)
        revived = sum(1 for b in held if self.pool.ref_counts[b] == 0)
        if needed + revived > self.pool.num_free_blocks:
            return False
        table = self.block_tables.setdefault(request.request_id, table)
        self.pool.touch(held)
        self._num_cached[request.request_id] = (cached.index(None) if None in cached
                                                else len(cached))
        tiers = self.tiers
        pinned = [tiers.pin(h) for b, h in zip(cached, prefix.hashes, strict=True)
                  if b is None] if tiers is not None else []
        fresh = self.pool.allocate(needed, after=held[-1] if held else None)
        for block_id in cached:
            table.append(block_id if block_id is not None else fresh.pop(0))
        for host_block, index in zip(pinned, [i for i, b in enumerate(cached) if b is None],
                                     strict=True):
            tiers.load(host_block, table[index])
        table.extend(fresh)
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return True

    def _grow(self, request: Request, num_new_tokens: int) -> bool:
        """`allocate_slots` without a cached prefix: the call every running request makes
        every step, which most steps of a decode answer from the block it already has."""
        table = self.block_tables.get(request.request_id)
        num_tokens = request.num_cached_tokens + num_new_tokens
        needed = self.num_blocks_for(num_tokens) - (len(table) if table else 0)
        if needed > self.pool.num_free_blocks:
            return False
        if table is None:
            table = self.block_tables[request.request_id] = []
        if needed <= 0:
            return True
        table.extend(self.pool.allocate(needed, after=table[-1] if table else None))
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
        start = self._num_cached.get(request.request_id, 0)
        if table is None or request.num_computed_tokens // self.block_size <= start:
            return  # most steps of a decode fill no block
        hashes = self.block_hashes(request)
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
        self.release_segments(request)
        if self.host_pool is not None:
            self.host_pool.free(self.host_tables.pop(request.request_id, []))

    def find_segments(self, request: Request) -> list[SegmentKV]:
        """The reused chunks of a blended prompt (every segment but the last), each marked
        computed when the pool or the host tier holds all its blocks."""
        keys = salt_keys(request.cache_salt)
        segments, start = [], 0
        for length in request.segment_lens[:-1]:
            tokens = request.prompt_token_ids[start:start + length]
            hashes = chunk_block_hashes(tokens, self.block_size, keys)
            computed = all(self.pool.lookup(h) is not None
                           or (self.tiers is not None and self.tiers.host_block(h) is not None)
                           for h in hashes)
            segments.append(SegmentKV(start, length, hashes, computed=computed))
            start += length
        return segments

    def hold_segments(self, request: Request, segments: list[SegmentKV]) -> bool:
        """Holds the blocks of the computed chunks (loading those in the host tier into fresh
        blocks) and fresh blocks for the others, to compute; False, changing nothing, when
        the pool lacks free blocks."""
        wanted = [h for s in segments if s.computed for h in s.hashes]
        found = [self.pool.lookup(h) for h in wanted]
        held = [b for b in found if b is not None]
        revived = sum(1 for b in set(held) if self.pool.ref_counts[b] == 0)
        needed = (len(found) - len(held)
                  + sum(len(s.hashes) for s in segments if not s.computed))
        if needed + revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(held)
        # Pinned before allocating: the evictions it makes go to the host tier, which must
        # not reuse these blocks for them.
        tiers = self.tiers
        pinned = {h: tiers.pin(h) for h, b in zip(wanted, found, strict=True)
                  if b is None} if tiers is not None else {}
        fresh = self.pool.allocate(needed)
        found_blocks = iter(found)
        for segment in segments:
            if not segment.computed:
                segment.blocks = [fresh.pop() for _ in segment.hashes]
                continue
            for block_hash in segment.hashes:
                block_id = next(found_blocks)
                if block_id is None:  # loaded before the forward: cached in the pool again
                    assert tiers is not None
                    block_id = fresh.pop()
                    tiers.load(pinned[block_hash], block_id)
                    self.pool.cache(block_id, block_hash)
                segment.blocks.append(block_id)
        self.segment_holds[request.request_id] = [b for s in segments for b in s.blocks]
        return True

    def cache_segments(self, segments: list[SegmentKV]) -> None:
        """Registers chunks just computed into their held blocks."""
        for segment in segments:
            for block_id, block_hash in zip(segment.blocks, segment.hashes, strict=True):
                self.pool.cache(block_id, block_hash)
            segment.computed = True

    def copy_segments(self, request: Request, segments: list[SegmentKV]) -> None:
        """Has the runner copy each held chunk's KV to its place in the request's blocks."""
        table = self.block_tables[request.request_id]
        self.transfers.chunks.extend(
            ChunkCopy(s.blocks, table, s.start, s.num_tokens) for s in segments)

    def release_segments(self, request: Request) -> None:
        """Lets go of a blended request's chunk blocks (they stay cached)."""
        self.pool.free(self.segment_holds.pop(request.request_id, [])[::-1])

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.host_tables

    def can_swap_out(self, request: Request) -> bool:
        needed = self.num_blocks_for(request.num_cached_tokens)
        return (self.host_pool is not None and needed > 0
                and needed <= self.host_pool.num_free_blocks)

    def swap_out(self, request: Request) -> None:
        """Moves the blocks holding the request's computed tokens to host blocks and frees
        its device blocks. Call only when `can_swap_out`."""
        assert self.host_pool is not None
        table = self.block_tables.pop(request.request_id)
        device = table[:self.num_blocks_for(request.num_cached_tokens)]
        host = self.host_pool.allocate(len(device))
        self.host_tables[request.request_id] = host
        self._num_cached.pop(request.request_id, None)
        self.transfers.to_host.extend(zip(device, host, strict=True))
        self.pool.free(table[::-1])

    def computed_block_ids(self, request: Request) -> list[int]:
        """The device blocks holding the request's computed tokens, the last maybe partial."""
        table = self.block_tables.get(request.request_id, [])
        return table[:self.num_blocks_for(request.num_cached_tokens)]

    def allocate_host_blocks(self, count: int) -> list[int] | None:
        """Swap-space blocks for KV arriving from another engine; None when too few are free."""
        pool = self.host_pool
        if pool is None or count > pool.num_free_blocks:
            return None
        host_blocks = pool.allocate(count)
        self._incoming.update(host_blocks)
        return host_blocks

    def free_host_blocks(self, host_blocks: list[int]) -> None:
        """Returns blocks of `allocate_host_blocks` whose request did not come after all."""
        if host_blocks:
            assert self.host_pool is not None
            self._incoming.difference_update(host_blocks)
            self.host_pool.free(host_blocks)

    def adopt_swapped(self, request: Request, host_blocks: list[int]) -> None:
        """Makes a request whose computed KV fills `host_blocks` (of `allocate_host_blocks`)
        swapped out here."""
        assert len(host_blocks) == self.num_blocks_for(request.num_cached_tokens)
        self._incoming.difference_update(host_blocks)
        self.host_tables[request.request_id] = host_blocks

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Gives a swapped-out request device blocks for its computed tokens plus
        `num_new_tokens` and copies its KV back in; False, changing nothing, when the pool
        lacks free blocks."""
        if not self.allocate_slots(request, num_new_tokens):
            return False
        host = self.host_tables.pop(request.request_id)
        self._host_releasing.extend(host)
        self.transfers.to_device.extend(zip(host, self.block_tables[request.request_id],
                                            strict=False))
        return True

    @property
    def window_chunk(self) -> int:
        """The most tokens a streaming request's chunk may add: its window less the block
        that the chunk's first tokens may share with the cached ones (0 without a window)."""
        return max(self.window_blocks - 1, 0) * self.block_size

    def window_room(self, request: Request) -> int:
        """Tokens a streaming request can add without sliding its window (no limit for
        others)."""
        if not self.window_blocks:
            return request.num_tokens
        return (self.sink_blocks + self.window_blocks) * self.block_size - request.num_cached_tokens

    def slide_window(self, request: Request, num_new_tokens: int) -> int:
        """Makes room in a streaming request's window for its next chunk, which it returns
        capped to what the window holds: drops the oldest window blocks the chunk would
        push past `window_blocks` and moves the keys of the rest back by the tokens dropped,
        so that the cache's positions stay contiguous after the sinks."""
        if not self.window_blocks:
            return num_new_tokens
        size = self.block_size
        num_new_tokens = min(num_new_tokens, self.window_chunk)
        cached = request.num_cached_tokens
        excess = (self.num_blocks_for(cached + num_new_tokens)
                  - self.sink_blocks - self.window_blocks)
        if excess > 0:
            table = self.block_tables[request.request_id]
            first = self.sink_blocks
            self.pool.free(table[first:first + excess])
            del table[first:first + excess]
            request.num_evicted_tokens += excess * size
            kept = table[first:self.num_blocks_for(cached - excess * size)]
            if kept:
                self.transfers.shift.append((kept, excess * size))
        return num_new_tokens

    def take_transfers(self) -> KVTransfers:
        """The copies this step needs, leaving an empty list for the next."""
        transfers, self.transfers = self.transfers, KVTransfers()
        if self.tiers is not None:
            self.tiers.transfers = self.transfers
        return transfers

    def end_step(self, failed_promotions: list[BlockHash]) -> None:
        """After the runner made the step's copies: releases the host blocks they read."""
        if self._host_releasing:
            assert self.host_pool is not None
            self.host_pool.free(self._host_releasing)
            self._host_releasing = []
        if self.tiers is not None:
            self.tiers.end_step(failed_promotions)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block, offloaded ones included; blocks in use stay."""
        self.pool.reset_cache()
        if self.tiers is not None:
            self.tiers.reset()

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def check_drained(self) -> None:
        """With no request left, every device block is free (cached ones too) and host
        blocks are held only by KV sent ahead of a migration or read by this step's
        swap-ins. The engine checks this whenever it drains: unlike `check_integrity`,
        which audits every block, it costs nothing that grows with the pool."""
        assert not self.block_tables and not self.segment_holds, (
            f"finished requests hold blocks: {[*self.block_tables, *self.segment_holds]}")
        leaked = self.pool.num_blocks - self.pool.num_free_blocks
        assert not leaked, f"{leaked} blocks are referenced with no request left"
        if self.host_pool is not None:
            assert not self.host_tables, f"swapped requests left: {list(self.host_tables)}"
            held = len(self._host_releasing) + len(self._incoming)
            assert self.host_pool.num_free_blocks + held == self.host_pool.num_blocks, (
                f"{self.host_pool.num_blocks - self.host_pool.num_free_blocks} host blocks "
                f"in use, {held} held")
        if self.tiers is not None:
            self.tiers.check_integrity()

    def check_integrity(self) -> None:
        """Asserts that every block is either free or referenced exactly as often as block
        tables hold it, that no table holds a block twice, that the hash index and the
        per-block hashes agree, and that the host tiers hold exactly what is accounted for."""
        held = Counter(b for tables in (self.block_tables, self.segment_holds)
                       for table in tables.values() for b in table)
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
            host = ([b for t in self.host_tables.values() for b in t] + self._host_releasing
                    + list(self._incoming))
            assert len(set(host)) == len(host), f"a host block is held twice: {host}"
            assert self.host_pool.num_free_blocks + len(host) == self.host_pool.num_blocks, (
                f"{self.host_pool.num_blocks - self.host_pool.num_free_blocks} host blocks "
                f"in use, {len(host)} held")
        if self.tiers is not None:
            self.tiers.check_integrity()
