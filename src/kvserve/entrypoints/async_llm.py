"""`AsyncLLM`: the engine stepping in a background thread, results fanned out to asyncio streams.

The event loop only validates requests and forwards commands; every model step runs on the
engine thread (torch releases the GIL inside its kernels), so a saturated engine does not
stall the HTTP server. Commands (add, abort) cross over through a queue and are applied
between steps, so an abort takes effect before the next step and frees its KV blocks there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from prometheus_client import generate_latest

from kvserve.config import DEFAULT_MAX_WAITING_REQUESTS, EngineConfig
from kvserve.engine.input_processor import ParentRequest, PromptType
from kvserve.engine.llm_engine import LLMEngine, MigratedRequest
from kvserve.engine.metrics import EngineMetrics
from kvserve.errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class OutputSink(Protocol):
    """Where the engine thread hands a request's outputs, or the error that ended it; and,
    on a prefill replica, the prefilled request itself, to go on elsewhere."""

    def put(self, item: RequestOutput | BaseException) -> None: ...

    def hand_off(self, migrated: MigratedRequest) -> None: ...


class StreamOwner(Protocol):
    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """The outputs of one request, as an async iterator of its cumulative state after every
    step it advances in; the last has `finished=True`. `close()` before the end aborts it."""

    def __init__(self, request_id: str, owner: StreamOwner) -> None:
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe: hands an item over to the stream's event loop."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        self.finished = item.finished
        return item

    def hand_off(self, migrated: MigratedRequest) -> None:
        raise AssertionError("only a cluster's prefill replica hands requests off")

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class StreamingLLM:
    """What one engine (`AsyncLLM`) and a cluster (`ClusterLLM`) share: a request's outputs
    as an async iterator, over their `add_requests`."""

    def __init__(self, max_waiting_requests: int, num_engines: int = 1) -> None:
        """`max_waiting_requests` sequences (prompts times n) may wait on each engine."""
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.max_waiting_requests = max_waiting_requests * num_engines
        self._queue_limit = (f"max_waiting_requests={max_waiting_requests}"
                             + (" per replica" if num_engines > 1 else ""))
        self._streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()
        self.dead: EngineDeadError | None = None  # set once no request can run any more

    @property
    def num_waiting(self) -> int:
        """Sequences queued and not yet started."""
        raise NotImplementedError

    def check_room(self, num_prompts: int, n: int) -> None:
        """Raises EngineOverloadedError when the queue cannot take `num_prompts` prompts of
        `n` sequences each now, and ValueError when it never could: a retry would not help."""
        sequences = num_prompts * n
        if sequences > self.max_waiting_requests:
            raise ValueError(
                f"{'prompt' if n == 1 else 'n'}: {num_prompts} prompts of n={n} make "
                f"{sequences} sequences, more than the server queues at once "
                f"({self._queue_limit})")
        if self.num_waiting + sequences > self.max_waiting_requests:
            raise EngineOverloadedError(f"the waiting queue is full ({self._queue_limit}); "
                                        "retry later")

    def _new_stream(self, request_id: str) -> RequestStream:
        stream = RequestStream(request_id, self)
        self._streams.add(stream)
        return stream

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def fail_streams(self, error: RequestFailedError) -> None:
        """Ends every stream still open with `error`; each aborts its request as it ends."""
        for stream in list(self._streams):
            if not stream.finished:
                stream.put(error)

    def add_requests(self, prompts: list[PromptType], params: SamplingParams
                     ) -> list[RequestStream]:
        raise NotImplementedError

    @property
    def lora_names(self) -> set[str]:
        """The LoRA adapters a request can name as its model."""
        raise NotImplementedError

    async def load_lora_adapter(self, name: str, path: str) -> None:
        raise NotImplementedError

    async def unload_lora_adapter(self, name: str) -> None:
        raise NotImplementedError

    async def generate(self, prompt: PromptType, params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        stream = self.add_requests([prompt], params)[0]
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()


class AsyncLLM(StreamingLLM):
    """Takes `EngineConfig.create`'s options plus `max_waiting_requests` and `model_name`."""

    def __init__(self, model: str, max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
                 model_name: str | None = None, on_dead: Callable[[], None] | None = None,
                 **engine_options: Any) -> None:
        """`on_dead` runs on the engine thread once the engine is dead, before anything
        shows it: a replica ends its process there, for its requests to be recovered
        elsewhere rather than failed."""
        super().__init__(max_waiting_requests)
        self.engine = LLMEngine(EngineConfig.from_options(model, engine_options))
        self._on_dead = on_dead
        self.inputs = self.engine.inputs
        self.metrics = EngineMetrics(model_name or model)
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # Added on the event loop; the engine thread drops those that finish.
        self._sinks: dict[str, OutputSink] = {}
        # Requests handed to the engine thread, and those it has added: each counter is
        # written by one thread only, so their difference needs no lock.
        self._num_submitted = 0
        self._num_added = 0
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    @property
    def lora_names(self) -> set[str]:
        return set(self.engine.lora_names)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await self.call_on_engine(lambda: self.engine.add_lora(name, path))

    async def unload_lora_adapter(self, name: str) -> None:
        await self.call_on_engine(lambda: self.engine.remove_lora(name))

    @property
    def num_waiting(self) -> int:
        return (len(self.engine.core.scheduler.waiting)
                + self._num_submitted - self._num_added)

    def add_requests(self, prompts: list[PromptType], params: SamplingParams
                     ) -> list[RequestStream]:
        """Validates every prompt, then queues them all; one stream per prompt. Raises
        ValueError naming the field (`prompt[i]` for lists), EngineOverloadedError when the
        waiting queue is full, or EngineDeadError, before anything is queued."""
        if self.dead is not None:
            raise self.dead
        prepared = self.inputs.prepare_requests(prompts, params)
        self.check_room(len(prepared), params.n)
        streams = []
        for parent, max_tokens in prepared:
            stream = self._new_stream(parent.request_id)
            self.add_prepared(parent, params, max_tokens, stream)
            streams.append(stream)
        return streams

    def add_prepared(self, parent: ParentRequest, params: SamplingParams, max_tokens: int,
                     sink: OutputSink) -> None:
        """Queues a validated request; the engine thread hands its outputs to `sink`."""
        self._sinks[parent.request_id] = sink
        if self.dead is not None:  # died since the caller looked: no thread takes commands
            self._fail_dead(parent.request_id)
            return
        self._num_submitted += params.n
        arrival = time.monotonic()

        def add() -> None:
            self._num_added += params.n
            try:
                self.engine.add_validated(parent, params, max_tokens)
            except ValueError as e:
                sink.put(e)
                return
            self.metrics.on_arrival(parent.request_id, arrival, params.n, parent.priority,
                                    parent.tenant)

        self._commands.put(add)

    def abort(self, request_id: str) -> None:
        """Stops a request before the next step and returns its KV blocks to the pool."""
        self._sinks.pop(request_id, None)
        self._commands.put(lambda: self._abort_now(request_id))

    def _abort_now(self, request_id: str) -> None:
        """On the engine thread: ends the request and counts it as aborted."""
        self.engine.abort_request(request_id)
        self.metrics.on_abort(request_id)

    async def call_on_engine(self, function: Callable[[], T]) -> T:
        """Runs `function` on the engine thread between steps; returns what it returns."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                result = function()
            except Exception as e:  # noqa: BLE001 (raised in the caller instead)
                loop.call_soon_threadsafe(future.set_exception, e)
                return
            loop.call_soon_threadsafe(future.set_result, result)

        self._commands.put(command)
        return await future

    async def detach(self, request_id: str, sent_ahead: dict[str, int]
                     ) -> MigratedRequest | None:
        """`LLMEngine.detach` between steps; the request's outputs stop here."""

        def detach() -> MigratedRequest | None:
            migrated = self.engine.detach(request_id, sent_ahead)
            if migrated is not None:
                self._sinks.pop(request_id, None)
                self.metrics.on_migrated_out(request_id)
            return migrated

        return await self.call_on_engine(detach)

    async def attach(self, migrated: MigratedRequest, received: dict[str, list[int]],
                     sink: OutputSink) -> None:
        """`LLMEngine.attach` between steps; the request's outputs go to `sink` from now."""
        parent = migrated.parent
        requests = [seq.request for seq in parent.sequences]

        def attach() -> None:
            self.engine.attach(migrated, received)
            self._sinks[parent.request_id] = sink
            self.metrics.on_arrival(parent.request_id, requests[0].arrival_time, len(requests),
                                    parent.priority, parent.tenant,
                                    sum(r.num_output_tokens for r in requests))

        await self.call_on_engine(attach)

    async def migrate(self, source: int, destination: int, num_requests: int
                      ) -> list[dict[str, Any]]:
        raise ValueError("source: one engine has no replica to migrate to (serve with "
                         "--data-parallel-size 2 or more)")

    def describe(self) -> list[dict[str, Any]]:
        """The one replica this is, in `ClusterLLM.describe`'s form."""
        return [{"replica": 0, "healthy": self._thread.is_alive(), "pid": os.getpid(),
                 "num_requests": len(self._sinks)}]

    async def render_metrics(self) -> bytes:
        """The Prometheus exposition of this engine's metrics."""
        self.metrics.observe_state(self.engine)
        return generate_latest(self.metrics.registry)

    def shutdown(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        """Steps until shut down. A step that fails fails its requests, and the engine goes
        on; an engine that can step no more (EngineDeadError, or anything raised outside a
        step) calls `on_dead`, then sets `dead`, fails its requests and ends the thread,
        where it used to leave every request waiting."""
        try:
            self._step_until_shut_down()
        except Exception as e:  # noqa: BLE001 (reported through `dead` and each request)
            logger.exception("the engine stopped")
            if self._on_dead is not None:
                self._on_dead()
            self.dead = e if isinstance(e, EngineDeadError) else EngineDeadError(
                f"the engine stopped: {e!r}")
            for request_id in list(self._sinks):
                self._fail_dead(request_id)

    def _fail_dead(self, request_id: str) -> None:
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.put(RequestFailedError(f"{self.dead}; retry the request"))

    def _step_until_shut_down(self) -> None:
        while True:
            idle = not self.engine.has_unfinished_requests() or self.engine.core.idle
            if not self._apply_commands(block=idle):
                return
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except EngineDeadError:
                raise
            except Exception as e:  # noqa: BLE001 (fail the batch, keep serving new requests)
                logger.exception("engine step failed; aborting the requests in flight")
                self._fail_all(e)
                continue
            self.metrics.on_step(self.engine, outputs)
            for out in outputs:
                sink = (self._sinks.pop(out.request_id, None) if out.finished
                        else self._sinks.get(out.request_id))
                if sink is not None:
                    error = next((c.error for c in out.outputs if c.error), None)
                    sink.put(_snapshot(out) if error is None else RequestFailedError(error))
                    if not out.finished and self.engine.config.scheduler.prefill_only:
                        self._hand_off(out.request_id, sink)

    def _hand_off(self, request_id: str, sink: OutputSink) -> None:
        """On a prefill replica, between steps: detaches a prefilled request at once, with
        all of its KV, for the sink to send on to a decode replica."""
        migrated = self.engine.detach(request_id, {})
        if migrated is None:
            return
        self._sinks.pop(request_id, None)
        self.metrics.on_migrated_out(request_id)
        sink.hand_off(migrated)

    def _apply_commands(self, block: bool) -> bool:
        """Runs queued commands (waiting for one if `block`); False once shut down."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while command is not None:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _fail_all(self, error: Exception) -> None:
        for request_id, sink in list(self._sinks.items()):
            self._abort_now(request_id)
            self._sinks.pop(request_id, None)
            sink.put(RequestFailedError(
                f"the engine failed while running this request: {error}"))


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the engine thread will not mutate further."""
    return replace(out, outputs=[
        replace(o, token_ids=list(o.token_ids),
                logprobs=None if o.logprobs is None else list(o.logprobs))
        for o in out.outputs])
