"""What /v1/completions and /v1/chat/completions share: running several request streams as
one, the text each streamed chunk may carry, usage, and server-sent-event framing."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.engine.input_processor import InputProcessor, PromptType
from kvserve.entrypoints.async_llm import RequestStream
from kvserve.errors import EngineDeadError, RequestFailedError
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams


class ServingBackend(Protocol):
    """What the server runs on: one engine (`AsyncLLM`) or a cluster of them (`ClusterLLM`)."""

    inputs: InputProcessor
    dead: EngineDeadError | None  # set once no request can run any more

    def add_requests(self, prompts: list[PromptType], params: SamplingParams
                     ) -> list[RequestStream]: ...

    async def render_metrics(self) -> bytes: ...

    def describe(self) -> list[dict[str, Any]]: ...

    async def migrate(self, source: int, destination: int, num_requests: int
                      ) -> list[dict[str, Any]]: ...

    @property
    def lora_names(self) -> set[str]: ...

    async def load_lora_adapter(self, name: str, path: str) -> None: ...

    def fail_streams(self, error: RequestFailedError) -> None: ...

    def shutdown(self) -> None: ...


class Serving:
    """A route's handler: the engine and the model name its responses carry."""

    def __init__(self, llm: ServingBackend, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def finish_reason(completion: CompletionOutput) -> str | None:
    return completion.finish_reason if completion.finish_reason != "abort" else None


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several request streams as (prompt index, output) pairs, in arrival order.

    Closing the iterator (client gone) closes every stream, which aborts what is unfinished.
    """
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as e:  # noqa: BLE001 (handed to the consumer below)
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of every stream, in the streams' order."""
    final: dict[int, RequestOutput] = {}
    async with aclosing(merge(streams)) as outputs:
        async for index, out in outputs:
            final[index] = out
    return [final[i] for i in range(len(streams))]


@dataclass
class DeltaTracker:
    """How much of each completion's text and tokens a stream has sent already.

    While a completion runs, text that could still turn out to begin a stop string is held
    back (`hold` characters), because the engine cuts a matched stop string from the text.
    """

    hold: int
    text_sent: dict[tuple[int, int], int] = field(default_factory=dict)
    tokens_sent: dict[tuple[int, int], int] = field(default_factory=dict)
    finished: set[tuple[int, int]] = field(default_factory=set)

    def delta(self, prompt_index: int, completion: CompletionOutput
              ) -> tuple[str, int, int] | None:
        """(new text, first new token index, end token index), or None if nothing to send."""
        key = (prompt_index, completion.index)
        if key in self.finished:
            return None
        done = completion.finish_reason is not None
        end = len(completion.text) if done else max(0, len(completion.text) - self.hold)
        start = self.text_sent.get(key, 0)
        first_token = self.tokens_sent.get(key, 0)
        if done:
            self.finished.add(key)
        elif end <= start:
            return None
        self.text_sent[key] = max(start, end)
        self.tokens_sent[key] = len(completion.token_ids)
        return completion.text[start:end], first_token, len(completion.token_ids)


def stop_hold(stop: list[str]) -> int:
    return max((len(s) for s in stop), default=1) - 1


def partial_tag(text: str, tag: str, start: int = 0) -> int:
    """How many of text[start:]'s last characters may begin `tag` (the longest such proper
    prefix): what a stream holds back until the tag forms or cannot."""
    return next((k for k in range(min(len(tag) - 1, len(text) - start), 0, -1)
                 if tag.startswith(text[-k:])), 0)
