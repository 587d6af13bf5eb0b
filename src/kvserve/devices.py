"""The devices the engine runs on, `cpu`, `cuda` or `cuda:N`: one named otherwise, or one
this machine lacks, is refused by name before anything is loaded onto it."""

from __future__ import annotations

import torch


def check_device_name(device: str) -> None:
    if not (device in ("cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")


def check_device(device: str, tensor_parallel_size: int = 1) -> None:
    """Raises, naming what is missing, unless this machine has `device` (and, for CUDA, one
    device per tensor-parallel rank)."""
    check_device_name(device)
    if device == "cpu":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device {device}: no CUDA device is available to this torch "
                         f"({torch.__version__})")
    needed = max(int(device[5:] or 0) + 1, tensor_parallel_size)
    if needed > torch.cuda.device_count():
        raise ValueError(f"device {device}"
                         + (f" with tensor_parallel_size {tensor_parallel_size}"
                            if tensor_parallel_size > 1 else "")
                         + f" needs {needed} CUDA devices, and {torch.cuda.device_count()} "
                         "are visible")
