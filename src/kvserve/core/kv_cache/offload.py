"""Prefix-cache blocks beyond the device pool: a host tier, then a disk tier.

A cached device block that the pool is about to reuse is copied to a host block first. When
the host tier is full, its least recently used block is spilled to a file in the disk tier
(when there is one), whose least recently used files are deleted beyond its size. A prefix
lookup that runs past the device's cached blocks goes on into the host tier, whose blocks
are loaded into fresh device blocks before the step's forward; and then into the disk tier,
whose blocks are first promoted into host blocks (read and checksummed by the runner) so
that the request can load them the step after. Host blocks a step's copies read or write
are pinned until the runner has made them, so no other copy of the step reuses them. All of
it is bookkeeping: the copies go to the runner as `KVTransfers`.
"""

from __future__ import annotations

from collections import OrderedDict

from kvserve.core.kv_cache.block_pool import BlockPool
from kvserve.core.kv_cache.hashing import BlockHash
from kvserve.core.scheduler.output import KVTransfers


class OffloadTiers:
    def __init__(self, num_host_blocks: int, host_offset: int, num_disk_blocks: int,
                 transfers: KVTransfers) -> None:
        self.host = BlockPool(num_host_blocks)
        self.host.on_evict = self._spill
        self.offset = host_offset  # where these blocks start in the runner's host tensor
        self.num_disk_blocks = num_disk_blocks
        self.disk: OrderedDict[BlockHash, None] = OrderedDict()  # oldest use first
        self.transfers = transfers
        self._pinned: list[int] = []  # host blocks this step's copies read or write
        self._promoting: dict[BlockHash, int] = {}  # block hash -> host block being filled
        self._from_disk: set[BlockHash] = set()  # promoted, not yet loaded: disk hits
        self.hits = {"host": 0, "disk": 0}  # blocks loaded from each tier

    def offload(self, device_block: int, block_hash: BlockHash) -> None:
        """Copies a cached device block about to be reused into the host tier, unless a tier
        holds it already or every host block is pinned this step."""
        if (self.host.lookup(block_hash) is not None or block_hash in self.disk
                or block_hash in self._promoting or not self.host.num_free_blocks):
            return
        (host_block,) = self.host.allocate(1)
        self.host.cache(host_block, block_hash)
        self._pinned.append(host_block)  # written this step: no spill of it before that
        self.transfers.to_host.append((device_block, self.offset + host_block))

    def _spill(self, host_block: int, block_hash: BlockHash) -> None:
        """A host block is being reused: its KV moves to the disk tier, if there is one."""
        if not self.num_disk_blocks or block_hash in self.disk:
            return
        self.transfers.spill.append((self.offset + host_block, block_hash))
        self.disk[block_hash] = None
        self._trim_disk()

    def _trim_disk(self) -> None:
        """Deletes the least recently used files beyond the disk tier's size."""
        while len(self.disk) > self.num_disk_blocks:
            self.transfers.delete.append(self.disk.popitem(last=False)[0])

    def host_block(self, block_hash: BlockHash) -> int | None:
        return self.host.lookup(block_hash)

    def on_disk(self, block_hash: BlockHash) -> bool:
        return block_hash in self.disk and block_hash not in self._promoting

    def pin(self, block_hash: BlockHash) -> int:
        """Holds a host-tier block for this step, so nothing reuses it before it is loaded."""
        host_block = self.host.lookup(block_hash)
        assert host_block is not None
        self.host.touch([host_block])
        self._pinned.append(host_block)
        tier = "disk" if block_hash in self._from_disk else "host"
        self._from_disk.discard(block_hash)
        self.hits[tier] += 1
        return host_block

    def load(self, host_block: int, device_block: int) -> None:
        """Copies a pinned host-tier block into a fresh device block before the forward."""
        self.transfers.to_device.append((self.offset + host_block, device_block))

    def promote(self, block_hashes: list[BlockHash]) -> None:
        """Reads disk-tier blocks into host blocks this step, as many as host blocks allow;
        they are found in the host tier from the next step on."""
        for block_hash in block_hashes:
            if not self.host.num_free_blocks:
                return
            (host_block,) = self.host.allocate(1)
            self._promoting[block_hash] = host_block
            self.disk.move_to_end(block_hash)
            self.transfers.promote.append((block_hash, self.offset + host_block))

    def end_step(self, failed: list[BlockHash]) -> None:
        """After the runner's copies: unpins host blocks, and files promoted blocks in the host
        tier, or deletes the files that could not be read (under tensor parallelism, the
        other ranks' parts of the block too)."""
        self.host.free(self._pinned)
        self._pinned = []
        for block_hash, host_block in self._promoting.items():
            if block_hash in failed:
                self.disk.pop(block_hash, None)
                self.transfers.delete.append(block_hash)
            else:
                self.host.cache(host_block, block_hash)
                self._from_disk.add(block_hash)
            self.host.free([host_block])
        self._promoting = {}

    def add_disk_blocks(self, block_hashes: list[BlockHash]) -> None:
        """Registers files found at start (oldest first), deleting beyond the size."""
        for block_hash in block_hashes:
            self.disk[block_hash] = None
        self._trim_disk()

    def reset(self) -> None:
        """Forgets every offloaded block: host blocks are dropped and files deleted."""
        self.host.reset_cache()
        self.transfers.delete.extend(self.disk)
        self.disk.clear()
        self._from_disk.clear()

    def check_integrity(self) -> None:
        assert not self._pinned and not self._promoting, "a step's copies were never ended"
        assert self.host.num_free_blocks == self.host.num_blocks, "a host block is still held"
        assert len(self.disk) <= self.num_disk_blocks
