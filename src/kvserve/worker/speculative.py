"""Drafts the tokens a decode step verifies besides its own (speculative decoding).

Prompt lookup (n-gram): the sequence's last n tokens, for n from `prompt_lookup_max` down to
`prompt_lookup_min`, are looked up earlier in the sequence (prompt and output); the tokens
that followed their latest earlier occurrence are the drafts. It costs no model, and pays off
where outputs repeat their context: code edits, extraction, summaries, loops.

Only requests whose next token depends on nothing but the logits draft: no penalties (they
change with every token), no grammar, no logprobs, min_tokens reached.
"""

from __future__ import annotations

import numpy as np

from kvserve.config import SpeculativeConfig
from kvserve.worker.sampler import SamplingState


class Drafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._tokens: dict[str, _TokenHistory] = {}

    def propose(self, request_ids: list[str], states: list[SamplingState]
                ) -> dict[str, list[int]]:
        """Request id -> the drafts for its next step, for the requests that have any."""
        cfg = self.config
        drafts = {}
        for request_id, state in zip(request_ids, states, strict=True):
            if not can_draft(state):
                continue
            history = self._tokens.get(request_id)
            if history is None:
                history = self._tokens[request_id] = _TokenHistory(state.prompt_token_ids)
            found = lookup_ngram(history.extend(state.output_token_ids),
                                 cfg.num_speculative_tokens, cfg.prompt_lookup_min,
                                 cfg.prompt_lookup_max)
            if found:
                drafts[request_id] = found
        return drafts

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)


class _TokenHistory:
    """A request's tokens as a numpy array, grown in place as outputs come."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.num_prompt = len(prompt_token_ids)
        self.buffer = np.empty(max(2 * self.num_prompt, 64), dtype=np.int64)
        self.buffer[:self.num_prompt] = prompt_token_ids
        self.length = self.num_prompt

    def extend(self, output_token_ids: list[int]) -> np.ndarray:
        """The prompt and `output_token_ids` (the outputs seen so far, and new ones)."""
        end = self.num_prompt + len(output_token_ids)
        if end > len(self.buffer):
            grown = np.empty(2 * end, dtype=np.int64)
            grown[:self.length] = self.buffer[:self.length]
            self.buffer = grown
        self.buffer[self.length:end] = output_token_ids[self.length - self.num_prompt:]
        self.length = end
        return self.buffer[:end]


def can_draft(state: SamplingState) -> bool:
    """Whether the request's next tokens depend on the logits alone."""
    return (state.params.allows_drafts
            and len(state.output_token_ids) >= state.params.min_tokens)


def lookup_ngram(tokens: np.ndarray, num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_drafts` tokens that followed the latest earlier occurrence of the longest
    suffix of `tokens` (between `min_n` and `max_n` long) that occurred before."""
    last = len(tokens) - 1
    # Earlier positions that end a match of the suffix's last 1, 2, ... tokens.
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    best = None
    for n in range(1, max_n):
        if n >= min_n and len(ends):
            best = ends
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[last - n]]
        if not len(ends):
            break
    else:
        best = ends
    if best is None or not len(best):
        return []
    start = int(best[-1]) + 1
    return tokens[start:start + num_drafts].tolist()
