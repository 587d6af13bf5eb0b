"""The one interface a linear layer runs quantized weights through: a kernel with
`matmul(x)` and `num_bytes`, chosen at load for the layer's shards and device.

- CUDA: the Triton weight-only GEMM (`triton_gemm.py`) for GPTQ, AWQ and SqueezeLLM layers;
  for 4-bit GPTQ and AWQ layers in bfloat16, also PyTorch's int4 GEMM (`torch_int4.py`)
  where it times faster for few rows.
- CPU: the fastest of PyTorch's int4 or int8 kernel and our W4A8/W8A8 kernel (`cpu_kernels.py`)
  for GPTQ and AWQ layers, where it beats the dense GEMM on the layer's shape.
- Anything else runs the dequantized dense weight.

`KVSERVE_QUANTIZED_KERNEL` overrides the choice: `auto` (the default), `integer` (the
fastest CPU kernel even where the dense GEMM is faster), `triton` (the Triton kernels alone,
on any device: on a CPU only under Triton's interpreter, for tests) or `dequantized`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from kvserve.config import env_choice
from kvserve.quantization.cpu_kernels import cpu_candidates, fastest
from kvserve.quantization.gptq import QuantizedWeight
from kvserve.quantization.squeezellm import LutWeight

logger = logging.getLogger(__name__)
KERNEL_CHOICES = ("auto", "integer", "triton", "dequantized")


class QuantizedKernel(Protocol):
    @property
    def num_bytes(self) -> int: ...

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...


def kernel_choice() -> str:
    return env_choice("KVSERVE_QUANTIZED_KERNEL", KERNEL_CHOICES)


def choose_kernel(shards: list[QuantizedWeight] | list[LutWeight],
                  dense: Callable[[], Callable[[torch.Tensor], torch.Tensor]], in_features: int,
                  dtype: torch.dtype, device: torch.device) -> QuantizedKernel | None:
    """The kernel for a layer's quantized shards (in output order), or None to run the
    layer's dequantized weight, whose matmul `dense` builds where a timing needs it."""
    choice = kernel_choice()
    if choice == "triton" or (choice == "auto" and device.type == "cuda"):
        triton_gemm = _triton_gemm()
        return None if triton_gemm is None else triton_gemm.pack_for_triton(
            shards, dtype, device, num_programs(device), torch_int4=choice == "auto")
    if choice == "dequantized" or device.type != "cpu" or isinstance(shards[0], LutWeight):
        return None
    candidates = cpu_candidates(shards)
    if not candidates.packers:
        return None
    return fastest(candidates, dense if choice == "auto" else None, in_features, dtype)


@functools.cache
def _triton_gemm():  # noqa: ANN202 (a module, or None)
    try:
        from kvserve.quantization import triton_gemm
    except ImportError as e:
        logger.warning("Triton is unavailable (%s): quantized layers run dequantized", e)
        return None
    return triton_gemm


def num_programs(device: torch.device) -> int:
    """Enough programs to fill the GPU twice over; a few under the interpreter."""
    if device.type != "cuda":
        return 8
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count
