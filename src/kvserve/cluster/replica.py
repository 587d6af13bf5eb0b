"""One engine replica, run as a Ray actor: an `AsyncLLM` that takes requests the front end has
already validated, and hands back the outputs of all its requests in one batch per call, so
the traffic between front end and replica grows with steps, not with tokens times requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import torch

from kvserve.core.scheduler.output import StepShape
from kvserve.engine.input_processor import ParentRequest, RequestLimits
from kvserve.engine.llm_engine import MigratedRequest
from kvserve.entrypoints.async_llm import AsyncLLM
from kvserve.outputs import EngineStats, RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
ReplicaItem = tuple[str, RequestOutput | BaseException]


class Outbox:
    """Every request's outputs since the front end last took them, newest state only."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._items: dict[str, RequestOutput | BaseException] = {}
        self._handoffs: list[MigratedRequest] = []
        self._ready = asyncio.Event()

    def put(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Thread-safe (the engine thread calls it)."""
        self._loop.call_soon_threadsafe(self._add, request_id, item)

    def _add(self, request_id: str, item: RequestOutput | BaseException) -> None:
        # Outputs are cumulative, so a newer one replaces an older one not yet taken; the
        # final output or an error is never replaced.
        old = self._items.get(request_id)
        if old is None or (isinstance(old, RequestOutput) and not old.finished):
            self._items[request_id] = item
        self._ready.set()

    def hand_off(self, migrated: MigratedRequest) -> None:
        """Thread-safe: a prefilled request to send on, after its outputs so far."""
        self._loop.call_soon_threadsafe(self._add_handoff, migrated)

    def _add_handoff(self, migrated: MigratedRequest) -> None:
        self._handoffs.append(migrated)
        self._ready.set()

    def discard(self, request_id: str) -> None:
        self._items.pop(request_id, None)

    async def take(self) -> tuple[list[ReplicaItem], list[MigratedRequest]]:
        await self._ready.wait()
        self._ready.clear()
        items, self._items = self._items, {}
        handoffs, self._handoffs = self._handoffs, []
        return list(items.items()), handoffs


class ReplicaSink:
    """An `OutputSink` that files one request's outputs in the outbox."""

    __slots__ = ("outbox", "request_id")

    def __init__(self, outbox: Outbox, request_id: str) -> None:
        self.outbox = outbox
        self.request_id = request_id

    def put(self, item: RequestOutput | BaseException) -> None:
        self.outbox.put(self.request_id, item)

    def hand_off(self, migrated: MigratedRequest) -> None:
        self.outbox.hand_off(migrated)


def _exit_for_a_restart() -> None:
    """A replica whose engine died (a tensor-parallel rank killed, say) ends its process, as
    if killed itself: Ray starts it again, and the front end re-runs the requests it had not
    started and fails the others. Left alive, it failed every request routed to it."""
    logger.error("the engine is dead; exiting for Ray to restart this replica")
    os._exit(1)


class EngineReplica:
    """The actor's class; `ClusterLLM` starts it with `ray.remote`. Every method but the
    constructor runs on the actor's event loop."""

    def __init__(self, model: str, num_threads: int, **engine_options: Any) -> None:
        torch.set_num_threads(num_threads)
        self.llm = AsyncLLM(model, on_dead=_exit_for_a_restart, **engine_options)
        self._outbox: Outbox | None = None

    async def start(self) -> RequestLimits:
        """Called first: binds the outbox to the actor's event loop."""
        self._outbox = Outbox()
        return self.llm.inputs.limits

    def pid(self) -> int:
        return os.getpid()

    async def add(self, parent: ParentRequest, params: SamplingParams, max_tokens: int) -> None:
        assert self._outbox is not None, "start() must be called first"
        self.llm.add_prepared(parent, params, max_tokens,
                              ReplicaSink(self._outbox, parent.request_id))

    async def load_lora(self, name: str, path: str) -> None:
        await self.llm.load_lora_adapter(name, path)

    async def unload_lora(self, name: str) -> None:
        await self.llm.unload_lora_adapter(name)

    async def abort(self, request_id: str) -> None:
        self.llm.abort(request_id)

    async def export_kv(self, request_id: str) -> dict[str, torch.Tensor] | None:
        """The full blocks of a running request's KV, sent ahead of its migration."""
        return await self.llm.call_on_engine(
            lambda: self.llm.engine.export_kv(request_id, full_only=True))

    async def receive_kv(self, kv: dict[str, torch.Tensor] | None) -> dict[str, list[int]]:
        """Host blocks holding KV sent ahead of a request migrating here."""
        if kv is None:
            return {}
        return await self.llm.call_on_engine(lambda: self.llm.engine.receive_kv(kv))

    async def release_kv(self, received: dict[str, list[int]]) -> None:
        """Frees received KV whose request did not come after all."""
        kv_cache = self.llm.engine.core.kv_cache
        host_blocks = [block for blocks in received.values() for block in blocks]
        await self.llm.call_on_engine(lambda: kv_cache.free_host_blocks(host_blocks))

    async def detach(self, request_id: str, sent_ahead: dict[str, int]
                     ) -> MigratedRequest | None:
        assert self._outbox is not None, "start() must be called first"
        migrated = await self.llm.detach(request_id, sent_ahead)
        if migrated is not None:
            self._outbox.discard(request_id)
        return migrated

    async def attach(self, migrated: MigratedRequest | None,
                     received: dict[str, list[int]]) -> bool:
        """Goes on with a request detached from another replica; False (releasing what was
        received) when the detach found nothing to move."""
        assert self._outbox is not None, "start() must be called first"
        if migrated is None:
            await self.release_kv(received)
            return False
        request_id = migrated.parent.request_id
        await self.llm.attach(migrated, received, ReplicaSink(self._outbox, request_id))
        return True

    async def outputs(self) -> tuple[list[ReplicaItem], list[tuple[str, Any]]]:
        """Waits for at least one output, then returns every one since the last call, and
        the requests prefilled here to go on at a decode replica: each as its id and an
        object reference, so that the KV goes from replica to replica, never through the
        front end."""
        import ray

        assert self._outbox is not None, "start() must be called first"
        items, handoffs = await self._outbox.take()
        return items, [(m.parent.request_id, ray.put(m)) for m in handoffs]

    async def stats(self) -> EngineStats:
        return self.llm.engine.stats()

    async def trace_steps(self, on: bool) -> list[tuple[StepShape, float]]:
        return await self.llm.call_on_engine(lambda: self.llm.engine.trace_steps(on))

    async def metric_families(self) -> list[Any]:
        """This replica's Prometheus metric families, for the front end to merge."""
        self.llm.metrics.observe_state(self.llm.engine)
        return list(self.llm.metrics.registry.collect())
