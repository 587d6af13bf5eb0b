"""A reasoning model's thinking apart from its answer (vLLM's `--reasoning-parser`): what the
model writes between `<think>` and `</think>` comes back as the message's
`reasoning_content`, the rest as its `content` (where tool calls are then looked for).

- `qwen3`: thinking is a `<think>...</think>` block that opens the output; an output that
  does not open with one is all answer (Qwen3 with `enable_thinking` off, through
  `chat_template_kwargs`, writes none);
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the output is thinking up
  to `</think>` (all of it, where it ends before one).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.entrypoints.openai.serving import partial_tag

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    """Of an output so far: the thinking, text[reasoning_start:reasoning_end] (empty where
    there is none), and the answer, text[answer_start:]."""

    reasoning_start: int
    reasoning_end: int
    answer_start: int


class ThinkParser:
    def __init__(self, opened_in_prompt: bool) -> None:
        self.opened_in_prompt = opened_in_prompt

    def split(self, text: str, done: bool, free: bool = True) -> ReasoningSplit:
        """While the output runs, characters that may still open or close the thinking
        belong to neither part yet. `free`: no grammar holds the output; one that does
        leaves no room to think but in a block it writes itself, whatever the prompt
        opened."""
        if text.startswith(THINK_START):
            start = len(THINK_START)
        elif not done and THINK_START.startswith(text):  # may still open (or repeat) it
            return ReasoningSplit(0, 0, len(text))
        elif self.opened_in_prompt and free:
            start = 0
        else:
            return ReasoningSplit(0, 0, 0)
        end = text.find(THINK_END, start)
        if end >= 0:
            return ReasoningSplit(start, end, end + len(THINK_END))
        if done:
            return ReasoningSplit(start, len(text), len(text))
        return ReasoningSplit(start, len(text) - partial_tag(text, THINK_END, start),
                              len(text))


REASONING_PARSERS = {"qwen3": lambda: ThinkParser(opened_in_prompt=False),
                     "deepseek_r1": lambda: ThinkParser(opened_in_prompt=True)}
