"""One engine replica, run as a Ray actor: an `AsyncLLM` that takes requests the front end has
already validated, and hands back the outputs of all its requests in one batch per call, so
the traffic between front end and replica grows with steps, not with tokens times requests.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import torch

from kvserve.engine.input_processor import ParentRequest, RequestLimits
from kvserve.entrypoints.async_llm import AsyncLLM
from kvserve.outputs import EngineStats, RequestOutput
from kvserve.sampling_params import SamplingParams

ReplicaItem = tuple[str, RequestOutput | BaseException]


class Outbox:
    """Every request's outputs since the front end last took them, newest state only."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._items: dict[str, RequestOutput | BaseException] = {}
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

    async def take(self) -> list[ReplicaItem]:
        await self._ready.wait()
        self._ready.clear()
        items, self._items = self._items, {}
        return list(items.items())


class ReplicaSink:
    """An `OutputSink` that files one request's outputs in the outbox."""

    __slots__ = ("outbox", "request_id")

    def __init__(self, outbox: Outbox, request_id: str) -> None:
        self.outbox = outbox
        self.request_id = request_id

    def put(self, item: RequestOutput | BaseException) -> None:
        self.outbox.put(self.request_id, item)


class EngineReplica:
    """The actor's class; `ClusterLLM` starts it with `ray.remote`. Every method but the
    constructor runs on the actor's event loop."""

    def __init__(self, model: str, num_threads: int, **engine_options: Any) -> None:
        torch.set_num_threads(num_threads)
        self.llm = AsyncLLM(model, **engine_options)
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

    async def abort(self, request_id: str) -> None:
        self.llm.abort(request_id)

    async def outputs(self) -> list[ReplicaItem]:
        """Waits for at least one output, then returns every one since the last call."""
        assert self._outbox is not None, "start() must be called first"
        return await self._outbox.take()

    async def stats(self) -> EngineStats:
        return self.llm.engine.stats()

    async def metric_families(self) -> list[Any]:
        """This replica's Prometheus metric families, for the front end to merge."""
        self.llm.metrics.observe_state(self.llm.engine)
        return list(self.llm.metrics.registry.collect())
