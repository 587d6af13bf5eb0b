"""Tensor parallelism over torch.distributed (Megatron's split): each rank holds 1/T of the
attention heads, KV heads and MLP columns. Layers that produce heads or MLP columns are
column-parallel (each rank computes its own outputs); the layers after them are
row-parallel (each rank multiplies its slice of the inputs, then the ranks sum their
partial outputs). On CPU the sums go through shared memory (gloo sets the group up), on
CUDA through NCCL. A process outside any group is rank 0 of 1.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvserve.worker.shm_all_reduce import SharedMemoryAllReduce


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1


_group = TensorParallelGroup()
_shared_memory: SharedMemoryAllReduce | None = None


def tp_group() -> TensorParallelGroup:
    return _group


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tensor_parallel(rank: int, size: int, port: int, device: str) -> None:
    """Joins this process to the group of `size` ranks rendezvousing on localhost:`port`."""
    global _group, _shared_memory
    cuda = device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size)
    _group = TensorParallelGroup(rank, size)
    if not cuda:
        _shared_memory = SharedMemoryAllReduce(rank, size, port)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums `x` over the ranks, in place."""
    if _group.size > 1 and not (_shared_memory is not None and _shared_memory(x)):
        dist.all_reduce(x)
    return x


def smallest_over_ranks(value: int, device: str) -> int:
    """The smallest of the ranks' `value`s (a size they must agree on), on every rank."""
    if _group.size == 1:
        return value
    x = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MIN)
    return int(x.item())


def rank_bounds(size: int, dim: int) -> tuple[int, int]:
    """This rank's [start, end) of a full checkpoint tensor's `size` entries along `dim`."""
    if size % _group.size:
        raise ValueError(f"dimension {dim} ({size}) does not divide among {_group.size} "
                         "tensor-parallel ranks")
    share = size // _group.size
    return _group.rank * share, (_group.rank + 1) * share


def rank_slice(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's slice of a full checkpoint tensor along `dim`."""
    if _group.size == 1:
        return tensor
    start, end = rank_bounds(tensor.shape[dim], dim)
    return tensor.narrow(dim, start, end - start)
