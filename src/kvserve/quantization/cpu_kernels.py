"""Weight-only quantized matmuls on CPU through PyTorch's packed integer kernels, for GPTQ and
AWQ layers:
- int4 (`_weight_int4pack_mm_for_cpu`): values of at most 4 bits (3-bit ones too), with a
  scale and zero per group of 32-256 input channels. Act-order layers, whose groups are
  scattered over the input channels, run with the channels sorted by group and each input
  gathered into that order.
- int8 (`_weight_int8pack_mm`): values of up to 8 bits with one scale per output channel
  (group size -1). The kernel has no zero points, so the integers are stored offset by 128
  and the zero's share, `scale * (zero - 128) * sum(x)`, is subtracted from the output.

Both take bfloat16 activations and stream a quarter (int8) or an eighth (int4) of the
float32 weight bytes. Whether that beats the dense float32 GEMM depends on the CPU
(bfloat16 support) and the shape, so the engine times both on each layer shape at load
and keeps the faster for one-row steps, the
case quantized models are served for (`kernels.py` makes the choice).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.quantization.gptq import QuantizedWeight

INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class Int4Weight:
    packed: torch.Tensor  # the kernel's packed layout of the [out, in] integers
    scales_and_zeros: torch.Tensor  # [groups, out, 2] bfloat16: w = (q - 8) * scale + zero
    group_size: int
    input_order: torch.Tensor | None  # act-order: the input channels sorted by group

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).bfloat16()
        if self.input_order is not None:
            rows = rows.index_select(1, self.input_order)
        out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size,
                                                 self.scales_and_zeros)
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


@dataclass(frozen=True)
class Int8Weight:
    weight: torch.Tensor  # [out, in] int8: the integers minus 128
    scales: torch.Tensor  # [out] bfloat16
    zero_terms: torch.Tensor | None  # [out] float32, scale * (zero - 128); None if all 0

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).bfloat16()
        out = torch._weight_int8pack_mm(rows, self.weight, self.scales).to(x.dtype)
        if self.zero_terms is not None:
            out = out - rows.float().sum(1, keepdim=True).to(x.dtype) * self.zero_terms
        return out.reshape(*x.shape[:-1], -1)


IntegerWeight = Int4Weight | Int8Weight


def pack_for_cpu(shards: list[QuantizedWeight]) -> IntegerWeight | None:
    """The shards (a fused layer's, in output order) packed for the int4 or the int8 kernel,
    or None where neither can run them."""
    if max(int(s.intweight.max()) for s in shards) <= 15:
        return _pack_int4(shards)
    return _pack_int8(shards)


def _pack_int4(shards: list[QuantizedWeight]) -> Int4Weight | None:
    """None where the groups have an unsupported size, where the shards order their input
    channels differently, or where the output width is not a multiple of 16."""
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return None
    g_idx = shards[0].g_idx
    in_features = g_idx.shape[0]
    group_size = in_features // shards[0].scales.shape[0]
    order = torch.argsort(g_idx, stable=True)
    out_features = sum(s.intweight.shape[0] for s in shards)
    if (group_size not in INT4_GROUP_SIZES or out_features % 16
            or not torch.equal(g_idx[order], torch.arange(in_features) // group_size)
            or any(not torch.equal(s.g_idx, g_idx) for s in shards)):
        return None
    in_order = torch.equal(order, torch.arange(in_features))
    intweight = torch.cat([s.intweight for s in shards]).to(torch.int32)
    if not in_order:
        intweight = intweight[:, order].contiguous()
    scales = torch.cat([s.scales for s in shards], dim=1)
    zeros = torch.cat([s.zeros for s in shards], dim=1).float()
    scales_and_zeros = torch.stack([scales, (8 - zeros) * scales], dim=-1)
    return Int4Weight(torch._convert_weight_to_int4pack_for_cpu(intweight, 1),
                      scales_and_zeros.to(torch.bfloat16).contiguous(), group_size,
                      None if in_order else order)


def _pack_int8(shards: list[QuantizedWeight]) -> Int8Weight | None:
    """None unless every shard has one group and values of at most 8 bits."""
    if not hasattr(torch, "_weight_int8pack_mm") or any(
            s.scales.shape[0] != 1 or int(s.intweight.max()) > 255 for s in shards):
        return None
    weight = (torch.cat([s.intweight for s in shards]).to(torch.int16) - 128).to(torch.int8)
    scales = torch.cat([s.scales[0] for s in shards]).bfloat16()
    zeros = torch.cat([s.zeros[0] for s in shards])
    # The output's scale is the bfloat16 one the kernel applies.
    zero_terms = scales.float() * (zeros - 128).float()
    return Int8Weight(weight.contiguous(), scales.contiguous(),
                      None if bool((zeros == 128).all()) else zero_terms)


_decisions: dict[tuple[object, ...], bool] = {}  # by kernel, shape, layout and dtype


def integer_is_faster(kernel: IntegerWeight, dense: Callable[[torch.Tensor], torch.Tensor],
                      in_features: int, dtype: torch.dtype) -> bool:
    """Whether `kernel` beats `dense` on one row of this shape (measured once per shape,
    the median of a few runs)."""
    if isinstance(kernel, Int4Weight):
        layout = (kernel.scales_and_zeros.shape[1], kernel.group_size,
                  kernel.input_order is not None)
    else:
        layout = (kernel.scales.shape[0],)
    key = (type(kernel), in_features, *layout, dtype)
    if key not in _decisions:
        x = torch.randn(1, in_features, dtype=dtype)
        _decisions[key] = _median_time(kernel.matmul, x) < _median_time(dense, x)
    return _decisions[key]


def _median_time(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 runs: int = 15) -> float:
    fn(x)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
