"""POST /v1/chat/completions: messages through the checkpoint's chat template."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from kvserve.entrypoints.async_llm import RequestStream
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
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
from kvserve.outputs import CompletionOutput, Logprob
from kvserve.sampling_params import SamplingParams


class ChatServer(Serving):
    def start(self, request: ChatCompletionRequest) -> tuple[SamplingParams, RequestStream]:
        """Validates and queues the request; returns its sampling params and its stream."""
        if request.tools or request.tool_choice not in (None, "none"):
            raise ValueError("tools (and tool_choice) are not supported: function calling "
                             "is not implemented")
        if request.top_logprobs is not None and not request.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        max_tokens = (request.max_completion_tokens if request.max_completion_tokens is not None
                      else request.max_tokens)
        params = request.sampling_params(
            max_tokens, (request.top_logprobs or 0) if request.logprobs else None)
        ids = self.llm.inputs.apply_chat_template(
            [m.template_dict() for m in request.messages], request.add_generation_prompt)
        stream = self.llm.add_requests([request.engine_prompt({"prompt_token_ids": ids})],
                                       params)[0]
        return params, stream

    async def full(self, request: ChatCompletionRequest) -> dict[str, Any]:
        _, stream = self.start(request)
        [out] = await collect([stream])
        choices = [{"index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(request, c, 0, len(c.token_ids)),
                    "finish_reason": finish_reason(c)} for c in out.outputs]
        return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(),
                "model": self.model_name, "choices": choices, "usage": usage([out])}

    def stream(self, request: ChatCompletionRequest) -> AsyncIterator[str]:
        """Validates and queues now; the events follow as the engine steps."""
        params, stream = self.start(request)
        return self._events(request, params, stream)

    async def _events(self, request: ChatCompletionRequest, params: SamplingParams,
                      stream: RequestStream) -> AsyncIterator[str]:
        head = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": now(),
                "model": self.model_name}
        for index in range(params.n):
            yield sse({**head, "choices": [{"index": index,
                                            "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        tracker = DeltaTracker(stop_hold(params.stop))
        last = None
        async with aclosing(merge([stream])) as outputs:
            async for _, out in outputs:
                last = out
                for c in out.outputs:
                    delta = tracker.delta(0, c)
                    if delta is None:
                        continue
                    text, first, end = delta
                    yield sse({**head, "choices": [{
                        "index": c.index, "delta": {"content": text} if text else {},
                        "logprobs": self._logprobs(request, c, first, end),
                        "finish_reason": finish_reason(c)}],
                        **({"usage": usage([out])} if request.continuous_usage else {})})
        if request.include_usage and last is not None:
            yield sse({**head, "choices": [], "usage": usage([last])})
        yield sse("[DONE]")

    def _logprobs(self, request: ChatCompletionRequest, c: CompletionOutput, start: int,
                  end: int) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        top = request.top_logprobs or 0
        decode = self.llm.inputs.tokenizer.decode

        def entry(token_id: int, lp: Logprob) -> dict[str, Any]:
            token = lp.decoded_token if lp.decoded_token is not None else decode([token_id])
            return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

        content = []
        for k in range(start, end):
            sampled = c.token_ids[k]
            ranked = sorted((lp.rank, t) for t, lp in c.logprobs[k].items() if lp.rank <= top)
            content.append({**entry(sampled, c.logprobs[k][sampled]),
                            "top_logprobs": [entry(t, c.logprobs[k][t]) for _, t in ranked]})
        return {"content": content}
