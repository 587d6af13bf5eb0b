"""Quantized hub checkpoints: the `quantization_config` of config.json, and their tensors.

GPTQ (`quant_method: gptq`, 2/3/4/8 bits, `checkpoint_format` gptq or gptq_v2), AWQ
(`quant_method: awq`, 4 bits, `version: gemm`) and SqueezeLLM (`quant_method: squeezellm`,
the layout `kvserve quantize` writes: README) load as they are. Anything else is refused
when the config is read, naming what is unsupported, never run with wrong weights. A
quantized layer reaches the model as its unpacked integers (GPTQ, AWQ), for the linear layer
to run on a kernel or dequantize, or as its table indices (SqueezeLLM).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.errors import CheckpointError
from kvserve.quantization.gptq import QuantizedWeight
from kvserve.quantization.packing import unpack_awq, unpack_gptq, unpack_rows
from kvserve.quantization.squeezellm import LutWeight

SUPPORTED_BITS = {"gptq": (2, 3, 4, 8), "awq": (4,), "squeezellm": (2, 3, 4, 8)}
PARTS = {"gptq": frozenset({"qweight", "qzeros", "scales", "g_idx"}),
         "awq": frozenset({"qweight", "qzeros", "scales"}),
         "squeezellm": frozenset({"qweight", "lookup_table", "sparse_rows", "sparse_cols",
                                  "sparse_values"})}
QUANTIZED_PARTS = frozenset().union(*PARTS.values())


@dataclass(frozen=True)
class QuantConfig:
    method: str  # gptq | awq | squeezellm
    bits: int
    group_size: int  # -1: one group over the whole input
    desc_act: bool = False
    sym: bool = True
    zero_offset: int = 1  # GPTQ v1 files store zero - 1
    lm_head: bool = False  # the LM head is quantized too (it loads whatever the files hold)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> QuantConfig:
        method = raw.get("quant_method")
        if method not in SUPPORTED_BITS:
            raise CheckpointError(f"model: quantization_config.quant_method {method!r} is not "
                                  f"supported (supported: {', '.join(SUPPORTED_BITS)})")
        bits = raw.get("bits", raw.get("w_bit", raw.get("wbits")))
        if bits not in SUPPORTED_BITS[method]:
            raise CheckpointError(f"model: {method} with bits={bits!r} is not supported "
                                  f"(supported: {SUPPORTED_BITS[method]})")
        lm_head = bool(raw.get("lm_head", False))
        if method == "squeezellm":
            return cls("squeezellm", bits, -1, lm_head=lm_head)
        group_size = raw.get("group_size", raw.get("q_group_size", -1))
        if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
            raise CheckpointError(f"model: quantization_config.group_size must be -1 or a "
                                  f"positive integer, got {group_size!r}")
        if method == "awq":
            version = str(raw.get("version", "gemm")).lower()
            if version != "gemm" or raw.get("zero_point", True) is not True:
                raise CheckpointError(f"model: AWQ version {version!r} with zero_point="
                                      f"{raw.get('zero_point', True)!r} is not supported "
                                      "(supported: version gemm with zero points)")
            return cls("awq", bits, group_size, zero_offset=0, lm_head=lm_head)
        checkpoint_format = raw.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"model: GPTQ checkpoint_format {checkpoint_format!r} is not "
                                  "supported (supported: gptq, gptq_v2)")
        return cls("gptq", bits, group_size, bool(raw.get("desc_act", False)),
                   bool(raw.get("sym", True)), 1 if checkpoint_format == "gptq" else 0, lm_head)

    def to_hf(self) -> dict[str, Any]:
        """The config.json entry (for GPTQ, as GPTQModel writes it)."""
        if self.method == "squeezellm":
            return {"quant_method": "squeezellm", "bits": self.bits, "lm_head": self.lm_head}
        assert self.method == "gptq"
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                "desc_act": self.desc_act, "sym": self.sym, "lm_head": self.lm_head,
                "checkpoint_format": "gptq"}

    def unpack(self, layer: str, parts: dict[str, torch.Tensor]
               ) -> QuantizedWeight | LutWeight:
        """One quantized layer's tensors as integers with their group scales and zeros
        (GPTQ, AWQ), or as table indices with their tables and outliers (SqueezeLLM)."""
        try:
            if self.method == "squeezellm":
                lut = LutWeight(unpack_rows(parts["qweight"], self.bits).t(),
                                parts["lookup_table"].float(), parts["sparse_rows"].long(),
                                parts["sparse_cols"].long(), parts["sparse_values"].float())
                lut.check()
                return lut
            if self.method == "awq":
                intweight = unpack_awq(parts["qweight"]).t()
                zeros = unpack_awq(parts["qzeros"]).long()
                group = intweight.shape[1] if self.group_size == -1 else self.group_size
                g_idx = torch.arange(intweight.shape[1]) // group
            else:
                intweight, zeros = unpack_gptq(parts["qweight"], parts["qzeros"], self.bits,
                                               self.zero_offset)
                g_idx = parts["g_idx"].long()
            weight = QuantizedWeight(intweight, parts["scales"].float(), zeros, g_idx)
            weight.check()
            return weight
        except (IndexError, RuntimeError, ValueError) as e:
            shapes = {k: list(v.shape) for k, v in sorted(parts.items())}
            raise CheckpointError(f"model: quantized layer {layer!r} has inconsistent tensors "
                                  f"{shapes} for {self.method} {self.bits}-bit: {e}") from None


def dequantize_checkpoint(tensors: Iterator[tuple[str, torch.Tensor]],
                          quant: QuantConfig | None, keep_integers: bool = False
                          ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight | LutWeight]]:
    """The checkpoint's tensors with each quantized layer's parts replaced, once all have
    been read, by its `<layer>.weight`: dequantized, or with `keep_integers` unpacked
    (`QuantizedWeight`, `LutWeight`)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        layer, _, part = name.rpartition(".")
        if part not in QUANTIZED_PARTS:
            yield name, tensor
            continue
        if quant is None:
            raise CheckpointError(f"model: tensor {name!r} is quantized but config.json has no "
                                  "quantization_config")
        parts = pending.setdefault(layer, {})
        parts[part] = tensor
        if set(parts) >= PARTS[quant.method]:
            weight = quant.unpack(layer, pending.pop(layer))
            yield f"{layer}.weight", weight if keep_integers else weight.dequantize()
    for layer, parts in pending.items():
        missing = sorted(PARTS[quant.method] - set(parts)) if quant else []
        raise CheckpointError(f"model: quantized layer {layer!r} lacks {', '.join(missing)}")
