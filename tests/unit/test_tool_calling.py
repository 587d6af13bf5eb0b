"""Function calling's pieces: the parsers that find calls in a model's own format, and the
plan a request's tools and tool_choice make (what the output is held to, what it becomes)."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
from kvserve.entrypoints.openai.tool_calling import (
    AUTO,
    NAMED,
    NONE,
    REQUIRED,
    FoundCall,
    HermesParser,
    Llama3JsonParser,
    plan_tools,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_hermes_finds_calls_after_content():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    parsed = HermesParser().parse(text)
    assert text[:parsed.content_end] == "Let me look.\n"
    assert parsed.calls == [FoundCall("get_weather", '{"city": "Rome"}'),
                            FoundCall("get_time", "{}")]
    # The last call's closing tag may be missing where the output stopped at it.
    assert HermesParser().parse(text.removesuffix("</tool_call>")).calls == parsed.calls


@pytest.mark.parametrize("text", [
    "no call here",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # cut JSON
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": "x"}\n</tool_call>',  # arguments not an object
])
def test_hermes_markup_without_well_formed_calls_is_all_content(text):
    parsed = HermesParser().parse(text)
    assert parsed.calls == [] and parsed.content_end == len(text)


def test_hermes_streams_content_up_to_what_may_begin_a_call():
    parser = HermesParser()
    assert parser.plain_prefix("Sure thing") == len("Sure thing")
    assert parser.plain_prefix("Sure <tool") == len("Sure ")  # may become <tool_call>
    assert parser.plain_prefix("Sure <tooth") == len("Sure <tooth")  # cannot
    assert parser.plain_prefix('Sure <tool_call>\n{"na') == len("Sure ")


def test_llama3_json_finds_one_or_several_calls():
    parser = Llama3JsonParser()
    one = parser.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert one.calls == [FoundCall("get_weather", '{"city": "Paris"}')]
    two = parser.parse('<|python_tag|>{"name": "get_time", "parameters": {}}; '
                       '{"name": "get_weather", "arguments": {"city": "Rome"}}')
    assert two.content_end == 0
    assert [c.name for c in two.calls] == ["get_time", "get_weather"]
    prose = "The weather is fine."
    assert parser.parse(prose).calls == [] and parser.plain_prefix(prose) == len(prose)
    assert parser.parse('{"name": "f", "parameters": {}} and then').calls == []
    assert parser.plain_prefix('  {"name"') == 0 and parser.plain_prefix("<|python") == 0


def test_tool_choice_defaults_to_auto_with_tools_and_auto_needs_a_parser():
    assert plan_tools(request(), None).mode == NONE
    with pytest.raises(ValueError, match='^tool_choice: "auto" needs a server started with '
                                         "--enable-auto-tool-choice"):
        plan_tools(request(tools=[WEATHER]), None)
    plan = plan_tools(request(tools=[WEATHER]), HermesParser())
    assert plan.mode == AUTO and plan.constraint is None
    # Whatever the choice, the template shows the tools (OpenAI's form).
    assert request(tools=[WEATHER]).template_tools() == [WEATHER]
    none = request(tools=[WEATHER], tool_choice="none")
    assert plan_tools(none, None).mode == NONE and none.template_tools() == [WEATHER]


def test_a_named_function_holds_the_output_to_its_parameters():
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), None)
    assert plan.mode == NAMED
    assert plan.constraint.json == WEATHER["function"]["parameters"]
    assert plan.parse('{"city":"Paris"}', None).calls == [
        FoundCall("get_weather", '{"city":"Paris"}')]
    untyped = plan_tools(request(tools=[TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}}), None)
    assert untyped.constraint.json == {"type": "object"}


def test_required_holds_the_output_to_an_array_of_the_tools_calls():
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"), None)
    assert plan.mode == REQUIRED
    assert plan.constraint.json["minItems"] == 1 and "maxItems" not in plan.constraint.json
    names = [option["properties"]["name"]["const"]
             for option in plan.constraint.json["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    text = json.dumps([{"name": "get_time", "parameters": {}},
                       {"name": "get_weather", "parameters": {"city": "Rome"}}])
    assert plan.parse(text, None).calls == [FoundCall("get_time", "{}"),
                                            FoundCall("get_weather", '{"city": "Rome"}')]
    assert plan.parse(text[:-3], None).calls == []  # cut short: text
    single = plan_tools(request(tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False), None)
    assert single.constraint.json["maxItems"] == 1


@pytest.mark.parametrize(("fields", "message"), [
    ({"tool_choice": "required"}, "^tool_choice: needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "^tool_choice: function 'f' is not among tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"},
     "^tool_choice: a named function or \"required\" sets the output's format"),
    ({"tools": [TIME, {"type": "function", "function": {
        "name": "g", "parameters": {"type": "objekt"}}}], "tool_choice": "required"},
     "^tools.1.function.parameters: "),
])
def test_tool_requests_that_cannot_be_honoured_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        plan_tools(request(**fields), HermesParser())
