"""Function calling in /v1/chat/completions, as OpenAI's API and vLLM's server have it.

The request's `tools` go to the chat template, which shows them to the model. What
`tool_choice` asks for decides how the output becomes `tool_calls`:
- "none": the output is text;
- a named function: the output is held to that function's parameter schema (structured
  output) and becomes its arguments;
- "required": the output is held to a JSON array of calls, `[{"name": ..., "parameters":
  {...}}, ...]`, each name one of the tools' and its parameters that tool's schema (one call
  only with `parallel_tool_calls: false`);
- "auto": the model writes calls, or not, in its own format, which a parser the server names
  (`--tool-call-parser`) finds in the text: `hermes` (`<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`, Hermes and Qwen2.5/Qwen3 models) or `llama3_json` (the
  whole output `{"name": ..., "parameters": {...}}`, calls separated by `;`, Llama 3.1+).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatTool
from kvserve.entrypoints.openai.serving import partial_tag
from kvserve.sampling_params import StructuredOutputParams

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"


@dataclass(frozen=True)
class FoundCall:
    name: str
    arguments: str  # a JSON object, as text

    def as_tool_call(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry (a streamed delta's carries its `index`)."""
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ParsedOutput:
    content_end: int  # the text before this index is the message's content
    calls: list[FoundCall]


class ToolCallParser(Protocol):
    # Whether the output keeps its special tokens (skip_special_tokens off) under "auto":
    # some tokenizers make the call markup special tokens, which decoding would drop.
    keeps_special_tokens: bool

    def parse(self, text: str) -> ParsedOutput:
        """The calls in a finished output; none (and all of it content) where its markup
        does not hold well-formed calls."""

    def plain_prefix(self, text: str) -> int:
        """How much of a running output cannot belong to a call: what a stream may send as
        content now."""


def _call(value: object, arguments_key: str) -> FoundCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return FoundCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after any content
    (the closing tag of the last may be missing where the output stopped at it)."""

    START = "<tool_call>"
    keeps_special_tokens = True  # <tool_call> is one in Hermes 2 Pro's tokenizer
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.START)
        if start < 0:
            return ParsedOutput(len(text), [])
        calls = []
        for block in self.BLOCK.finditer(text, start):
            try:
                call = _call(json.loads(block.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedOutput(len(text), [])
            calls.append(call)
        return ParsedOutput(start, calls)

    def plain_prefix(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        return len(text) - partial_tag(text, self.START)


class Llama3JsonParser:
    """The whole output as calls `{"name": ..., "parameters": {...}}` (or "arguments"),
    separated by `;`, maybe after Llama's `<|python_tag|>`."""

    TAG = "<|python_tag|>"
    keeps_special_tokens = False  # the tag, a special token, may go: the JSON is the call

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return ParsedOutput(len(text), [])
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                value, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return ParsedOutput(len(text), [])
            call = _call(value, "parameters" if "parameters" in value else "arguments") \
                if isinstance(value, dict) else None
            if call is None:
                return ParsedOutput(len(text), [])
            calls.append(call)
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return ParsedOutput(0, calls)

    def plain_prefix(self, text: str) -> int:
        body = text.lstrip()
        if not body or self.TAG.startswith(body) or body.startswith(("{", self.TAG)):
            return 0
        return len(text)


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools make of its output."""

    mode: str  # NONE, AUTO, REQUIRED or NAMED
    constraint: StructuredOutputParams | None  # REQUIRED and NAMED: the calls' grammar
    name: str | None = None  # NAMED: the function
    parallel: bool = True

    def parse(self, text: str, parser: ToolCallParser | None) -> ParsedOutput:
        """The calls in a finished output."""
        if self.mode == NAMED:
            return ParsedOutput(0, [FoundCall(self.name, text)])
        if self.mode == REQUIRED:
            try:
                values = json.loads(text)
            except json.JSONDecodeError:  # cut short (finish_reason "length")
                return ParsedOutput(len(text), [])
            # The grammar admits only an array of well-formed calls.
            return ParsedOutput(0, [_call(v, "parameters") for v in values])
        if self.mode == AUTO:
            parsed = parser.parse(text)
            return parsed if self.parallel else ParsedOutput(parsed.content_end,
                                                             parsed.calls[:1])
        return ParsedOutput(len(text), [])

    def plain_prefix(self, text: str, parser: ToolCallParser | None) -> int:
        """How much of a running output a stream may send as content now."""
        if self.mode == AUTO:
            return parser.plain_prefix(text)
        return len(text) if self.mode == NONE else 0


def plan_tools(request: ChatCompletionRequest, parser: ToolCallParser | None) -> ToolPlan:
    """The request's tool plan; a ValueError names the field that cannot be honoured."""
    choice = request.tool_choice
    if choice is None:
        choice = AUTO if request.tools else NONE
    if choice == NONE:
        return ToolPlan(NONE, None)
    if not request.tools:
        raise ValueError("tool_choice: needs tools to choose from")
    if choice == AUTO:
        if parser is None:
            raise ValueError('tool_choice: "auto" needs a server started with '
                             '--enable-auto-tool-choice and --tool-call-parser; name a '
                             'function, or use "required" or "none"')
        return ToolPlan(AUTO, None, parallel=request.parallel_tool_calls)
    if request.structured_output() is not None:
        raise ValueError("tool_choice: a named function or \"required\" sets the output's "
                         "format, so response_format and guided_* cannot be given with it")
    parameters = {tool.function.name: _parameters(tool, i)
                  for i, tool in enumerate(request.tools)}
    if choice == REQUIRED:
        one_of = [{"type": "object", "properties": {"name": {"const": name},
                                                    "parameters": grammar.json},
                   "required": ["name", "parameters"], "additionalProperties": False}
                  for name, grammar in parameters.items()]
        array = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
        if not request.parallel_tool_calls:
            array["maxItems"] = 1
        return ToolPlan(REQUIRED, StructuredOutputParams(json=array))
    name = choice.function.name
    if name not in parameters:
        raise ValueError(f"tool_choice: function {name!r} is not among tools "
                         f"{sorted(parameters)}")
    return ToolPlan(NAMED, parameters[name], name=name)


def _parameters(tool: ChatTool, index: int) -> StructuredOutputParams:
    """The grammar of the tool's parameter schema (any object where it gives none),
    compiled on its own so that an error names the tool."""
    try:
        return StructuredOutputParams(json=tool.function.parameters or {"type": "object"})
    except ValueError as e:
        raise ValueError(f"tools.{index}.function.parameters: {e}") from None
