"""PyTorch's int4 weight-only matmuls, for 4-bit GPTQ and AWQ layers (3-bit ones too):
`_weight_int4pack_mm_for_cpu` on CPU, and on CUDA `_weight_int4pack_mm`, gpt-fast's
"tinygemm" (tensor cores, the activations in tiles of 16 rows: 1 to 16 rows cost one pass
over the weights, where a GEMV pays for each row).

Both take bfloat16 activations and a bfloat16 scale and zero per group of 32-256 input
channels, in the form w = (q - 8) * scale + zero: a GPTQ/AWQ zero point z becomes the offset
(8 - z) * scale. Act-order layers run with their input channels sorted by group, each input
gathered into that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)
CUDA_INNER_K_TILES = (8, 4, 2)  # tinygemm's k-tiles of 16 channels per packed group: widest
# first (16-byte loads)


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
        mm = (torch._weight_int4pack_mm if self.packed.is_cuda
              else torch._weight_int4pack_mm_for_cpu)
        out = mm(rows.contiguous(), self.packed, self.group_size, self.scales_and_zeros)
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def int4_weight_fits(shape: tuple[int, int], group_size: int, device: torch.device) -> bool:
    """Whether `device`'s kernel runs 4-bit integers [out, in] in groups of `group_size`: groups
    it has a variant for, output widths a multiple of 16 (CPU) or 8 (CUDA, on sm80 or later),
    input widths a multiple of 32 (CUDA)."""
    out_features, in_features = shape
    if group_size not in INT4_GROUP_SIZES:
        return False
    if device.type == "cuda":
        return (hasattr(torch, "_weight_int4pack_mm") and out_features % 8 == 0
                and in_features % 32 == 0 and torch.cuda.get_device_capability(device) >= (8, 0))
    return (device.type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu")
            and out_features % 16 == 0)


def int4_weight(intweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, input_order: torch.Tensor | None, device: torch.device
                ) -> Int4Weight:
    """4-bit integers [out, in] (input channels sorted by group) with their [groups, out]
    scales and zeros, packed for `device`'s kernel, which must fit them (`int4_weight_fits`)."""
    if device.type == "cuda":
        inner_k_tiles = next(t for t in CUDA_INNER_K_TILES if intweight.shape[1] % (16 * t) == 0)
        packed = torch._convert_weight_to_int4pack(
            cuda_nibble_pairs(intweight).to(device), inner_k_tiles)
    else:
        packed = torch._convert_weight_to_int4pack_for_cpu(intweight.to(torch.int32), 1)
    scales_and_zeros = torch.stack([scales, (8 - zeros.float()) * scales], dim=-1)
    return Int4Weight(packed, scales_and_zeros.to(device, torch.bfloat16).contiguous(),
                      group_size, None if input_order is None else input_order.to(device))


def cuda_nibble_pairs(intweight: torch.Tensor) -> torch.Tensor:
    """[out, in] integers below 16 -> [out, in / 2] uint8, channel 2j in the high nibble of
    byte j and channel 2j + 1 in its low one: the input `_convert_weight_to_int4pack` takes
    on CUDA."""
    pairs = intweight.to(torch.uint8).reshape(intweight.shape[0], -1, 2)
    return ((pairs[..., 0] << 4) | pairs[..., 1]).contiguous()
