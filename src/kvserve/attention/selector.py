"""Picks the attention backend for a device."""

from __future__ import annotations

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.torch_ref import TorchPagedAttention


def get_attention_backend(device: str) -> AttentionBackend:
    return TorchPagedAttention()
