"""Picks the attention backend for a device and head size."""

from __future__ import annotations

import logging

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.cpu_paged import CpuPagedAttention
from kvserve.attention.torch_ref import TorchPagedAttention
from kvserve.cpp_extension import cpu_kernels

logger = logging.getLogger(__name__)


def get_attention_backend(device: str, head_dim: int, softcap: float | None = None
                          ) -> AttentionBackend:
    """`softcap`: Gemma 2's attention logit softcapping, which every backend computes."""
    if torch.device(device).type == "cuda":
        return _cuda_backend(device, head_dim, softcap)
    kernel = cpu_kernels() if device == "cpu" else None
    return (CpuPagedAttention(kernel, softcap) if kernel is not None
            else TorchPagedAttention(softcap))


def _cuda_backend(device: str, head_dim: int, softcap: float | None) -> AttentionBackend:
    """Triton's kernels tile head dimensions in powers of two from 16 up."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        logger.warning("head_dim %d: no Triton attention kernel, using plain torch", head_dim)
        return TorchPagedAttention(softcap)
    try:
        from kvserve.attention.triton.backend import TritonPagedAttention
    except ImportError as e:
        logger.warning("Triton is unavailable (%s): attention runs in plain torch", e)
        return TorchPagedAttention(softcap)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return TritonPagedAttention(num_programs=2 * sms, softcap=softcap)
