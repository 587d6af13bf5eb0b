"""Rotary position embeddings as complex multiplication over interleaved pairs.

Checkpoints in the HF layout rotate each head's dimension i together with i + rotary_dim/2
("rotate half"). The loader reorders q/k rows per head so those partners sit side by side
(`to_interleaved`); q.k is unchanged by applying one permutation to both, and the rotation
becomes a single complex multiply, a quarter of the ops of rotate-half. The attention backend
applies it (`attention/torch_ref.py`), so that a kernel can fuse it with the KV-cache write.

The table covers the whole head: where only the first `rotary_dim` dimensions rotate
(`partial_rotary_factor`, as Phi-4-mini's), the other pairs hold 1. Frequency scalings:
linear, llama3, YaRN and LongRoPE. The last two also scale the rotated pairs' cos and sin by
an attention factor, which the table's magnitude carries, so kernels need no extra input.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_frequencies(rotary_dim: int, theta: float, scaling: dict[str, Any] | None,
                     context_len: int) -> tuple[torch.Tensor, float]:
    """The rotated pairs' inverse frequencies, as transformers computes them, and the factor
    their cos and sin are scaled by. `context_len` (the longest sequence served) picks
    LongRoPE's long factors where it exceeds the original context, as llama.cpp does."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    kind = scaling.get("rope_type", "default") if scaling else "default"
    if kind == "longrope":
        assert scaling is not None
        long = context_len > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"],
                               dtype=torch.float32)
        return 1.0 / (factors * theta ** exponents), scaling["attention_factor"]
    inv_freq = 1.0 / theta ** exponents
    if kind == "default" or scaling is None:
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    old_len = float(scaling["original_max_position_embeddings"])
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled), 1.0
    assert kind == "yarn", kind
    return _yarn_frequencies(exponents, theta, factor, old_len, scaling), \
        scaling["attention_factor"]


def _yarn_frequencies(exponents: torch.Tensor, theta: float, factor: float, old_len: float,
                      scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: the high frequencies (many turns within the original context) kept, the low ones
    interpolated by `factor`, and a linear ramp between them over the pairs whose turns
    within the original context fall between beta_slow and beta_fast."""
    rotary_dim = 2 * len(exponents)

    def pair_of(turns: float) -> float:
        return rotary_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(scaling.get("beta_fast") or 32), pair_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    pos_freqs = theta ** exponents
    return (1.0 / (factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept


def to_interleaved(tensor: torch.Tensor, head_dim: int, rotary_dim: int | None = None
                   ) -> torch.Tensor:
    """Reorders dim 0 of a per-head q/k tensor ([heads * head_dim, ...]) from rotate-half
    order (i, i + rotary_dim/2) to adjacent pairs (2i, 2i + 1); dimensions past `rotary_dim`
    (which do not rotate) stay where they are."""
    rotary_dim = rotary_dim or head_dim
    rest = tensor.shape[1:]
    heads = tensor.reshape(-1, head_dim, *rest)
    rotated = heads[:, :rotary_dim].reshape(-1, 2, rotary_dim // 2, *rest).transpose(1, 2)
    rotated = rotated.reshape(-1, rotary_dim, *rest)
    return torch.cat([rotated, heads[:, rotary_dim:]], dim=1).reshape(tensor.shape)


class RotaryEmbedding(nn.Module):
    """Caches e^(i * position * freq), times the attention factor, for every position and
    pair; `forward` gathers a step's."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, rotary_dim: int | None = None,
                 context_len: int | None = None) -> None:
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        inv_freq, attention_factor = rope_frequencies(rotary_dim, theta, scaling,
                                                      context_len or max_positions)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        rotated = torch.polar(torch.full_like(angles, attention_factor), angles)
        still = torch.ones(max_positions, (head_dim - rotary_dim) // 2, dtype=rotated.dtype)
        self.register_buffer("freqs_cis", torch.cat([rotated, still], dim=1),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """[N, 1, head_dim / 2] complex, broadcasting over heads."""
        return self.freqs_cis[positions].unsqueeze(1)

    def turn(self, num_positions: int) -> torch.Tensor:
        """[head_dim / 2] complex of magnitude 1: the rotation that moves a rotated key
        `num_positions` on (back, if negative). Rotations compose, and the attention factor a
        key already carries is not applied again."""
        rotation = self.freqs_cis[abs(num_positions)]
        unit = rotation / rotation.abs()
        return unit.conj() if num_positions < 0 else unit
