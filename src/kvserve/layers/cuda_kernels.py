"""Whether a layer's input goes to the Triton kernels: on CUDA, where Triton is installed."""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

logger = logging.getLogger(__name__)


def cuda_kernels(x: torch.Tensor) -> ModuleType | None:
    return _load() if x.is_cuda else None


@functools.cache
def _load() -> ModuleType | None:
    try:
        from kvserve.layers import triton_kernels
    except ImportError as e:
        logger.warning("Triton is unavailable (%s): norms and activations run in plain torch", e)
        return None
    return triton_kernels
