"""The fused kernels a layer's input goes to: Triton's on CUDA (where Triton is installed),
the C++ ones of `kvserve/csrc/norm_activation.cpp` on CPU (built on first use;
`KVSERVE_CPU_KERNELS=0` leaves them out). Both take the same arguments; None means the
plain-torch path."""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from kvserve.cpp_extension import cpu_kernels

logger = logging.getLogger(__name__)


def fused_kernels(x: torch.Tensor) -> ModuleType | None:
    if x.is_cuda:
        return _triton()
    return cpu_fused_kernels(x)


def cpu_fused_kernels(x: torch.Tensor) -> ModuleType | None:
    """The C++ kernels for a float32 or bfloat16 CPU tensor, else None: what the ops that
    have no Triton counterpart (MoE routing, per-head norms) take."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        return cpu_kernels()
    return None


@functools.cache
def _triton() -> ModuleType | None:
    try:
        from kvserve.layers import triton_kernels
    except ImportError as e:
        logger.warning("Triton is unavailable (%s): norms and activations run in plain torch", e)
        return None
    return triton_kernels
