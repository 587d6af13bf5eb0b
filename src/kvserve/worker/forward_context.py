"""The per-step state that layers read without threading it through the model: attention's
metadata, and which rows run which LoRA adapter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvserve.attention.backend import AttentionMetadata

_current: AttentionMetadata | None = None
_lora_rows: dict[int, torch.Tensor] = {}


@contextmanager
def forward_context(meta: AttentionMetadata,
                    lora_rows: dict[int, torch.Tensor] | None = None) -> Iterator[None]:
    """`lora_rows`: adapter slot -> the rows (token indices) it applies to."""
    global _current, _lora_rows
    previous, _current = _current, meta
    previous_rows, _lora_rows = _lora_rows, lora_rows or {}
    try:
        yield
    finally:
        _current, _lora_rows = previous, previous_rows


def get_lora_rows() -> dict[int, torch.Tensor]:
    return _lora_rows


def get_attention_metadata() -> AttentionMetadata:
    assert _current is not None, "attention called outside forward_context()"
    return _current
