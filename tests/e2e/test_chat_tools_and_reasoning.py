"""Function calling and reasoning through the server, driven by the `openai` package: a
named function and "required" held to the tools' schemas, "auto" parsed from the model's own
`<tool_call>` blocks (hermes), a <think> block returned as reasoning_content (qwen3), streamed
and not, the template's own variables, and a conversation that carries calls and their
results back. The model has random weights, so free outputs are steered with vLLM's
guided_regex into what a model trained for tools and thinking would write."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from kvserve import LLM
from kvserve.entrypoints.openai.launch import server_process

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "Weather in Rome?"}]
CALL_TEXT = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Rome", "days": 2}}\n</tool_call>')


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[str]:
    flags = ["--served-model-name", MODEL, "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    with server_process(str(llama_dir), flags, timeout=300) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def check_calls(tool_calls, names: set[str]) -> None:  # noqa: ANN001
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client: openai.OpenAI, **request: object) -> tuple[str, list, str | None, str]:
    """A streamed choice's content, tool calls (accumulated by index, as clients do), finish
    reason and reasoning."""
    content, calls, finish, reasoning = "", {}, None, ""
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            for call in choice.delta.tool_calls or []:
                calls.setdefault(call.index, call)
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, reasoning


def test_a_named_function_gets_arguments_that_fit_its_schema(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                          tool_choice=choice, n=4, max_tokens=40)
    for c in chat.choices:
        assert c.finish_reason == "stop" and not c.message.content
        check_calls(c.message.tool_calls, {"get_weather"})
        assert len(c.message.tool_calls) == 1
    content, calls, finish, _ = streamed(client, messages=ASK, tools=[WEATHER],
                                         tool_choice=choice, max_tokens=40)
    assert content == "" and finish == "stop"
    check_calls(calls, {"get_weather"})


def test_required_gets_calls_of_the_tools(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                          tool_choice="required", n=4, max_tokens=120)
    for c in chat.choices:
        assert c.finish_reason == "tool_calls"
        check_calls(c.message.tool_calls, {"get_weather", "get_time"})
    single = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", n=4,
        max_tokens=60, parallel_tool_calls=False)
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)


def test_auto_parses_the_models_tool_call_blocks(client: openai.OpenAI) -> None:
    steer = {"guided_regex": re.escape(CALL_TEXT)}
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                          max_tokens=60, extra_body=steer)
    [c] = chat.choices
    assert c.finish_reason == "tool_calls" and c.message.content == "I will check.\n"
    check_calls(c.message.tool_calls, {"get_weather"})
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Rome", "days": 2}
    content, calls, finish, _ = streamed(client, messages=ASK, tools=[WEATHER],
                                         max_tokens=60, extra_body=steer)
    assert content == "I will check.\n" and finish == "tool_calls"  # no markup leaks
    assert [c.function.name for c in calls] == ["get_weather"]
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                           max_tokens=20, extra_body={
                                               "guided_regex": "It is <sunny> [a-z]{3}"})
    [c] = plain.choices
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert re.fullmatch("It is <sunny> [a-z]{3}", c.message.content)


def test_calls_and_results_go_back_through_the_template(server: str,
                                                        client: openai.OpenAI) -> None:
    conversation = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    chat = client.chat.completions.create(model=MODEL, messages=conversation,
                                          tools=[WEATHER], tool_choice="none", max_tokens=4)
    tokenized = httpx.post(f"{server}/tokenize", json={
        "messages": conversation, "tools": [WEATHER]}).json()
    assert chat.usage.prompt_tokens == tokenized["count"]
    text = client.completions.create(model=MODEL, prompt=tokenized["tokens"], max_tokens=1,
                                     echo=True).choices[0].text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}' \
        in text and "<tool_response>\nsunny, 24 C\n</tool_response>" in text
    assert '"name": "get_weather", "description": "The weather in a city"' in text


THOUGHT = "<think>\nRome: look it up.\n</think>\n\n"


def test_a_think_block_comes_back_as_reasoning_content(client: openai.OpenAI) -> None:
    steer = {"guided_regex": re.escape(THOUGHT + "It is sunny.")}
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40,
                                          extra_body=steer)
    message = chat.choices[0].message
    assert message.reasoning_content == "\nRome: look it up.\n"
    assert message.content == "\n\nIt is sunny."
    content, _, finish, reasoning = streamed(client, messages=ASK, max_tokens=40,
                                             extra_body=steer)
    assert (reasoning, content, finish) == (message.reasoning_content, message.content, "stop")
    # Thinking first, then a call: the parser looks for calls in the answer only.
    steer = {"guided_regex": re.escape(THOUGHT + CALL_TEXT)}
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                          max_tokens=80, extra_body=steer)
    [c] = chat.choices
    assert c.message.reasoning_content == "\nRome: look it up.\n"
    assert c.message.content == "\n\nI will check.\n" and c.finish_reason == "tool_calls"
    check_calls(c.message.tool_calls, {"get_weather"})
    content, calls, finish, reasoning = streamed(client, messages=ASK, tools=[WEATHER],
                                                 max_tokens=80, extra_body=steer)
    assert reasoning == c.message.reasoning_content and content == c.message.content
    assert [call.function.name for call in calls] == ["get_weather"]


def test_chat_template_kwargs_reach_the_template(server: str, client: openai.OpenAI) -> None:
    """Qwen3's enable_thinking: false opens the answer with an empty think block."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = httpx.post(f"{server}/tokenize", json={"messages": ASK}).json()
    no_thinking = httpx.post(f"{server}/tokenize", json={"messages": ASK, **off}).json()
    text = client.completions.create(model=MODEL, prompt=no_thinking["tokens"], max_tokens=1,
                                     echo=True).choices[0].text
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n" in text
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                          extra_body=off)
    assert chat.usage.prompt_tokens == no_thinking["count"] > plain["count"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}], "tool_choice": "required"}, "tools.0.function.parameters",
     "objekt"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "tool_choice", "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
     "tools.0.function.name", "pattern"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{oops"}}]}]}, "messages", "JSON object"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs", "'tokenize'"),
])
def test_bad_tool_requests_name_the_field(server: str, body: dict, param: str,
                                          words: str) -> None:
    response = httpx.post(f"{server}/v1/chat/completions",
                          json={"messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_a_template_without_tools_is_refused(llama_dir: Path) -> None:
    """The model would never see tools its chat template leaves out."""
    llm = LLM(str(llama_dir))
    llm.engine.inputs.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
    with pytest.raises(ValueError, match="^tools: the model's chat template does not show"):
        llm.chat(ASK, tools=[WEATHER])
    assert llm.chat(ASK, use_tqdm=False)[0].outputs  # without tools it serves
