"""The per-step state that layers read without threading it through the model: attention's
metadata, and which rows run which LoRA adapter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvserve.attention.backend import AttentionMetadata
from kvserve.lora.batch import LoRABatch

_current: AttentionMetadata | None = None
_lora: LoRABatch | None = None


@contextmanager
def forward_context(meta: AttentionMetadata, lora: LoRABatch | None = None
                    ) -> Iterator[None]:
    global _current, _lora
    previous, _current = _current, meta
    previous_lora, _lora = _lora, lora
    try:
        yield
    finally:
        _current, _lora = previous, previous_lora


def get_lora_batch() -> LoRABatch | None:
    """Which adapter each row of the step runs; None when none does."""
    return _lora


def get_attention_metadata() -> AttentionMetadata:
    assert _current is not None, "attention called outside forward_context()"
    return _current
