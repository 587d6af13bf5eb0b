"""POST /v1/completions: one or many prompts, `n` completions each, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from kvserve.entrypoints.openai.protocol import CompletionRequest
from kvserve.entrypoints.openai.serving import (
    DeltaTracker,
    Serving,
    collect,
    finish_reason,
    merge,
    new_id,
    now,
    sse,
    stop_hold,
    usage,
)
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams


def prompts_of(request: CompletionRequest) -> list[dict[str, Any]]:
    prompt = request.prompt
    if request.segments is not None:
        if prompt is not None:
            raise ValueError("segments: give prompt or segments, not both")
        return [request.engine_prompt({"segments": request.segments})]
    if not prompt:
        raise ValueError("prompt must not be empty")
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        prompt = [prompt]  # type: ignore[assignment]
    return [request.engine_prompt({"prompt": p} if isinstance(p, str)
                                  else {"prompt_token_ids": p}) for p in prompt]


def prompt_logprobs_field(out: RequestOutput) -> dict[str, Any]:
    """vLLM's layout: per prompt token, None for the first, else {token id: {logprob, rank,
    decoded_token}}; absent unless the request asked for it."""
    if out.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": [
        None if entry is None else {str(t): {"logprob": e.logprob, "rank": e.rank,
                                             "decoded_token": e.decoded_token}
                                    for t, e in entry.items()}
        for entry in out.prompt_logprobs]}


class CompletionServer(Serving):
    def start(self, request: CompletionRequest) -> tuple[SamplingParams, list]:
        """Validates and queues the request (raising before anything runs)."""
        if request.echo and request.logprobs is not None:
            raise ValueError("echo with logprobs is not supported; prompt_logprobs gives the "
                             "prompt tokens' logprobs")
        params = request.sampling_params(request.max_tokens, request.logprobs,
                                         request.prompt_logprobs)
        return params, self.llm.add_requests(prompts_of(request), params)

    def _echo(self, request: CompletionRequest, out: RequestOutput) -> str:
        if not request.echo:
            return ""
        if out.prompt is not None:
            return out.prompt
        return self.llm.inputs.tokenizer.decode(out.prompt_token_ids)

    async def full(self, request: CompletionRequest) -> dict[str, Any]:
        params, streams = self.start(request)
        outputs = await collect(streams)
        choices = []
        for i, out in enumerate(outputs):
            echo = self._echo(request, out)
            for c in out.outputs:
                choices.append({
                    "index": i * params.n + c.index, "text": echo + c.text,
                    "logprobs": self._logprobs(c, 0, len(c.token_ids)),
                    "finish_reason": finish_reason(c), **prompt_logprobs_field(out)})
        return {"id": new_id("cmpl"), "object": "text_completion", "created": now(),
                "model": self.model_name, "choices": choices, "usage": usage(outputs)}

    def stream(self, request: CompletionRequest) -> AsyncIterator[str]:
        """Validates and queues now; the events follow as the engine steps."""
        params, streams = self.start(request)
        return self._events(request, params, streams)

    async def _events(self, request: CompletionRequest, params: SamplingParams,
                      streams: list) -> AsyncIterator[str]:
        head = {"id": new_id("cmpl"), "object": "text_completion", "created": now(),
                "model": self.model_name}
        tracker = DeltaTracker(stop_hold(params.stop))
        final: dict[int, RequestOutput] = {}
        async with aclosing(merge(streams)) as outputs:
            async for i, out in outputs:
                for c in out.outputs:
                    delta = tracker.delta(i, c)
                    if delta is None:
                        continue
                    text, first, end = delta
                    if first == 0:
                        text = self._echo(request, out) + text
                    choice = {"index": i * params.n + c.index, "text": text,
                              "logprobs": self._logprobs(c, first, end),
                              "finish_reason": finish_reason(c),
                              **(prompt_logprobs_field(out) if first == 0 else {})}
                    yield sse({**head, "choices": [choice]})
                if out.finished:
                    final[i] = out
        if request.include_usage:
            yield sse({**head, "choices": [], "usage": usage(list(final.values()))})
        yield sse("[DONE]")

    def _logprobs(self, c: CompletionOutput, start: int, end: int) -> dict[str, Any] | None:
        """OpenAI's legacy completions layout for tokens [start, end)."""
        if c.logprobs is None:
            return None
        decode = self.llm.inputs.tokenizer.decode
        tokens = [decode([t]) for t in c.token_ids[start:end]]
        offsets, position = [], len(decode(c.token_ids[:start]))
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [c.logprobs[k][c.token_ids[k]].logprob for k in range(start, end)],
            "top_logprobs": [{(e.decoded_token or ""): e.logprob for e in c.logprobs[k].values()}
                             for k in range(start, end)],
            "text_offset": offsets,
        }
