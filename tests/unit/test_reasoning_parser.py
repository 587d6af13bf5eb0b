"""The reasoning parsers: a model's <think> block apart from its answer, done and while it
runs (where a tag may still be forming)."""

from __future__ import annotations

import pytest

from kvserve.entrypoints.openai.reasoning import REASONING_PARSERS


def parts(parser: str, text: str, done: bool = True, free: bool = True) -> tuple[str, str]:
    split = REASONING_PARSERS[parser]().split(text, done, free)
    return text[split.reasoning_start:split.reasoning_end], text[split.answer_start:]


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_think_block_opening_the_output_is_the_reasoning(parser):
    assert parts(parser, "<think>\nplan\n</think>\n\nRome.") == ("\nplan\n", "\n\nRome.")
    assert parts(parser, "<think>plan", done=False) == ("plan", "")
    assert parts(parser, "<think>plan</thi", done=False) == ("plan", "")  # may close
    assert parts(parser, "<thi", done=False) == ("", "")  # may open
    assert parts(parser, "<think>cut short") == ("cut short", "")


def test_qwen3_answers_without_a_block():
    assert parts("qwen3", "Rome.") == ("", "Rome.")
    assert parts("qwen3", "Ro", done=False) == ("", "Ro")
    assert parts("qwen3", "<th") == ("", "<th")  # done: it never opened


def test_deepseek_r1_thinks_from_the_prompts_open_tag():
    assert parts("deepseek_r1", "plan</think>Rome.") == ("plan", "Rome.")
    assert parts("deepseek_r1", "plan, then more") == ("plan, then more", "")
    assert parts("deepseek_r1", "plan</", done=False) == ("plan", "")
    # Held to a grammar, the output has no room to think but in a block it writes.
    assert parts("deepseek_r1", '{"city":"Rome"}', free=False) == ("", '{"city":"Rome"}')
