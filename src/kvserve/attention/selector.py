"""Picks the attention backend for a device."""

from __future__ import annotations

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.cpu_paged import CpuPagedAttention, load_kernel
from kvserve.attention.torch_ref import TorchPagedAttention


def get_attention_backend(device: str) -> AttentionBackend:
    kernel = load_kernel() if device == "cpu" else None
    return CpuPagedAttention(kernel) if kernel is not None else TorchPagedAttention()
