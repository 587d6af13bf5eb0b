"""What a benchmark needs to know of the device it runs on: when its work is done, how fast
it streams memory, which with the bytes a decode step must read gives the floor every decode
step is measured against, and how fast it multiplies matrices, the ceiling of a prefill."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvserve.layers.linear import Linear


def synchronize(device: str | torch.device) -> None:
    """Waits for the device's queued work (a no-op on CPU), so a timer sees all of it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: str | torch.device = "cpu") -> float:
    """Seconds `fn` takes, including the device work it queued."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def memory_bandwidth(device: str | torch.device = "cpu", num_bytes: int = 1 << 30,
                     repeats: int = 5) -> tuple[float, float]:
    """Best bytes/s on `device` of a large tensor copy (read + write counted) and of a
    read-only sum."""
    src = torch.ones(num_bytes // 4, device=device)
    dst = torch.zeros_like(src)
    copy = min(timed(lambda: dst.copy_(src), device) for _ in range(repeats))
    read = min(timed(src.sum, device) for _ in range(repeats))
    return 2 * num_bytes / copy, num_bytes / read


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every matmul weight: what each decode step streams once."""
    return sum(m.weight_bytes for m in model.modules() if isinstance(m, Linear))


def matmul_params(module: torch.nn.Module) -> int:
    """Weights every token multiplies through in `module`'s linears: a token costs twice as
    many FLOPs."""
    return sum(m.in_features * sum(m.output_sizes) for m in module.modules()
               if isinstance(m, Linear))


def gemm_peak(device: str | torch.device, dtype: torch.dtype, size: int = 2048,
              repeats: int = 5) -> float:
    """Best FLOP/s of a size x size x size matmul, through the engine's own `Linear` (the
    GEMM a prefill takes) or torch's matmul (cuBLAS, or oneDNN on CPU), whichever is
    faster: the machine's peak, not just the engine's."""
    with torch.device(device):
        layer = Linear(size, [size], False, dtype)
        weight = torch.randn(size, size, dtype=dtype)
        layer.load("weight", 0, weight)
        layer.prepare()
        weight = weight.t().contiguous()
        x = torch.randn(size, size, dtype=dtype)
    with torch.inference_mode():
        seconds = []
        for matmul in (layer, lambda x: x @ weight):
            matmul(x)
            seconds += [timed(lambda m=matmul: m(x), device) for _ in range(repeats)]
    return 2 * size ** 3 / min(seconds)
