"""4-bit weight-only matmul on CPU through PyTorch's int4 kernel (`_weight_int4pack_mm_for_cpu`),
for GPTQ and AWQ layers whose integers fit in 4 bits (3-bit ones too).

The kernel takes bfloat16 activations and dequantizes the packed weight tile by tile, so a
decode step streams an eighth of the float32 weight bytes. Whether it beats the dense
float32 GEMM depends on the CPU (bfloat16 support) and on the number of rows, so the engine
times both on the layer's shape at load (`KVSERVE_QUANTIZED_KERNEL=auto`, the default) and
keeps the faster for one-row steps, the case quantized models are served for; `int4` or
`dequantized` forces one.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.quantization.gptq import QuantizedWeight

GROUP_SIZES = (32, 64, 128, 256)
KERNEL_CHOICES = ("auto", "int4", "dequantized")


@dataclass(frozen=True)
class Int4Weight:
    packed: torch.Tensor  # the kernel's packed layout of the [out, in] integers
    scales_and_zeros: torch.Tensor  # [groups, out, 2] bfloat16: w = (q - 8) * scale + zero
    group_size: int

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]).bfloat16(),
                                                 self.packed, self.group_size,
                                                 self.scales_and_zeros)
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def kernel_choice() -> str:
    choice = os.environ.get("KVSERVE_QUANTIZED_KERNEL", "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"KVSERVE_QUANTIZED_KERNEL must be one of {', '.join(KERNEL_CHOICES)}, "
                         f"got {choice!r}")
    return choice


def pack_int4(shards: list[QuantizedWeight]) -> Int4Weight | None:
    """The shards (a fused layer's, in output order) packed for the kernel, or None where it
    cannot run them: values of more than 4 bits, groups out of input order (act-order) or of
    an unsupported size, or an output width not a multiple of 16."""
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return None
    g_idx = shards[0].g_idx
    in_features = g_idx.shape[0]
    group_size = in_features // shards[0].scales.shape[0]
    expected = torch.arange(in_features) // max(group_size, 1)
    out_features = sum(s.intweight.shape[0] for s in shards)
    if (group_size not in GROUP_SIZES or out_features % 16
            or any(not torch.equal(s.g_idx, expected) or int(s.intweight.max()) > 15
                   for s in shards)):
        return None
    intweight = torch.cat([s.intweight for s in shards]).to(torch.int32)
    scales = torch.cat([s.scales for s in shards], dim=1)
    zeros = torch.cat([s.zeros for s in shards], dim=1).float()
    scales_and_zeros = torch.stack([scales, (8 - zeros) * scales], dim=-1)
    return Int4Weight(torch._convert_weight_to_int4pack_for_cpu(intweight, 1),
                      scales_and_zeros.to(torch.bfloat16).contiguous(), group_size)


_decisions: dict[tuple[object, ...], bool] = {}  # by (out, in, group size, dtype)


def int4_is_faster(int4: Int4Weight, dense: Callable[[torch.Tensor], torch.Tensor],
                   in_features: int, dtype: torch.dtype) -> bool:
    """Whether the int4 kernel beats `dense` on one row of this shape (measured once per
    shape, the median of a few runs)."""
    key = (int4.scales_and_zeros.shape[1], in_features, int4.group_size, dtype)
    if key not in _decisions:
        x = torch.randn(1, in_features, dtype=dtype)
        _decisions[key] = _median_time(int4.matmul, x) < _median_time(dense, x)
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
