"""What a benchmark needs to know of the device it runs on: when its work is done, how fast
it streams memory, which with the bytes a decode step must read gives the floor every decode
step is measured against, and how fast it multiplies matrices, the ceiling of a prefill."""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kvserve.cpu_cache import flush_cpu_caches
from kvserve.layers.linear import Linear
from kvserve.models.moe import SparseMoeBlock


def on_one_gpu(options: dict[str, Any], num_models: int) -> dict[str, Any]:
    """Engine options for one of `num_models` models that a benchmark holds at once (engines,
    a transformers baseline): on a GPU each engine's pool is sized from the memory left
    (`gpu_memory_utilization`), so each gets an equal part of that share, leaving the
    others room."""
    return {**options,
            "gpu_memory_utilization": options["gpu_memory_utilization"] / num_models}


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


def device_seconds(calls: Sequence[Callable[[], object]], device: str | torch.device,
                   repeats: int) -> float:
    """Median seconds per call of `calls`, run back to back as the device runs them. On CUDA
    they are captured in one CUDA graph and replayed, as decode steps are, so a kernel's time
    is the GPU's and not the host's launch cost (a Triton launch costs the host more than a
    small kernel costs the GPU); elsewhere each call is timed alone, with the caches emptied
    before it, so it reads its operands from memory as a decode step does."""
    if torch.device(device).type != "cuda":
        calls[0]()  # first-use costs
        seconds = []
        for i in range(repeats):
            flush_cpu_caches()
            seconds.append(timed(calls[i % len(calls)], device))
        return statistics.median(seconds)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # compile, autotune and allocate before the capture
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    seconds = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3 / len(calls))
    return statistics.median(seconds)


def copies_past_cache(num_bytes: int, device: str | torch.device) -> int:
    """How many copies of a call's `num_bytes` of operands to cycle through on CUDA so that
    each call reads them from memory, as a decode step does, and not from the L2 cache the
    call before it filled: together four times the L2. One elsewhere: a CPU call is timed
    alone, after the caches are emptied (`device_seconds`)."""
    if torch.device(device).type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, math.ceil(4 * l2 / max(num_bytes, 1)))


def past_cache_copies(method: Callable, num_bytes: int, device: str | torch.device
                      ) -> list[Callable]:
    """`method` and bound copies of it on deep copies of its object (its weights), as many
    as `copies_past_cache` asks for."""
    owner = method.__self__
    return [method] + [getattr(copy.deepcopy(owner), method.__name__)
                       for _ in range(copies_past_cache(num_bytes, device) - 1)]


def memory_bandwidth(device: str | torch.device = "cpu", num_bytes: int = 1 << 30,
                     repeats: int = 3) -> tuple[float, float]:
    """Best bytes/s on `device` of a large tensor copy (read + write counted) and of a
    read-only sum."""
    src = torch.ones(num_bytes // 4, device=device)
    dst = torch.zeros_like(src)
    copy = min(timed(lambda: dst.copy_(src), device) for _ in range(repeats))
    read = min(timed(src.sum, device) for _ in range(repeats))
    return 2 * num_bytes / copy, num_bytes / read


@dataclasses.dataclass
class BandwidthSamples:
    """A device's bandwidth measured beside a benchmark's timed work, after each part of it,
    and the median taken. A shared machine's bandwidth moves: a 2-core VM read 31-35 GB/s for
    minutes, then 49-54 for a second, and one measurement put the same TPOT at 1.5x and at
    2.3x its floor from one command to the next."""

    device: str | torch.device
    samples: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # copy, read

    def measure(self) -> None:
        self.samples.append(memory_bandwidth(self.device))

    @property
    def copy(self) -> float:
        return statistics.median(copy for copy, _ in self.samples)

    @property
    def read(self) -> float:
        return statistics.median(read for _, read in self.samples)

    def describe(self) -> str:
        reads = [read for _, read in self.samples]
        return (f"{self.copy / 1e9:.1f} GB/s copy / {self.read / 1e9:.1f} GB/s read bandwidth "
                f"(medians of {len(reads)} measurements beside the runs; read "
                f"{min(reads) / 1e9:.1f}-{max(reads) / 1e9:.1f})")


def weight_bytes(model: torch.nn.Module, rows: int = 1) -> int:
    """Bytes of the matmul weights `rows` tokens stream, which a decode step of that many
    rows streams once: all of them, but of a mixture-of-experts layer only the experts they
    pick (top-k for one token; for more, `SparseMoeBlock.token_linears`)."""
    return round(sum(linear.weight_bytes * times for linear, times in token_linears(model, rows)))


def matmul_params(module: torch.nn.Module) -> int:
    """Weights every token multiplies through in `module`'s linears: a token costs twice as
    many FLOPs."""
    return sum(linear.in_features * sum(linear.output_sizes) * times
               for linear, times in token_linears(module))


def token_linears(module: torch.nn.Module, rows: int = 1) -> Iterator[tuple[Linear, float]]:
    """`module`'s linears that `rows` tokens multiply through, each with how many times."""
    if isinstance(module, SparseMoeBlock):
        yield from module.token_linears(rows)
    elif isinstance(module, Linear):
        yield module, 1
    else:
        for child in module.children():
            yield from token_linears(child, rows)


def gemm_size(device: str | torch.device) -> int:
    """The side of the square GEMM that measures a device's peak: 2048 on a CPU (seconds
    there); a GPU finishes that in some 20 us, where its launch still counts, so 8192."""
    return 8192 if torch.device(device).type == "cuda" else 2048


def gemm_peak(device: str | torch.device, dtype: torch.dtype, repeats: int = 5) -> float:
    """Best FLOP/s of a `gemm_size` cubed matmul, through the engine's own `Linear` (the
    GEMM a prefill takes) or torch's matmul (cuBLAS, or oneDNN on CPU), whichever is
    faster: the machine's peak, not just the engine's."""
    size = gemm_size(device)
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
