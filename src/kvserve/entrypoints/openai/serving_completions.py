"""POST /v1/completions: one or many prompts, `n` completions each, streamed or not."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from itertools import accumulate
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
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import SamplingParams


def prompts_of(request: CompletionRequest) -> list[dict[str, Any]]:
    prompt = request.prompt
    if request.segments is not None:
        if prompt is not None:
            raise ValueError("segments: give prompt or segments, not both")
        return [request.engine_prompt({"segments": request.segments})]
    if prompt is None:
        raise ValueError("prompt is required (or kvserve's segments)")
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


def prompt_only(out: RequestOutput) -> RequestOutput:
    """`echo` with `max_tokens: 0` scores the prompt: the engine samples one token, which the
    answer leaves out."""
    return dataclasses.replace(out, outputs=[dataclasses.replace(
        c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
        finish_reason="length" if c.finish_reason in ("stop", "length") else c.finish_reason,
        stop_reason=None) for c in out.outputs])


def legacy_logprobs(decode: Callable[[list[int]], str],
                    scored: list[tuple[int, dict[int, Logprob] | None]],
                    offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions layout for (token id, its logprobs) pairs whose text starts
    at character `offset`; None stands for the prompt's first token, which nothing predicts."""
    tokens = [decode([t]) for t, _ in scored]
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e[t].logprob for t, e in scored],
        "top_logprobs": [None if e is None else {(x.decoded_token or ""): x.logprob
                                                 for x in e.values()} for _, e in scored],
        "text_offset": list(accumulate((len(t) for t in tokens[:-1]), initial=offset))
        if tokens else [],
    }


class CompletionServer(Serving):
    def start(self, request: CompletionRequest) -> tuple[SamplingParams, list]:
        """Validates and queues the request (raising before anything runs).

        With `echo`, `logprobs` covers the prompt's tokens too (as OpenAI's legacy API and
        vLLM do: what lm-evaluation-harness scores answers with), and `max_tokens: 0` returns
        the scored prompt alone."""
        if request.suffix:
            raise ValueError("suffix is not supported: no fill-in-the-middle format is known "
                             "for the served model")
        if request.best_of is not None and request.best_of != request.n:
            raise ValueError(f"best_of is not supported (every sampled choice is returned: "
                             f"use n), got {request.best_of}")
        if request.max_tokens == 0 and not request.echo:
            raise ValueError("max_tokens must be >= 1 (0 only with echo, which scores the "
                             "prompt), got 0")
        prompt_logprobs = request.prompt_logprobs
        if request.echo and prompt_logprobs is None:
            prompt_logprobs = request.logprobs
        params = request.sampling_params(self.llm.inputs.sampling_defaults,
                                         1 if request.echo_only else request.max_tokens,
                                         request.logprobs, prompt_logprobs)
        return params, self.llm.add_requests(prompts_of(request), params)

    def _echo(self, request: CompletionRequest, out: RequestOutput) -> str:
        if not request.echo:
            return ""
        if out.prompt is not None:
            return out.prompt
        return self.llm.inputs.tokenizer.decode(out.prompt_token_ids)

    def _choice(self, request: CompletionRequest, out: RequestOutput, c: CompletionOutput,
                text: str, start: int, end: int) -> dict[str, Any]:
        """One choice (or a streamed chunk of one) carrying generated tokens [start, end);
        the first also carries the echoed prompt and its logprobs."""
        # A later chunk needs the echo's length only for its logprobs' offsets.
        echo = self._echo(request, out) if start == 0 or c.logprobs is not None else ""
        choice: dict[str, Any] = {"text": echo + text if start == 0 else text,
                                  "logprobs": None, "finish_reason": finish_reason(c)}
        if c.logprobs is not None:
            decode = self.llm.inputs.tokenizer.decode
            scored = list(zip(c.token_ids[start:end], c.logprobs[start:end], strict=True))
            offset = len(echo) + len(decode(c.token_ids[:start]))
            if start == 0 and echo and out.prompt_logprobs is not None:
                scored = list(zip(out.prompt_token_ids, out.prompt_logprobs,
                                  strict=True)) + scored
                offset = 0
            choice["logprobs"] = legacy_logprobs(decode, scored, offset)
        if start == 0 and request.prompt_logprobs is not None:
            choice.update(prompt_logprobs_field(out))
        return choice

    async def full(self, request: CompletionRequest) -> dict[str, Any]:
        params, streams = self.start(request)
        outputs = await collect(streams)
        if request.echo_only:
            outputs = [prompt_only(out) for out in outputs]
        choices = [{"index": i * params.n + c.index,
                    **self._choice(request, out, c, c.text, 0, len(c.token_ids))}
                   for i, out in enumerate(outputs) for c in out.outputs]
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
        latest: dict[int, RequestOutput] = {}
        async with aclosing(merge(streams)) as outputs:
            async for i, out in outputs:
                if request.echo_only:
                    out = prompt_only(out)
                latest[i] = out
                for c in out.outputs:
                    delta = tracker.delta(i, c)
                    if delta is None:
                        continue
                    text, first, end = delta
                    choice = self._choice(request, out, c, text, first, end)
                    yield sse({**head, "choices": [{"index": i * params.n + c.index,
                                                    **choice}],
                               **({"usage": usage(list(latest.values()))}
                                  if request.continuous_usage else {})})
        if request.include_usage:
            yield sse({**head, "choices": [], "usage": usage(list(latest.values()))})
        yield sse("[DONE]")
