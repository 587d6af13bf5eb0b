"""Who is served first: the order of the waiting queue, of running prefill chunks, and of
preemption victims.

- `fcfs`: arrival order. Preemption takes the newest running request.
- `priority`: the lowest `priority` value first (vLLM's convention), arrival order within a
  level. A waiting request that outranks a running one preempts it when it cannot otherwise
  start this step, so a burst of urgent requests never queues behind bulk work. A request
  that arrived `starvation_seconds` ago goes ahead of every priority and is no longer
  preempted for one, which bounds how long anyone waits.
- `fair`: tenants (a request's `tenant`: the API's `user` field) share the token budget by
  a virtual token counter (Sheng et al., "Fairness in Serving Large Language Models"): each
  tenant's counter grows by every token scheduled for it, and the tenant with the smallest
  counter goes first. A tenant that returns after being idle starts at the smallest counter
  of those with work, so idling earns no credit. A waiting request preempts a running one
  whose tenant has been served more than a step's budget beyond its own. Only the
  `MAX_IDLE_TENANTS` most recently idle tenants' counters are kept, so a server whose
  clients send a fresh `user` per end user does not grow without bound; a tenant forgotten
  that way comes back as a new one would.

Requests wait in first-in-first-out lanes, one per priority level or tenant; a preempted
request goes back to the front of its lane.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator

from kvserve.request import Request

DEFAULT_STARVATION_SECONDS = 60.0
MAX_IDLE_TENANTS = 10_000


class SchedulingPolicy:
    """First come, first served: one lane, no ranks, the newest running request yields."""

    name = "fcfs"
    preempts_for_waiting = False
    ranks = False  # whether `rank` ever tells requests apart (sorting by it is then needed)

    def lane(self, request: Request) -> Hashable:
        return None

    def rank(self, request: Request, now: float) -> tuple:
        """Lower goes first; equal ranks keep arrival (or admission) order."""
        return ()

    def outranks(self, waiting: Request, running: Request, now: float) -> bool:
        """Whether `waiting` may preempt `running` (or take its prefill budget) to start."""
        return False

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        pass

    def on_added(self, request: Request) -> None:
        pass

    def on_finished(self, request: Request) -> None:
        pass


class PriorityPolicy(SchedulingPolicy):
    name = "priority"
    ranks = True
    preempts_for_waiting = True

    def __init__(self, starvation_seconds: float = DEFAULT_STARVATION_SECONDS) -> None:
        self.starvation_seconds = starvation_seconds

    def lane(self, request: Request) -> Hashable:
        return request.priority

    def starved(self, request: Request, now: float) -> bool:
        return now - request.arrival_time >= self.starvation_seconds

    def rank(self, request: Request, now: float) -> tuple:
        if self.starved(request, now):
            return (0, request.arrival_time)
        return (1, request.priority, request.arrival_time)

    def outranks(self, waiting: Request, running: Request, now: float) -> bool:
        return waiting.priority < running.priority and not self.starved(running, now)


class FairPolicy(SchedulingPolicy):
    name = "fair"
    ranks = True
    preempts_for_waiting = True

    def __init__(self, budget: int) -> None:
        self.margin = budget  # service a tenant must be behind by to preempt another's
        self.service: dict[str, int] = {}  # of the tenants with work and the idle ones kept
        self.num_requests: dict[str, int] = {}  # waiting or running, of the tenants with work
        self.idle: dict[str, None] = {}  # tenants without work, the longest idle first

    def lane(self, request: Request) -> Hashable:
        return request.tenant_key

    def rank(self, request: Request, now: float) -> tuple:
        return (self.service[request.tenant_key], request.arrival_time)

    def outranks(self, waiting: Request, running: Request, now: float) -> bool:
        return (self.service[waiting.tenant_key] + self.margin
                < self.service[running.tenant_key])

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        self.service[request.tenant_key] += num_tokens

    def on_added(self, request: Request) -> None:
        tenant = request.tenant_key
        if tenant in self.num_requests:
            self.num_requests[tenant] += 1
            return
        self.idle.pop(tenant, None)
        own = self.service.get(tenant, 0)
        active = [self.service[t] for t in self.num_requests]
        self.service[tenant] = max(own, min(active)) if active else own
        self.num_requests[tenant] = 1

    def on_finished(self, request: Request) -> None:
        tenant = request.tenant_key
        self.num_requests[tenant] -= 1
        if self.num_requests[tenant]:
            return
        del self.num_requests[tenant]
        self.idle[tenant] = None
        if len(self.idle) > MAX_IDLE_TENANTS:
            forgotten = next(iter(self.idle))
            del self.idle[forgotten], self.service[forgotten]


def make_policy(name: str, budget: int) -> SchedulingPolicy:
    if name == "priority":
        return PriorityPolicy()
    if name == "fair":
        return FairPolicy(budget)
    return SchedulingPolicy()


class WaitingQueue:
    """Waiting requests in FIFO lanes; `peek` is the head of the lane whose head ranks
    first."""

    def __init__(self, policy: SchedulingPolicy, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.policy = policy
        self.clock = clock
        self.lanes: dict[Hashable, deque[Request]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for lane in self.lanes.values():
            yield from lane

    def append(self, request: Request) -> None:
        self.lanes.setdefault(self.policy.lane(request), deque()).append(request)
        self._len += 1

    def appendleft(self, request: Request) -> None:
        self.lanes.setdefault(self.policy.lane(request), deque()).appendleft(request)
        self._len += 1

    def peek(self) -> Request:
        if len(self.lanes) == 1:
            return next(iter(self.lanes.values()))[0]
        now = self.clock()
        return min((lane[0] for lane in self.lanes.values()),
                   key=lambda r: self.policy.rank(r, now))

    def remove(self, request: Request) -> None:
        key = self.policy.lane(request)
        lane = self.lanes[key]
        lane.remove(request)
        self._len -= 1
        if not lane:
            del self.lanes[key]
