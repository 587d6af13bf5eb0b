"""`ClusterLLM`: engine replicas as Ray actors behind one front end, with `AsyncLLM`'s
interface, so the OpenAI server runs unchanged on a cluster.

The front end tokenizes and validates each request once, picks a replica with the router,
and relays that replica's outputs to the request's stream. One poll per replica carries the
outputs of all its requests. When a replica's process dies, the poll fails at once: its
requests that had not produced output yet are re-run on another replica, the others end
with a `RequestFailedError`, and the replica (restarted by Ray) rejoins when it answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.cluster.metrics import ClusterMetrics
from kvserve.cluster.replica import EngineReplica
from kvserve.cluster.router import ReplicaLoad, make_router
from kvserve.config import DEFAULT_MAX_WAITING_REQUESTS, EngineConfig
from kvserve.core.kv_cache.hashing import prompt_block_hashes
from kvserve.core.scheduler.output import StepShape
from kvserve.engine.input_processor import (
    InputProcessor,
    ParentRequest,
    PromptType,
)
from kvserve.engine.llm_engine import engine_tokenizer
from kvserve.entrypoints.async_llm import RequestStream, StreamingLLM
from kvserve.errors import EngineOverloadedError, RequestFailedError
from kvserve.outputs import EngineStats, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.vllm_flags import take_vllm_options

logger = logging.getLogger(__name__)

# How often the front end asks a dead replica's restarted process whether it is up.
RESTART_POLL_SECONDS = 0.5
# How often load balancing compares the replicas' loads.
BALANCE_SECONDS = 0.05


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("data_parallel_size > 1 needs Ray: pip install 'kvserve[cluster]'"
                         ) from None
    return ray


@dataclass
class InFlight:
    """A request the front end has sent to a replica and not yet seen finish."""

    parent: ParentRequest
    params: SamplingParams
    max_tokens: int
    stream: RequestStream
    replica: int
    started: bool = False  # the client has had output: a re-run elsewhere cannot continue it
    num_tokens: int = 0  # prompt and output tokens, as of the last output
    moving_to: int | None = None  # the destination of a migration under way
    detached_at: float | None = None  # when the source stopped it for the migration


@dataclass(frozen=True)
class Layout:
    """Which replicas take new requests (`entry`) and which decode them: all of them, or,
    disaggregated, the first `num_prefill` and the rest."""

    num_replicas: int
    num_prefill: int = 0

    @classmethod
    def of(cls, data_parallel_size: int, prefill_replicas: int, decode_replicas: int
           ) -> Layout:
        if not prefill_replicas and not decode_replicas:
            if data_parallel_size < 1:
                raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
            return cls(data_parallel_size)
        if prefill_replicas < 1 or decode_replicas < 1:
            raise ValueError(f"prefill_replicas and decode_replicas must both be >= 1, got "
                             f"{prefill_replicas} and {decode_replicas}")
        return cls(prefill_replicas + decode_replicas, prefill_replicas)

    @property
    def entry(self) -> range:
        return range(self.num_prefill or self.num_replicas)

    @property
    def decode(self) -> range:
        return range(self.num_prefill, self.num_replicas)

    def is_prefill(self, index: int) -> bool:
        return index < self.num_prefill


@dataclass
class Replica:
    index: int
    actor: Any  # a Ray actor handle of EngineReplica
    healthy: bool = True
    pid: int | None = None
    requests: set[str] = field(default_factory=set)


class ClusterLLM(StreamingLLM):
    """Takes `EngineConfig.create`'s options for every replica, plus the cluster's own."""

    def __init__(self, model: str, data_parallel_size: int = 2, router: str = "round-robin",
                 ray_address: str | None = None, migration_threshold: int = 0,
                 prefill_replicas: int = 0, decode_replicas: int = 0,
                 max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
                 model_name: str | None = None, **engine_options: Any) -> None:
        """`migration_threshold` > 0 turns on load balancing by migration. With
        `prefill_replicas` and `decode_replicas` (instead of `data_parallel_size`), prompts
        run on the first and move, once prefilled, to the second (DistServe)."""
        self.layout = Layout.of(data_parallel_size, prefill_replicas, decode_replicas)
        data_parallel_size = self.layout.num_replicas
        if migration_threshold < 0 or migration_threshold == 1:
            raise ValueError(f"migration_threshold must be 0 (off) or >= 2, got "
                             f"{migration_threshold}")
        super().__init__(max_waiting_requests, data_parallel_size)
        ray = import_ray()
        # Bad options fail here, not in every replica; vLLM's are turned into kvserve's here
        # too, once, rather than noted again by each replica.
        engine_options = take_vllm_options(engine_options)
        config = EngineConfig.from_options(model, engine_options)
        # The template itself, not a file that another node of the cluster may not have.
        engine_options["chat_template"] = config.chat_template
        self.max_num_seqs = config.scheduler.max_num_seqs
        tokenizer = engine_tokenizer(config)
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=ray_address, include_dashboard=False, log_to_driver=True,
                     logging_level=logging.WARNING)
        on_gpu = str(engine_options.get("device", "cpu")).startswith("cuda")
        cpus = max(1, int(ray.available_resources().get("CPU", 1)) // data_parallel_size)
        actor_class = ray.remote(
            num_cpus=1 if on_gpu else cpus, num_gpus=1 if on_gpu else 0, max_restarts=-1,
            max_task_retries=0)(EngineReplica)
        logger.info("starting %d replicas of %s (%s each)", data_parallel_size, model,
                    "1 GPU" if on_gpu else f"{cpus} CPU threads")
        self.replicas = [Replica(i, actor_class.remote(
            model, cpus, **engine_options, prefill_only=self.layout.is_prefill(i)))
            for i in range(data_parallel_size)]
        limits = ray.get([r.actor.start.remote() for r in self.replicas])[0]
        for replica, pid in zip(self.replicas, ray.get([r.actor.pid.remote()
                                                        for r in self.replicas]), strict=True):
            replica.pid = pid
        self.inputs = InputProcessor(tokenizer, limits, config.sampling_defaults)
        self.router = make_router(router, len(self.layout.entry), limits.num_kv_blocks)
        self.migration_threshold = migration_threshold
        self.metrics = ClusterMetrics(model_name or model)
        self._ray = ray
        self._in_flight: dict[str, InFlight] = {}
        self._pollers: list[asyncio.Task[None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()  # prefilled requests moving to decode
        # The LoRA adapters every replica serves: name -> folder. A restarted replica starts
        # with those of `lora_modules` and is brought in line with this.
        self._startup_loras = dict(engine_options.get("lora_modules") or {})
        self._loras = dict(self._startup_loras)

    @property
    def lora_names(self) -> set[str]:
        return set(self._loras)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Loads an adapter on every replica; an adapter that fails to load on one raises
        (and may be loaded on others: load it again, or unload it)."""
        await asyncio.gather(*(r.actor.load_lora.remote(name, path) for r in self.replicas
                               if r.healthy))
        self._loras[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        await asyncio.gather(*(r.actor.unload_lora.remote(name) for r in self.replicas
                               if r.healthy))
        del self._loras[name]

    async def _sync_loras(self, replica: Replica) -> None:
        """Brings a restarted replica's adapters in line with the cluster's."""
        for name in self._startup_loras.keys() - self._loras.keys():
            await replica.actor.unload_lora.remote(name)
        for name, path in self._loras.items():
            if self._startup_loras.get(name) != path:
                await replica.actor.load_lora.remote(name, path)

    @property
    def num_waiting(self) -> int:
        """Sequences sent to replicas whose requests have not produced output yet."""
        return sum(r.params.n for r in self._in_flight.values() if not r.started)

    def add_requests(self, prompts: list[PromptType], params: SamplingParams
                     ) -> list[RequestStream]:
        """As `AsyncLLM.add_requests`; each request goes to the replica the router picks."""
        prepared = self.inputs.prepare_requests(prompts, params)
        self.check_room(len(prepared), params.n)
        self._start_pollers()
        streams = []
        for parent, max_tokens in prepared:
            stream = self._new_stream(parent.request_id)
            request = InFlight(parent, params, max_tokens, stream, replica=-1)
            self._in_flight[parent.request_id] = request
            self._send(request, self._route(parent))
            streams.append(stream)
        return streams

    def _route(self, parent: ParentRequest) -> int:
        hashes = prompt_block_hashes(parent.prompt_token_ids, self.inputs.limits.block_size,
                                     parent.cache_salt)
        index = self.router.route(hashes, self.loads()[:len(self.layout.entry)])
        if not self.replicas[index].healthy:
            index = self._least_loaded(self.layout.entry)
        return index

    def _least_loaded(self, among: range) -> int:
        """The healthy replica among these with the fewest requests in flight."""
        healthy = [self.replicas[i] for i in among if self.replicas[i].healthy]
        if not healthy:
            raise EngineOverloadedError("no replica is serving (all are restarting); retry "
                                        "later")
        return min(healthy, key=lambda r: len(r.requests)).index

    def loads(self) -> list[ReplicaLoad]:
        """Each replica's requests, as the front end counts them (no replica is asked)."""
        loads = []
        for replica in self.replicas:
            started = sum(self._in_flight[i].started for i in replica.requests)
            loads.append(ReplicaLoad(started, len(replica.requests) - started))
        return loads

    def _send(self, request: InFlight, index: int) -> None:
        replica = self.replicas[index]
        request.replica = index
        replica.requests.add(request.parent.request_id)
        self.metrics.routed.labels(self.metrics.model_name, str(index)).inc()
        # Errors surface through the replica's poll, which fails when the replica does.
        replica.actor.add.remote(request.parent, request.params, request.max_tokens)

    def abort(self, request_id: str) -> None:
        request = self._in_flight.pop(request_id, None)
        if request is None:
            return
        self.replicas[request.replica].requests.discard(request_id)
        for index in (request.replica, request.moving_to):
            if index is not None and self.replicas[index].healthy:
                self.replicas[index].actor.abort.remote(request_id)

    def _start_pollers(self) -> None:
        if not self._pollers:
            self._pollers = [asyncio.create_task(self._poll(r)) for r in self.replicas]
            if self.migration_threshold:
                self._pollers.append(asyncio.create_task(self._balance()))

    async def _balance(self) -> None:
        """Moves one running request at a time from the busiest replica to the idlest while
        their requests in flight differ by `migration_threshold` or more and the idlest has
        a free slot in its running batch, where the request goes on at once (Llumnix's load
        balancing)."""
        while True:
            await asyncio.sleep(BALANCE_SECONDS)
            healthy = [self.replicas[i] for i in self.layout.decode if self.replicas[i].healthy]
            if len(healthy) < 2:
                continue
            loads = self.loads()
            busiest = max(healthy, key=lambda r: loads[r.index].num_requests)
            idlest = min(healthy, key=lambda r: loads[r.index].num_requests)
            gap = loads[busiest.index].num_requests - loads[idlest.index].num_requests
            movable = self._movable(busiest.index)
            has_room = loads[idlest.index].num_requests < self.max_num_seqs
            if gap >= self.migration_threshold and has_room and movable:
                await self.migrate_request(movable[0], idlest.index)

    async def _poll(self, replica: Replica) -> None:
        while True:
            try:
                items, handoffs = await replica.actor.outputs.remote()
            except self._ray.exceptions.RayActorError as e:
                await self._recover(replica, e)
                continue
            for request_id, item in items:
                self._deliver(replica, request_id, item)
            for request_id, migrated in handoffs:
                self._tasks.add(task := asyncio.create_task(
                    self._take_over(replica, request_id, migrated)))
                task.add_done_callback(self._tasks.discard)

    async def _take_over(self, source: Replica, request_id: str, migrated: Any) -> None:
        """Sends a request a prefill replica has let go, KV and all, to the decode replica
        with the fewest requests."""
        request = self._in_flight.get(request_id)
        try:
            target = self.replicas[self._least_loaded(self.layout.decode)]
        except EngineOverloadedError as e:
            self._fail(request_id, source, f"no decode replica takes this request: {e}")
            return
        if request is not None:
            request.moving_to, request.detached_at = target.index, time.monotonic()
        model = self.metrics.model_name
        try:
            await target.actor.attach.remote(migrated, {})
        except self._ray.exceptions.RayError as e:
            self.metrics.migrations.labels(model, "failed").inc()
            self._fail(request_id, source, f"moving this prefilled request to replica "
                                           f"{target.index} failed: {e}")
            return
        self.metrics.migrations.labels(model, "done").inc()
        if request_id not in self._in_flight:  # the client left meanwhile
            target.actor.abort.remote(request_id)

    def _deliver(self, replica: Replica, request_id: str,
                 item: RequestOutput | BaseException) -> None:
        request = self._in_flight.get(request_id)
        if request is None:
            return  # aborted meanwhile
        if replica.index == request.moving_to:
            self._switch(request)
        elif replica.index != request.replica:
            return  # from the source of a finished migration: older than what followed
        if isinstance(item, BaseException) or item.finished:
            del self._in_flight[request_id]
            replica.requests.discard(request_id)
        else:
            request.started = True
            request.num_tokens = (len(item.prompt_token_ids)
                                  + len(item.outputs[0].token_ids))
        request.stream.put(item)

    def _switch(self, request: InFlight) -> None:
        """Points a migrating request at its destination, on its first output there."""
        assert request.moving_to is not None
        request_id = request.parent.request_id
        self.replicas[request.replica].requests.discard(request_id)
        self.replicas[request.moving_to].requests.add(request_id)
        request.replica, request.moving_to = request.moving_to, None
        if request.detached_at is not None:
            downtime = time.monotonic() - request.detached_at
            self.metrics.downtime.labels(self.metrics.model_name).observe(downtime)
            self.metrics.downtimes.append(downtime)
            request.detached_at = None

    async def migrate_request(self, request_id: str, destination: int) -> dict[str, Any]:
        """Moves a running request to another replica while it decodes (Llumnix): its full
        KV blocks go ahead while the source keeps running it, then the source stops it and
        the rest of its KV and state follow. The blocks travel from replica to replica
        through Ray's object store, never through the front end. Its stream switches over
        at its first output from the destination."""
        request = self._in_flight.get(request_id)
        if request is None or not request.started or request.moving_to is not None:
            return {"request_id": request_id, "migrated": False}
        source, target = self.replicas[request.replica], self.replicas[destination]
        if source is target or not (source.healthy and target.healthy):
            return {"request_id": request_id, "migrated": False}
        start = time.monotonic()
        request.moving_to = destination
        model = self.metrics.model_name
        try:
            received = await target.actor.receive_kv.remote(
                source.actor.export_kv.remote(request_id))
            request.detached_at = time.monotonic()
            migrated = source.actor.detach.remote(
                request_id, {child: len(blocks) for child, blocks in received.items()})
            moved = await target.actor.attach.remote(migrated, received)
        except self._ray.exceptions.RayError as e:
            # A replica died, or failed, mid-move: perhaps after the source let it go.
            self.metrics.migrations.labels(model, "failed").inc()
            self._fail(request_id, source, f"moving this request from replica {source.index} "
                                           f"to {destination} failed: {e}")
            if target.healthy:
                target.actor.abort.remote(request_id)
            return {"request_id": request_id, "migrated": False}
        if not moved:  # it finished, or was preempted, before the source let it go
            request.moving_to = request.detached_at = None
            self.metrics.migrations.labels(model, "skipped").inc()
            return {"request_id": request_id, "migrated": False}
        if request_id not in self._in_flight:  # the client left during the move
            target.actor.abort.remote(request_id)
        self.metrics.migrations.labels(model, "done").inc()
        return {"request_id": request_id, "migrated": True, "source": source.index,
                "destination": destination, "seconds": time.monotonic() - start}

    def _fail(self, request_id: str, replica: Replica, message: str) -> None:
        """Ends a request with an error (its replica is told to drop it too)."""
        request = self._in_flight.pop(request_id, None)
        replica.requests.discard(request_id)
        if replica.healthy:
            replica.actor.abort.remote(request_id)
        if request is not None:
            self.metrics.failed.labels(self.metrics.model_name).inc()
            request.stream.put(RequestFailedError(message))

    async def migrate(self, source: int, destination: int, num_requests: int
                      ) -> list[dict[str, Any]]:
        """Moves up to `num_requests` running requests from one replica to another, the
        shortest first (the least KV to copy)."""
        for name, index in (("source", source), ("destination", destination)):
            if not 0 <= index < len(self.replicas):
                raise ValueError(f"{name}: replica {index} does not exist (there are "
                                 f"{len(self.replicas)})")
        if source == destination:
            raise ValueError("destination: must differ from source")
        return [await self.migrate_request(request_id, destination)
                for request_id in self._movable(source)[:num_requests]]

    def _movable(self, index: int) -> list[str]:
        """A replica's running requests that may migrate, shortest first."""
        requests = [self._in_flight[i] for i in self.replicas[index].requests]
        return [r.parent.request_id for r in sorted(requests, key=lambda r: r.num_tokens)
                if r.started and r.moving_to is None]

    async def _recover(self, replica: Replica, error: Exception) -> None:
        """Re-runs or fails the dead replica's requests, then waits for Ray's restart."""
        died = time.monotonic()
        replica.healthy = False
        model = self.metrics.model_name
        self.metrics.replica_failures.labels(model, str(replica.index)).inc()
        logger.warning("replica %d (pid %s) failed: %s", replica.index, replica.pid, error)
        can_rerun = any(self.replicas[i].healthy for i in self.layout.entry)
        for request_id in sorted(replica.requests):
            request = self._in_flight[request_id]
            if not request.started and can_rerun:
                self.metrics.rerun.labels(model).inc()
                self._send(request, self._least_loaded(self.layout.entry))
                continue
            del self._in_flight[request_id]
            self.metrics.failed.labels(model).inc()
            request.stream.put(RequestFailedError(
                f"replica {replica.index} failed while running this request; retry it"))
        replica.requests.clear()
        while True:
            try:
                await replica.actor.start.remote()
                replica.pid = await replica.actor.pid.remote()
                break
            except self._ray.exceptions.RayActorError:
                await asyncio.sleep(RESTART_POLL_SECONDS)
        await self._sync_loras(replica)
        replica.healthy = True
        self.metrics.recovery.labels(model).observe(time.monotonic() - died)
        logger.warning("replica %d is serving again (pid %d)", replica.index, replica.pid)

    def describe(self) -> list[dict[str, Any]]:
        """Each replica's state, for `GET /replicas`."""
        return [{"replica": r.index, "healthy": r.healthy, "pid": r.pid,
                 "role": "prefill" if self.layout.is_prefill(r.index) else (
                     "decode" if self.layout.num_prefill else "both"),
                 "num_requests": len(r.requests)} for r in self.replicas]

    async def replica_stats(self) -> list[EngineStats]:
        """Every serving replica's `EngineStats`."""
        return await asyncio.gather(*(r.actor.stats.remote() for r in self.replicas
                                      if r.healthy))

    async def trace_steps(self, on: bool) -> list[tuple[StepShape, float]]:
        """The steps every serving replica traced (see `LLMEngine.trace_steps`), together."""
        traces = await asyncio.gather(*(r.actor.trace_steps.remote(on) for r in self.replicas
                                        if r.healthy))
        return [step for trace in traces for step in trace]

    async def render_metrics(self) -> bytes:
        healthy = [r for r in self.replicas if r.healthy]
        results = await asyncio.gather(*(r.actor.metric_families.remote() for r in healthy),
                                       return_exceptions=True)
        families = {r.index: f for r, f in zip(healthy, results, strict=True)
                    if not isinstance(f, BaseException)}
        return self.metrics.render(families)

    def shutdown(self) -> None:
        for task in [*self._pollers, *self._tasks]:
            task.cancel()
        for replica in self.replicas:
            self._ray.kill(replica.actor, no_restart=True)
        if self._started_ray:
            self._ray.shutdown()
