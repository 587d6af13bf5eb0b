"""Which replica serves a request: `round-robin`, `least-loaded` or `prefix-aware`.

`prefix-aware` follows SGLang's cache-aware router. It keeps, per replica, an approximate
view of the KV blocks cached there: the hashes of the blocks of the prompts it sent there,
least recently routed dropped first once a replica's view reaches the blocks its pool
holds. The view changes only with the router's own decisions, so no replica is asked
anything per request. A request goes to the replica whose view holds the longest run of its
leading blocks when that run covers at least `min_match` of them; otherwise, and whenever
the load is out of balance (the busiest replica has more than `balance_margin` requests
over the idlest), it goes to the least loaded replica.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from kvserve.core.kv_cache.hashing import BlockHash

ROUTERS = ("round-robin", "least-loaded", "prefix-aware")


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What the router knows of a replica's load: its running and waiting requests."""

    num_running: int = 0
    num_waiting: int = 0

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting


def least_loaded(loads: list[ReplicaLoad], among: list[int] | None = None) -> int:
    """The replica with the fewest requests (the lowest index among equals)."""
    candidates = range(len(loads)) if among is None else among
    return min(candidates, key=lambda i: loads[i].num_requests)


class Router:
    """Round-robin: each request to the next replica in turn."""

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self._turns = itertools.cycle(range(num_replicas))

    def route(self, block_hashes: list[BlockHash], loads: list[ReplicaLoad]) -> int:
        """The replica for a request whose prompt has these full-block hashes."""
        return next(self._turns)


class LeastLoadedRouter(Router):
    def route(self, block_hashes: list[BlockHash], loads: list[ReplicaLoad]) -> int:
        return least_loaded(loads)


class PrefixAwareRouter(Router):
    def __init__(self, num_replicas: int, blocks_per_replica: int, min_match: float = 0.5,
                 balance_margin: int = 32) -> None:
        super().__init__(num_replicas)
        if not 0.0 <= min_match <= 1.0:
            raise ValueError(f"min_match must be in [0, 1], got {min_match}")
        self.blocks_per_replica = blocks_per_replica
        self.min_match = min_match
        self.balance_margin = balance_margin
        self.views: list[OrderedDict[BlockHash, None]] = [OrderedDict()
                                                          for _ in range(num_replicas)]

    def route(self, block_hashes: list[BlockHash], loads: list[ReplicaLoad]) -> int:
        counts = [load.num_requests for load in loads]
        if max(counts) - min(counts) > self.balance_margin or not block_hashes:
            replica = least_loaded(loads)
        else:
            matches = [self._matched(view, block_hashes) for view in self.views]
            best = max(matches)
            if best and best >= self.min_match * len(block_hashes):
                replica = least_loaded(loads, [i for i, m in enumerate(matches) if m == best])
            else:
                replica = least_loaded(loads)
        self._remember(replica, block_hashes)
        return replica

    @staticmethod
    def _matched(view: OrderedDict[BlockHash, None], block_hashes: list[BlockHash]) -> int:
        """How many of the leading blocks the view holds (a hash names its whole prefix)."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in view:
                break
            count += 1
        return count

    def _remember(self, replica: int, block_hashes: list[BlockHash]) -> None:
        view = self.views[replica]
        for block_hash in block_hashes:
            view[block_hash] = None
            view.move_to_end(block_hash)
        while len(view) > self.blocks_per_replica:
            view.popitem(last=False)


def make_router(name: str, num_replicas: int, blocks_per_replica: int) -> Router:
    if name == "prefix-aware":
        return PrefixAwareRouter(num_replicas, blocks_per_replica)
    if name == "least-loaded":
        return LeastLoadedRouter(num_replicas)
    if name == "round-robin":
        return Router(num_replicas)
    raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
