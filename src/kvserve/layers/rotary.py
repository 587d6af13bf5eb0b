"""Rotary position embeddings as complex multiplication over interleaved pairs.

Checkpoints in the HF layout rotate each head's dimension i together with i + head_dim/2
("rotate half"). The loader reorders q/k rows per head so those partners sit side by side
(`to_interleaved`); q.k is unchanged by applying one permutation to both, and the rotation
becomes a single complex multiply, a quarter of the ops of rotate-half. The attention backend
applies it (`attention/torch_ref.py`), so that a kernel can fuse it with the KV-cache write.
Linear and llama3 frequency scaling are supported.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", "default")
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def to_interleaved(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorders dim 0 of a per-head q/k tensor ([heads * head_dim, ...]) from rotate-half
    order (i, i + head_dim/2) to adjacent pairs (2i, 2i + 1)."""
    rest = tensor.shape[1:]
    halves = tensor.reshape(-1, 2, head_dim // 2, *rest)
    return halves.transpose(1, 2).reshape(tensor.shape)


class RotaryEmbedding(nn.Module):
    """Caches e^(i * position * freq) for every position; `forward` gathers a step's."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """[N, 1, head_dim / 2] complex, broadcasting over heads."""
        return self.freqs_cis[positions].unsqueeze(1)
