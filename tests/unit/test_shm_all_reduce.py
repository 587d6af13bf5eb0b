"""The shared-memory all-reduce of CPU tensor-parallel ranks: exact sums, the same bits on
every rank, call after call (the two sets of slots alternating), large tensors in pieces,
and an error, not a hang, when a rank dies."""

from __future__ import annotations

import multiprocessing
import os
from queue import Empty

import pytest
import torch

from kvserve.worker.shm_all_reduce import MAX_BYTES
from kvserve.worker.tensor_parallel import all_reduce, free_port, init_tensor_parallel

SHAPES = [(1, 768), (3, 5), (2 * MAX_BYTES // 4 + 3,)]  # the last in 3 pieces of float32
DTYPES = [torch.float32, torch.bfloat16]


def rank_inputs(rank: int, call: int, shape: tuple[int, ...], dtype: torch.dtype
                ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(shape, generator=gen).to(dtype)


def _sums(rank: int, size: int, port: int, calls: int, results: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(rank, size, port, "cpu")
    out = []
    for call in range(calls):
        for shape in SHAPES:
            for dtype in DTYPES:
                out.append(all_reduce(rank_inputs(rank, call, shape, dtype)).float().numpy())
    results.put((rank, out))  # as arrays: tensors would go through file descriptors


def _one_rank_dies(rank: int, size: int, port: int, results: multiprocessing.Queue) -> None:
    init_tensor_parallel(rank, size, port, "cpu")
    all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(0)
    try:
        all_reduce(torch.ones(4))
        results.put("returned")
    except RuntimeError as e:
        results.put(str(e))


def run_ranks(target, size: int, *args) -> list:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=target, args=(rank, size, port, *args, results),
                                 daemon=True) for rank in range(size)]
    for p in processes:
        p.start()
    try:
        return [results.get(timeout=120) for _ in range(size if target is _sums else 1)]
    except Empty:
        pytest.fail("a rank did not answer")
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_same_exact_sum(size: int) -> None:
    calls = 5
    by_rank = dict(run_ranks(_sums, size, calls))
    expected = [sum(rank_inputs(r, call, shape, dtype).float() for r in range(size))
                for call in range(calls) for shape in SHAPES for dtype in DTYPES]
    dtypes = [dtype for _ in range(calls) for _ in SHAPES for dtype in DTYPES]
    for got, want, dtype in zip(by_rank[0], expected, dtypes, strict=True):
        tolerance = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(torch.from_numpy(got), want, atol=tolerance, rtol=tolerance)
    for rank in range(1, size):
        assert all((a == b).all() for a, b in zip(by_rank[0], by_rank[rank], strict=True))


def test_a_rank_that_died_is_reported_not_waited_for() -> None:
    assert run_ranks(_one_rank_dies, 2) == ["tensor-parallel rank 1 exited"]
