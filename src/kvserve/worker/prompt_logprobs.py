"""The logprobs of prompt tokens (vLLM's `prompt_logprobs`): what perplexity and prompt
scoring need. Row p of a prompt chunk predicts prompt token p + 1, so every chunk row whose
next token is still in the prompt gets the log-softmax of its logits."""

from __future__ import annotations

import torch

from kvserve.core.scheduler.output import TokenLogprobs
from kvserve.worker.input_batch import ModelInputs
from kvserve.worker.sampler import SamplingState, token_logprobs

MAX_ROWS = 512  # logits rows at a time: bounds the [rows, vocab] float32 buffer


def prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, inputs: ModelInputs,
                    states: dict[str, SamplingState]
                    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """Request id -> (the position of the first prompt token scored, its logprobs and the
    following ones) for each scheduled chunk of a request that asked for them."""
    rows: list[int] = []
    targets: list[int] = []
    num_top: list[int] = []
    spans: list[tuple[str, int, int]] = []
    for i, s in enumerate(inputs.scheduled):
        state = states.get(s.request_id)  # none for a blended prompt's chunk
        if state is None:
            continue
        k = state.params.prompt_logprobs
        prompt = state.prompt_token_ids
        first = s.num_computed_tokens
        last = min(first + len(s.token_ids), len(prompt) - 1)
        if k is None or last <= first:
            continue
        row = int(inputs.query_start_host[i])
        rows += range(row, row + last - first)
        targets += prompt[first + 1:last + 1]
        num_top += [k] * (last - first)
        spans.append((s.request_id, first + 1, last - first))
    entries: list[TokenLogprobs] = []
    for start in range(0, len(rows), MAX_ROWS):
        part = slice(start, start + MAX_ROWS)
        index = torch.tensor(rows[part], device=hidden.device)
        logits = model.compute_logits(hidden[index])
        entries += token_logprobs(logits, torch.tensor(targets[part], device=hidden.device),
                                  num_top[part])
    result, offset = {}, 0
    for request_id, position, count in spans:
        result[request_id] = (position, entries[offset:offset + count])
        offset += count
    return result
