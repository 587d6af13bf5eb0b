"""Incremental detokenization that never emits a broken UTF-8 character, plus stop strings."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text, one delta at a time.

    Only the tokens since `prefix_offset` are decoded each step, so the cost stays flat as
    the output grows. Text that ends in U+FFFD (an incomplete multi-byte character) is held
    back until the next token completes it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool,
                 stop: list[str], check_stop_after: int) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.check_stop_after = check_stop_after
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def __getstate__(self) -> dict:
        """Pickled without the tokenizer (a migrated request's detokenizer is given the
        destination's own)."""
        return {**self.__dict__, "tokenizer": None}

    def update(self, new_token_ids: list[int]) -> str | None:
        """Appends tokens and extends `text`; returns the stop string hit, if any (the text is
        then cut just before it)."""
        self.token_ids.extend(new_token_ids)
        before = len(self.text)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        if not self.stop or len(self.token_ids) <= self.check_stop_after:
            return None
        return self._find_stop(before)

    def _find_stop(self, new_from: int) -> str | None:
        longest = max(len(s) for s in self.stop)
        window_start = max(0, new_from - longest + 1)
        hits = [(self.text.find(s, window_start), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i != -1]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[:index]
        return stop

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
