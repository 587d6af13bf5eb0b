"""Kernel choices timed on the GPU at hand. Where two kernels compute the same result and the
faster one depends on the GPU and the shape, the first call for a shape times each, and every
later call takes the winner."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence

import torch
import triton

logger = logging.getLogger(__name__)

_fastest: dict[Hashable, int] = {}


def fastest(key: Hashable, candidates: Sequence[Callable[[], object]], untimed: int) -> int:
    """The index of the fastest of `candidates` (calls of one shape) for `key`, timed at the
    first call for it. A call inside a CUDA graph capture, which cannot time, gets `untimed`
    and leaves the choice to a later call."""
    if key not in _fastest:
        if torch.cuda.is_current_stream_capturing():
            return untimed
        times = [triton.testing.do_bench(call, warmup=5, rep=25) for call in candidates]
        _fastest[key] = times.index(min(times))
        logger.debug("%s: %s ms, took %d", key, [round(t, 4) for t in times], _fastest[key])
    return _fastest[key]
