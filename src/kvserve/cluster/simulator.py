"""A cluster in simulated time, in the manner of Vidur: the real `Scheduler`, `KVCacheManager`
and router decide everything; only the model's forward pass is replaced, by a step-cost
model fitted from `kvserve bench step` JSON (any device's) or from the steps a serving engine
traced. A step that would run on a replica advances that replica's clock by the cost of the
step's work instead.

The simulated front end does what `ClusterLLM` does: routes each request among the entry
replicas, moves prefilled requests from prefill to decode replicas (disaggregated), and
balances decode replicas by migration, where a move costs its KV's bytes over the link
between replicas. Requests never stop early: every one generates its `max_tokens`.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from kvserve.cluster.router import ReplicaLoad, make_router
from kvserve.config import EngineConfig
from kvserve.core.kv_cache.hashing import prompt_block_hashes
from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.scheduler.output import ModelRunnerOutput, SchedulerOutput, StepShape
from kvserve.core.scheduler.scheduler import Scheduler
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

# The token every simulated step samples: any id does, since no request stops early.
_SAMPLED = 1


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per step: `fixed` + `per_decode` x decodes + `per_prefill_token` x prefill
    tokens + `per_context_token` x the KV tokens the decodes read; a step with prefill tokens
    takes at least `prefill_step_floor` (on CUDA such a step runs eagerly, where a
    decode-only one replays a CUDA graph: the host's launches bound it until the device's
    work outlasts them)."""

    fixed: float
    per_decode: float
    per_prefill_token: float
    per_context_token: float = 0.0
    prefill_step_floor: float = 0.0
    source: str = ""

    @classmethod
    def fit(cls, runs: list[dict]) -> StepCostModel:
        """From `kvserve bench step --json` files. The decode-only steps give the fixed,
        per-decode and (with runs at two contexts or more) per-context-token costs by least
        squares. The largest prefill (the file's prefill from an empty cache, else its
        largest chunk) gives the cost per prefill token beyond them. Steps with a chunk
        that take over 1.5x that linear cost are bound by something else, the eager
        launches on CUDA: their median is the floor of a step with prefill tokens."""
        contexts = {run["context"] for run in runs}
        features, seconds = [], []
        prefills: list[tuple[StepShape, float]] = []
        for run in runs:
            for row in run["rows"]:
                decodes, chunk = row["decodes"], row["chunk"]
                if chunk == 0:
                    features.append([1.0, decodes, decodes * run["context"]])
                    seconds.append(row["step ms"] / 1e3)
                else:
                    prefills.append((StepShape(decodes, chunk, decodes * run["context"]),
                                     row["step ms"] / 1e3))
            if "prefill" in run:
                prefill = run["prefill"]
                prefills.append((StepShape(0, prefill["prefill tokens"], 0),
                                 prefill["step ms"] / 1e3))
        x = np.array(features)
        if len(contexts) < 2:
            x = x[:, :2]
        coef, *_ = np.linalg.lstsq(x, np.array(seconds), rcond=None)
        fixed, per_decode, per_context = [max(float(c), 0.0) for c in coef] + [0.0] * (
            3 - len(coef))
        devices = sorted({str(run.get("device", "?")) for run in runs})
        decode_only = cls(fixed, per_decode, 0.0, per_context,
                          source=f"{', '.join(devices)} (contexts {sorted(contexts)})")
        shape, largest = max(prefills, key=lambda p: p[0].num_prefill_tokens)
        per_token = (largest - decode_only.seconds(replace(shape, num_prefill_tokens=0))
                     ) / shape.num_prefill_tokens
        linear = replace(decode_only, per_prefill_token=max(per_token, 0.0))
        bound = [s for shape, s in prefills if s > 1.5 * linear.seconds(shape)]
        return replace(linear, prefill_step_floor=statistics.median(bound) if bound else 0.0)

    @classmethod
    def load(cls, paths: list[str]) -> StepCostModel:
        """From `kvserve bench step --json` files; any other file is named in the error."""
        runs = []
        for path in paths:
            try:
                run = json.loads(Path(path).read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"cost_model: cannot read {path}: {e}") from None
            if not isinstance(run, dict) or run.get("benchmark") != "step":
                raise ValueError(f"cost_model: {path} is not the JSON of `kvserve bench step`")
            runs.append(run)
        return cls.fit(runs)

    @classmethod
    def fit_trace(cls, steps: list[tuple[StepShape, float]], source: str) -> StepCostModel:
        """From the steps an engine traced while serving (`LLMEngine.trace_steps`), which
        carry what steps timed alone miss: the serving loop's and the other replicas' share
        of the CPU. Medians keep the stalls of a busy machine from skewing the fit: the
        decode-only steps' median time per batch size gives the fixed and per-decode costs
        (a line weighted by each size's count, with the decodes' context folded in), and
        the median of what a prefill token adds to a step gives the prefill cost."""
        by_size: dict[int, list[float]] = {}
        for shape, seconds in steps:
            if not shape.num_prefill_tokens:
                by_size.setdefault(shape.num_decodes, []).append(seconds)
        if not by_size or len(by_size) == len(steps):
            raise ValueError("fitting a step cost to a trace needs steps that only decode "
                             "and steps with prompt tokens; trace a workload with both")
        sizes = sorted(by_size)
        medians = np.array([statistics.median(by_size[n]) for n in sizes])
        weight = np.sqrt([len(by_size[n]) for n in sizes])
        x = np.array([[1.0, n] for n in sizes])
        coef = (np.linalg.lstsq(x * weight[:, None], medians * weight, rcond=None)[0]
                if len(sizes) > 1 else np.array([medians[0], 0.0]))
        fixed, per_decode = (max(float(c), 0.0) for c in coef)
        per_token = [(seconds - fixed - per_decode * shape.num_decodes)
                     / shape.num_prefill_tokens for shape, seconds in steps
                     if shape.num_prefill_tokens]
        return cls(fixed, per_decode, max(statistics.median(per_token), 0.0), source=source)

    def __str__(self) -> str:
        return (f"{self.fixed * 1e3:.2f} ms + {self.per_decode * 1e3:.3f} ms/decode + "
                f"{self.per_prefill_token * 1e3:.4f} ms/prefill token + "
                f"{self.per_context_token * 1e6:.3f} us/context token, at least "
                f"{self.prefill_step_floor * 1e3:.2f} ms with prefill tokens "
                f"(from {self.source})")

    def step_seconds(self, sched: SchedulerOutput) -> float:
        return self.seconds(sched.shape)

    def seconds(self, shape: StepShape) -> float:
        seconds = (self.fixed + self.per_decode * shape.num_decodes
                   + self.per_prefill_token * shape.num_prefill_tokens
                   + self.per_context_token * shape.num_context_tokens)
        return max(seconds, self.prefill_step_floor) if shape.num_prefill_tokens else seconds


@dataclass(frozen=True)
class SimRequest:
    arrival: float
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class Timing:
    arrival: float
    first_token: float | None = None
    finished: float | None = None
    num_tokens: int = 0

    @property
    def ttft(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        assert self.first_token is not None and self.finished is not None
        return (self.finished - self.first_token) / max(1, self.num_tokens - 1)


@dataclass
class SimReplica:
    index: int
    scheduler: Scheduler
    prefill_only: bool
    busy: bool = False
    requests: set[str] = field(default_factory=set)  # in flight, as the front end counts


@dataclass(frozen=True)
class ClusterSpec:
    """What a simulated cluster is: its replicas' engine config and cost, its layout and
    policies, and the link its replicas move KV over."""

    config: EngineConfig
    cost: StepCostModel
    num_replicas: int
    num_prefill: int = 0  # > 0: disaggregated, the first `num_prefill` replicas prefill
    router: str = "round-robin"
    migration_threshold: int = 0
    link_bytes_per_second: float = 10e9
    balance_seconds: float = 0.05


class Simulation:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        config = spec.config
        self.block_size = config.cache.block_size
        self.kv_bytes_per_block = config.kv_bytes_per_block
        num_blocks = config.num_kv_blocks
        self.replicas = []
        for i in range(spec.num_replicas):
            kv = KVCacheManager(num_blocks, self.block_size, config.cache.enable_prefix_caching,
                                num_host_blocks=num_blocks)
            scheduler_config = config.scheduler
            prefill_only = i < spec.num_prefill
            if prefill_only:
                scheduler_config = replace(scheduler_config, prefill_only=True)
            self.replicas.append(SimReplica(i, Scheduler(scheduler_config, kv), prefill_only))
        self.entry = list(range(spec.num_prefill or spec.num_replicas))
        self.decode = list(range(spec.num_prefill, spec.num_replicas))
        self.router = make_router(spec.router, len(self.entry), num_blocks)
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.timings: dict[str, Timing] = {}
        self._moving: set[str] = set()  # requests on their way to another replica
        self._stopped: dict[str, float] = {}  # when their source stopped them
        self.num_requests = self.num_finished = 0
        self.downtimes: list[float] = []
        self.num_migrations = 0

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time, next(self._order), action))

    def run(self, requests: list[SimRequest]) -> dict[str, Timing]:
        self.num_requests = len(requests)
        for i, request in enumerate(requests):
            self.at(request.arrival, lambda i=i, r=request: self._arrive(str(i), r))
        if self.spec.migration_threshold and len(self.decode) > 1:
            self.at(self.spec.balance_seconds, self._balance)
        while self._events and self.num_finished < self.num_requests:
            self.now, _, action = heapq.heappop(self._events)
            action()
        return self.timings

    def loads(self) -> list[ReplicaLoad]:
        return [ReplicaLoad(len(r.requests)) for r in self.replicas]

    def _arrive(self, request_id: str, sim: SimRequest) -> None:
        self.timings[request_id] = Timing(sim.arrival)
        hashes = prompt_block_hashes(sim.prompt_token_ids, self.block_size)
        replica = self.replicas[self.router.route(hashes, self.loads()[:len(self.entry)])]
        request = Request(request_id, sim.prompt_token_ids,
                          SamplingParams(max_tokens=sim.max_tokens, ignore_eos=True),
                          max_tokens=sim.max_tokens, arrival_time=sim.arrival)
        replica.scheduler.add_request(request)
        replica.requests.add(request_id)
        self._wake(replica)

    def _wake(self, replica: SimReplica) -> None:
        if not replica.busy:
            self._step(replica)

    def _step(self, replica: SimReplica) -> None:
        sched = replica.scheduler.schedule()
        if sched.is_empty:
            replica.busy = False
            return
        replica.busy = True
        self.at(self.now + self.spec.cost.step_seconds(sched),
                lambda: self._step_done(replica, sched))

    def _step_done(self, replica: SimReplica, sched: SchedulerOutput) -> None:
        sampled = [s.request_id for s in sched.scheduled if s.sample]
        result = ModelRunnerOutput(sampled, [[_SAMPLED]] * len(sampled))
        for request in replica.scheduler.update_from_output(sched, result):
            timing = self.timings[request.request_id]
            timing.num_tokens = request.num_output_tokens
            if timing.first_token is None:
                timing.first_token = self.now
            stopped = self._stopped.pop(request.request_id, None)
            if stopped is not None:  # its first step after a move
                self._moving.discard(request.request_id)
                self.downtimes.append(self.now - stopped)
            if request.is_finished:
                timing.finished = self.now
                self.num_finished += 1
                replica.requests.discard(request.request_id)
            elif replica.prefill_only:
                self._move(replica, request, self._least_loaded(self.decode))
        self._step(replica)

    def _least_loaded(self, among: list[int]) -> SimReplica:
        return min((self.replicas[i] for i in among), key=lambda r: len(r.requests))

    def _move(self, source: SimReplica, request: Request, target: SimReplica) -> None:
        """Migrates a running request: its full blocks while it keeps running at the
        source (not for a prefilled request, which waits anyway), then the rest."""
        request_id = request.request_id
        self._moving.add(request_id)
        bulk = request.num_cached_tokens // self.block_size
        link = self.spec.link_bytes_per_second / self.kv_bytes_per_block
        ahead = 0.0 if source.prefill_only else bulk / link
        self.at(self.now + ahead, lambda: self._stop_and_send(source, request_id, target,
                                                               0 if source.prefill_only
                                                               else bulk))

    def _stop_and_send(self, source: SimReplica, request_id: str, target: SimReplica,
                       sent: int) -> None:
        request = source.scheduler.detach_request(request_id)
        if request is None:  # finished meanwhile
            self._moving.discard(request_id)
            return
        source.requests.discard(request_id)
        self.num_migrations += 1
        self._stopped[request_id] = self.now
        blocks = -(-request.num_cached_tokens // self.block_size)
        rest = (blocks - sent) * self.kv_bytes_per_block / self.spec.link_bytes_per_second
        target.requests.add(request_id)
        self.at(self.now + rest, lambda: self._attach(target, request, blocks))
        self._wake(source)

    def _attach(self, target: SimReplica, request: Request, blocks: int) -> None:
        host = target.scheduler.kv_cache.allocate_host_blocks(blocks)
        target.scheduler.attach_request(request, host)
        self._wake(target)

    def _balance(self) -> None:
        decode = [self.replicas[i] for i in self.decode]
        busiest = max(decode, key=lambda r: len(r.requests))
        idlest = min(decode, key=lambda r: len(r.requests))
        gap = len(busiest.requests) - len(idlest.requests)
        room = len(idlest.requests) < self.spec.config.scheduler.max_num_seqs
        if gap >= self.spec.migration_threshold and room:
            movable = [r for r in busiest.scheduler.running
                       if r.request_id not in self._moving and r.num_output_tokens]
            if movable:
                self._move(busiest, min(movable, key=lambda r: r.num_tokens), idlest)
        if self.num_finished < self.num_requests:
            self.at(self.now + self.spec.balance_seconds, self._balance)


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Arrival times as `benchmarks.cluster.drive` sends them."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.expovariate(rate)
    return times

