"""How the Triton kernels multiply in `tl.dot`. On a GPU the default for float32 inputs is
TF32 (10 mantissa bits), which drifts from the torch reference by far more than float32's
rounding; float32 models get IEEE products so that greedy outputs match it token for token.
16-bit inputs multiply exactly either way."""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"
