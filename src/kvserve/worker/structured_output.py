"""Grammar-constrained sampling with llguidance: a request's `structured_output` becomes a
matcher that gives, before each sampled token, the tokens that keep the output inside the
grammar (a bitmask over the vocabulary, ~3 us), and advances with the token chosen. Once the
grammar is complete only EOS is allowed, so the output ends there."""

from __future__ import annotations

from typing import Any

import torch

from kvserve.cpp_extension import cpu_kernels
from kvserve.models.loader import load_tokenizer
from kvserve.sampling_params import StructuredOutputParams


def grammar_errors(request_ids: list[str], states: list[Any]) -> dict[str, str]:
    """The requests whose grammar's parser stopped in error on the token just consumed (a
    row past llguidance's limits, say): from here on its mask would allow EOS alone, ending
    the output short of the grammar, so they end with the parser's error instead."""
    return {request_id: "structured_output: the grammar's parser stopped: "
                        + st.matcher.get_error().split("\n", 1)[0]  # then a dump of it all
            for request_id, st in zip(request_ids, states, strict=True)
            if st.matcher is not None and st.matcher.is_error()}


class GrammarMatchers:
    """Makes matchers over the model's tokenizer, which is loaded on the first constrained
    request (about a second), not at start-up."""

    def __init__(self, model_path: str, vocab_size: int) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self._tokenizer: Any = None
        self._executor: Any = None  # llguidance's thread pool: masks of all rows at once

    def new(self, params: StructuredOutputParams, eos_token_ids: tuple[int, ...],
            output_token_ids: tuple[int, ...] = ()) -> Any:
        """A matcher at the start of the output, or past `output_token_ids` for a request
        that resumes (after a preemption or a migration)."""
        from llguidance import LLMatcher

        if self._tokenizer is None:
            import llguidance.hf

            hf = load_tokenizer(self.model_path)
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=self.vocab_size, eos_token=list(eos_token_ids) or None)
        matcher = LLMatcher(self._tokenizer, params.compiled)
        if output_token_ids:
            matcher.consume_tokens(list(output_token_ids))
        return matcher

    def mask_disallowed(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]
                        ) -> None:
        """Sets to -inf, in place, each row's logits of tokens its matcher does not allow:
        in C++ on CPU, else by unpacking the bitmask on the logits' device."""
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

        vocab = logits.shape[1]
        bitmask = allocate_token_bitmask(len(rows), vocab)
        fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)],
                                    bitmask)
        kernels = cpu_kernels() if logits.device.type == "cpu" else None
        if kernels is not None and logits.dtype == torch.float32 and logits.is_contiguous():
            kernels.apply_token_bitmask(logits, bitmask, torch.tensor(rows))
            return
        bitmask = bitmask.to(logits.device, non_blocking=True)
        bits = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(len(rows), -1)[:, :vocab].bool()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))

    def advance(self, matchers: list[Any], token_ids: list[int]) -> None:
        """Each matcher past its sampled token."""
        self.executor.consume_token_par(list(zip(matchers, token_ids, strict=True)))

    @property
    def executor(self) -> Any:
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(num_threads=torch.get_num_threads())
        return self._executor
