"""The per-step state that attention layers read without threading it through the model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvserve.attention.backend import AttentionMetadata

_current: AttentionMetadata | None = None


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    global _current
    previous, _current = _current, meta
    try:
        yield
    finally:
        _current = previous


def get_attention_metadata() -> AttentionMetadata:
    assert _current is not None, "attention called outside forward_context()"
    return _current
