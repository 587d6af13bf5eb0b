"""Weight quantization of one linear layer to `bits`-bit integers with per-group scales and
zero points: round-to-nearest (RTN), and GPTQ.

GPTQ quantizes the input channels one at a time and spreads each one's rounding error over
the channels not yet quantized, weighted by the inverse Hessian of the layer's calibration
inputs (H = 2 X^T X), so the layer's output on such inputs moves as little as possible. As
in the paper: a dampened Hessian, its inverse through Cholesky factors, lazy updates in
blocks of 128 columns, and optionally act-order (channels with the largest Hessian diagonal
first, their groups still given by `g_idx`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    """w[:, i] ~ scales[g_idx[i]] * (intweight[:, i] - zeros[g_idx[i]])."""

    intweight: torch.Tensor  # [out, in] uint8 integers in [0, 2^bits)
    scales: torch.Tensor  # [groups, out] float32
    zeros: torch.Tensor  # [groups, out] int64
    g_idx: torch.Tensor  # [in] int64

    @property
    def shape(self) -> torch.Size:
        return self.intweight.shape

    def check(self) -> None:
        """Raises ValueError unless the parts fit together, without building the weight."""
        out_features, in_features = self.intweight.shape
        groups = self.scales.shape[0]
        if self.scales.shape != (groups, out_features) or self.zeros.shape != self.scales.shape:
            raise ValueError(f"scales {list(self.scales.shape)} and zeros "
                             f"{list(self.zeros.shape)} must both be [groups, {out_features}]")
        if self.g_idx.shape != (in_features,):
            raise ValueError(f"g_idx {list(self.g_idx.shape)} must be [{in_features}]")
        if in_features and not 0 <= int(self.g_idx.min()) <= int(self.g_idx.max()) < groups:
            raise ValueError(f"g_idx must name groups 0 to {groups - 1}")

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in], built in place to bound the memory of large layers.
        Groups of consecutive channels broadcast their scale and zero over a [out, groups,
        size] view (the same bits): gathering them per channel, as act-order needs, took
        most of a 4-bit llama3.2-1b's load time."""
        weight = self.intweight.float()
        out_features, in_features = weight.shape
        groups = self.scales.shape[0]
        size = in_features // max(groups, 1)
        if size * groups == in_features and torch.equal(
                self.g_idx, torch.arange(in_features, device=self.g_idx.device) // size):
            grouped = weight.view(out_features, groups, size)
            grouped -= self.zeros.t().float()[:, :, None]
            grouped *= self.scales.t().float()[:, :, None]
            return weight
        weight -= self.zeros.t().float()[:, self.g_idx]
        weight *= self.scales.t().float()[:, self.g_idx]
        return weight

    def input_slice(self, start: int, end: int) -> QuantizedWeight:
        """The layer over input channels [start, end) only (a row-parallel rank's share), with
        the groups those channels use."""
        g_idx = self.g_idx[start:end]
        first, last = int(g_idx.min()), int(g_idx.max())
        return QuantizedWeight(self.intweight[:, start:end].contiguous(),
                               self.scales[first:last + 1], self.zeros[first:last + 1],
                               g_idx - first)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The same layer with `fn`, a reordering of output rows, applied to every part."""
        return QuantizedWeight(fn(self.intweight), fn(self.scales.t()).t(),
                               fn(self.zeros.t()).t(), self.g_idx)


def sorted_by_group(shards: list[QuantizedWeight]
                     ) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """A fused layer's shards as the integers [out, in] with the input channels sorted by
    group (what kernels that take contiguous groups run, gathering each input into the same
    order), that order (None: already sorted) and the group size; None where the groups
    differ in size or the shards order their input channels differently."""
    g_idx = shards[0].g_idx
    in_features = g_idx.shape[0]
    group_size = in_features // shards[0].scales.shape[0]
    order = torch.argsort(g_idx, stable=True)
    if (not torch.equal(g_idx[order], torch.arange(in_features) // group_size)
            or any(not torch.equal(s.g_idx, g_idx) for s in shards)):
        return None
    intweight = torch.cat([s.intweight for s in shards])
    if torch.equal(order, torch.arange(in_features)):
        return intweight, None, group_size
    return intweight[:, order].contiguous(), order, group_size


def group_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of w [..., k] (its last dimension), the scale and integer zero that map
    [min, max] (widened to include 0) onto [0, 2^bits - 1]; symmetric: a range centred on 0,
    zero at the middle."""
    maxq = 2**bits - 1
    low = w.amin(dim=-1).clamp(max=0)
    high = w.amax(dim=-1).clamp(min=0)
    if sym:
        high = torch.maximum(-low, high)
        low = -high
    flat = high == low
    low, high = torch.where(flat, -1.0, low), torch.where(flat, 1.0, high)
    # Rounded to float16, as checkpoints store it, so quantizing uses the scale that loads.
    scale = ((high - low) / maxq).clamp(min=2**-14).half().float()
    zero = torch.full_like(scale, (maxq + 1) // 2) if sym else torch.round(-low / scale)
    return scale, zero.long()


def quantize_column(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int
                    ) -> torch.Tensor:
    """round(w / scale) + zero, clamped to [0, 2^bits - 1]: in place on one temporary, since a
    whole layer's (an LM head's gigabytes) is quantized at once."""
    q = w / scale
    return q.round_().add_(zero).clamp_(0, 2**bits - 1).to(torch.uint8)


def rtn(weight: torch.Tensor, bits: int, group_size: int, sym: bool) -> QuantizedWeight:
    """Round-to-nearest with each group's own range: the baseline GPTQ is measured against."""
    w = weight.float()
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"group_size {group_size} does not divide {in_features} inputs")
    groups = w.view(out_features, in_features // group_size, group_size)
    scale, zero = group_params(groups, bits, sym)  # [out, groups]
    intweight = quantize_column(groups, scale.unsqueeze(-1), zero.unsqueeze(-1), bits)
    return QuantizedWeight(intweight.view(out_features, in_features), scale.t().contiguous(),
                           zero.t().contiguous(), torch.arange(in_features) // group_size)


def gptq(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, sym: bool,
         act_order: bool = False, damp: float = 0.01, block_size: int = 128
         ) -> QuantizedWeight:
    """GPTQ of weight [out, in] given the Hessian [in, in] of its calibration inputs."""
    w = weight.float().clone()
    h = hessian.float().clone()
    out_features, in_features = w.shape
    dead = torch.diag(h) == 0  # inputs that were always 0: any weight is as good
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order \
        else torch.arange(in_features)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(in_features)
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    intweight = torch.zeros(out_features, in_features, dtype=torch.uint8)
    scales, zeros = [], []
    for start in range(0, in_features, block_size):
        end = min(start + block_size, in_features)
        block = w[:, start:end].clone()
        errors = torch.zeros_like(block)
        h_block = h_inv[start:end, start:end]
        for i in range(end - start):
            column = start + i
            if column % group_size == 0:  # the group's range, from its weights as updated
                group = torch.cat([block[:, i:], w[:, end:]], dim=1)[:, :group_size]
                scale, zero = group_params(group, bits, sym)
                scales.append(scale)
                zeros.append(zero)
            q = quantize_column(block[:, i], scale, zero, bits)
            intweight[:, column] = q
            error = (block[:, i] - scale * (q - zero)) / h_block[i, i]
            block[:, i:] -= error.unsqueeze(1) * h_block[i, i:].unsqueeze(0)
            errors[:, i] = error
        w[:, end:] -= errors @ h_inv[start:end, end:]

    inverse = torch.argsort(perm)
    g_idx = (torch.arange(in_features) // group_size)[inverse]
    return QuantizedWeight(intweight[:, inverse], torch.stack(scales), torch.stack(zeros),
                           g_idx)
