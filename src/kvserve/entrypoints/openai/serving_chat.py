"""POST /v1/chat/completions: messages (and function tools) through the checkpoint's chat
template; a <think> block in the output becomes `reasoning_content` (`reasoning.py`) and
calls in the rest `tool_calls` (`tool_calling.py`)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from kvserve.entrypoints.async_llm import RequestStream
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
from kvserve.entrypoints.openai.reasoning import REASONING_PARSERS
from kvserve.entrypoints.openai.serving import (
    Serving,
    ServingBackend,
    collect,
    finish_reason,
    merge,
    new_id,
    now,
    sse,
    stop_hold,
    usage,
)
from kvserve.entrypoints.openai.tool_calling import (
    AUTO,
    REQUIRED,
    TOOL_CALL_PARSERS,
    FoundCall,
    ToolPlan,
    plan_tools,
)
from kvserve.outputs import CompletionOutput, Logprob
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChoiceView:
    """What a choice's output so far makes of its message: the thinking (None without a
    reasoning parser), the content a stream may send, and, once done, the tool calls."""

    reasoning: str | None
    content: str
    calls: list[FoundCall]


@dataclass
class ChoiceProgress:
    """How much of a streamed choice is out."""

    reasoning: int = 0
    content: int = 0
    tokens: int = 0
    finished: bool = False


class ChatServer(Serving):
    def __init__(self, llm: ServingBackend, model_name: str,
                 tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        """`tool_call_parser` (one of TOOL_CALL_PARSERS) turns on tool_choice "auto";
        `reasoning_parser` (one of REASONING_PARSERS) returns the thinking apart."""
        super().__init__(llm, model_name)
        self.parser = TOOL_CALL_PARSERS[tool_call_parser]() if tool_call_parser else None
        self.reasoning = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None

    def start(self, request: ChatCompletionRequest
              ) -> tuple[SamplingParams, ToolPlan, RequestStream]:
        """Validates and queues the request; returns its sampling params, its tool plan and
        its stream."""
        if request.top_logprobs is not None and not request.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        plan = plan_tools(request, self.parser)
        max_tokens = (request.max_completion_tokens if request.max_completion_tokens is not None
                      else request.max_tokens)
        params = request.sampling_params(
            self.llm.inputs.sampling_defaults, max_tokens,
            (request.top_logprobs or 0) if request.logprobs else None,
            structured_output=plan.constraint)
        if plan.mode == AUTO and self.parser.keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        ids = request.prompt_token_ids(self.llm.inputs)
        stream = self.llm.add_requests([request.engine_prompt({"prompt_token_ids": ids})],
                                       params)[0]
        return params, plan, stream

    async def full(self, request: ChatCompletionRequest) -> dict[str, Any]:
        params, plan, stream = self.start(request)
        [out] = await collect([stream])
        choices = []
        for c in out.outputs:
            view = self._view(c, params, plan, hold=0)
            message: dict[str, Any] = {"role": "assistant", "content": view.content}
            if self.reasoning is not None:
                message["reasoning_content"] = view.reasoning
            if view.calls:
                message["content"] = view.content if view.content.strip() else None
                message["tool_calls"] = [call.as_tool_call() for call in view.calls]
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(request, c, 0, len(c.token_ids)),
                            "finish_reason": _finish_reason(c, plan, view)})
        return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(),
                "model": self.model_name, "choices": choices, "usage": usage([out])}

    def stream(self, request: ChatCompletionRequest) -> AsyncIterator[str]:
        """Validates and queues now; the events follow as the engine steps."""
        params, plan, stream = self.start(request)
        return self._events(request, params, plan, stream)

    async def _events(self, request: ChatCompletionRequest, params: SamplingParams,
                      plan: ToolPlan, stream: RequestStream) -> AsyncIterator[str]:
        """Thinking and content stream as they are decoded, but for what may still belong to
        a stop string, a think tag or a tool call: the calls come whole in the choice's last
        chunk, once the output is done."""
        head = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": now(),
                "model": self.model_name}
        for index in range(params.n):
            yield sse({**head, "choices": [{"index": index,
                                            "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        hold = stop_hold(params.stop)
        progress = [ChoiceProgress() for _ in range(params.n)]
        last = None
        async with aclosing(merge([stream])) as outputs:
            async for _, out in outputs:
                last = out
                for c in out.outputs:
                    sent = progress[c.index]
                    if sent.finished:
                        continue
                    view = self._view(c, params, plan, hold)
                    fields: dict[str, Any] = {}
                    if view.reasoning is not None and len(view.reasoning) > sent.reasoning:
                        fields["reasoning_content"] = view.reasoning[sent.reasoning:]
                        sent.reasoning = len(view.reasoning)
                    if len(view.content) > sent.content:
                        fields["content"] = view.content[sent.content:]
                        sent.content = len(view.content)
                    if view.calls:
                        fields["tool_calls"] = [call.as_tool_call(i)
                                                for i, call in enumerate(view.calls)]
                    sent.finished = c.finish_reason is not None
                    if not fields and not sent.finished:
                        continue
                    first, sent.tokens = sent.tokens, len(c.token_ids)
                    yield sse({**head, "choices": [{
                        "index": c.index, "delta": fields,
                        "logprobs": self._logprobs(request, c, first, sent.tokens),
                        "finish_reason": _finish_reason(c, plan, view)}],
                        **({"usage": usage([out])} if request.continuous_usage else {})})
        if request.include_usage and last is not None:
            yield sse({**head, "choices": [], "usage": usage([last])})
        yield sse("[DONE]")

    def _view(self, c: CompletionOutput, params: SamplingParams, plan: ToolPlan,
              hold: int) -> ChoiceView:
        """The choice's message so far; `hold`: the characters a running output keeps back
        for a stop string that may be forming."""
        done = c.finish_reason is not None
        text = c.text if done else c.text[:max(0, len(c.text) - hold)]
        reasoning, answer = None, text
        if self.reasoning is not None:
            split = self.reasoning.split(text, done, free=params.structured_output is None)
            reasoning = text[split.reasoning_start:split.reasoning_end]
            answer = text[split.answer_start:]
        if not done:
            return ChoiceView(reasoning, answer[:plan.plain_prefix(answer, self.parser)], [])
        parsed = plan.parse(answer, self.parser)
        if not parsed.calls:
            return ChoiceView(reasoning, answer, [])
        return ChoiceView(reasoning, answer[:parsed.content_end], parsed.calls)

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


def _finish_reason(c: CompletionOutput, plan: ToolPlan, view: ChoiceView) -> str | None:
    """Where the model chose to call (auto, required) and stopped by itself, "tool_calls"; a
    named function's call is the answer asked for, so it stops as text does."""
    if view.calls and plan.mode in (AUTO, REQUIRED) and c.finish_reason == "stop":
        return "tool_calls"
    return finish_reason(c)
