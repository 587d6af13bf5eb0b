"""Incremental detokenization that never emits a broken UTF-8 character, plus stop strings."""

from __future__ import annotations

import weakref

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

STREAM_CONTEXT = 6  # emitted tokens a rebuilt stream starts from, for their spacing


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text, one delta at a time.

    A tokenizer whose `decode` is its Rust decoder's (no clean-up pass: the BPE tokenizers of
    Llama and Qwen) steps a `tokenizers.DecodeStream`, one call per token. Any other decodes
    only the tokens since `prefix_offset`, twice per update, so the cost stays flat as the
    output grows. Either way, text that would end in an incomplete multi-byte character is
    held back until the next token completes it; `read_offset` counts the tokens whose text
    is out.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool,
                 stop: list[str], check_stop_after: int, keep_stop: bool = False) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.keep_stop = keep_stop
        self.check_stop_after = check_stop_after
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.attach(tokenizer)

    def __getstate__(self) -> dict:
        """Pickled without the tokenizer and its stream (a migrated request's detokenizer is
        attached to the destination's own tokenizer)."""
        return {**self.__dict__, "tokenizer": None, "stream": None}

    def attach(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Decodes with `tokenizer` from here on, resuming after the text already out."""
        self.tokenizer = tokenizer
        self.stream = None
        if decodes_as_stream(tokenizer):
            context = self.token_ids[max(0, self.read_offset - STREAM_CONTEXT):self.read_offset]
            self.stream = DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)
            for token_id in self.token_ids[self.read_offset:]:  # held back, still incomplete
                self.stream.step(tokenizer.backend_tokenizer, token_id)

    def update(self, new_token_ids: list[int], stop_token: bool = False) -> str | None:
        """Appends tokens and extends `text`; returns the stop string hit, if any (the text is
        then cut just before it, or just after it with `keep_stop`). `stop_token`: the last
        token stopped the output (EOS or a stop token id); as a stop string's, its text is
        left out unless `keep_stop` (vLLM's rule)."""
        if stop_token and not self.keep_stop:
            new_token_ids = new_token_ids[:-1]
        self.token_ids.extend(new_token_ids)
        before = len(self.text)
        if self.stream is not None:
            self._step_stream(new_token_ids)
        else:
            self._decode_window()
        if len(self.text) == before or not self.stop \
                or len(self.token_ids) <= self.check_stop_after:
            return None
        return self._find_stop(before)

    def _step_stream(self, new_token_ids: list[int]) -> None:
        assert self.stream is not None
        first = len(self.token_ids) - len(new_token_ids)
        for i, token_id in enumerate(new_token_ids):
            piece = self.stream.step(self.tokenizer.backend_tokenizer, token_id)
            if piece is not None:
                self.text += piece
                self.read_offset = first + i + 1

    def _decode_window(self) -> None:
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)

    def _find_stop(self, new_from: int) -> str | None:
        longest = max(len(s) for s in self.stop)
        window_start = max(0, new_from - longest + 1)
        hits = [(self.text.find(s, window_start), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i != -1]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[:index + len(stop) if self.keep_stop else index]
        return stop

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


def decodes_as_stream(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's `decode` is exactly its Rust decoder's: true of fast
    tokenizers unless a clean-up pass (which joins spaces before punctuation) applies.
    Probed once per tokenizer."""
    if tokenizer not in _DECODES_AS_STREAM:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        probe = [] if backend is None else tokenizer.encode(
            "a . b , c ! d ? e 's f n't g 're", add_special_tokens=False)
        _DECODES_AS_STREAM[tokenizer] = backend is not None and \
            tokenizer.decode(probe) == backend.decode(probe)
    return _DECODES_AS_STREAM[tokenizer]


_DECODES_AS_STREAM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
