"""The per-step state that layers read without threading it through the model: attention's
metadata, which rows run which LoRA adapter, and a blended prompt's selective recompute."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvserve.attention.backend import AttentionMetadata
from kvserve.lora.batch import LoRABatch

if TYPE_CHECKING:
    from kvserve.worker.blend import SelectiveRecompute

_current: AttentionMetadata | None = None
_lora: LoRABatch | None = None
_blend: SelectiveRecompute | None = None


@contextmanager
def forward_context(meta: AttentionMetadata, lora: LoRABatch | None = None,
                    blend: SelectiveRecompute | None = None) -> Iterator[None]:
    global _current, _lora, _blend
    previous = _current, _lora, _blend
    _current, _lora, _blend = meta, lora, blend
    try:
        yield
    finally:
        _current, _lora, _blend = previous


def narrow_rows(meta: AttentionMetadata, lora: LoRABatch | None) -> None:
    """From here to the end of the forward, the step runs fewer rows (selective recompute)."""
    global _current, _lora
    _current, _lora = meta, lora


def get_lora_batch() -> LoRABatch | None:
    """Which adapter each row of the step runs; None when none does."""
    return _lora


def get_selective_recompute() -> SelectiveRecompute | None:
    """The step's blended prompts' selective recompute; None when it has none."""
    return _blend


def get_attention_metadata() -> AttentionMetadata:
    assert _current is not None, "attention called outside forward_context()"
    return _current
