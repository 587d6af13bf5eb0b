"""Linear layers over a few rows (decode steps) on CUDA: a split-K GEMM in Triton over the
checkpoint's [out, in] weight, optionally with SiLU-and-mul fused into its input.

At a few rows a linear layer reads its weight once and does little arithmetic, so its time
is the weight's bytes over the bandwidth the launch reaches. cuBLAS comes near that on most
of llama3-8b's shapes, not all: on an H100, o_proj took 1.9x its floor. Here the input
dimension is split until the launch has about `num_programs` programs, and the last program
of each output tile to finish adds up the parts (`triton_splits`): the sum takes no launch of
its own. With `gated`, the input is a [gate | up] projection's output, and each program
computes silu(gate) * up for its own input channels as it loads them: the MLP's activation
takes no launch either.

Which of this kernel and cuBLAS runs a shape at a number of rows is timed at its first call
(`triton_timing`). `KVSERVE_DENSE_KERNEL` overrides the choice: `auto` (the default),
`cublas`, or `triton` (this kernel at up to MAX_ROWS rows on any device, with the weight in
CUDA's layout: on a CPU under Triton's interpreter, for tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvserve.config import env_choice
from kvserve.layers.triton_kernels import silu_and_mul, silu_times
from kvserve.triton_precision import dot_precision
from kvserve.triton_splits import (
    check_split_groups,
    split_counters,
    splits_for_tiles,
    store_split_tile,
)
from kvserve.triton_timing import fastest

MAX_ROWS = 16  # one tensor-core tile of rows; more rows are cuBLAS's
MIN_BLOCK_K = 64  # the input width must be a whole number of tiles
CHOICES = ("auto", "cublas", "triton")


@triton.jit
def _split_k_linear_kernel(x_ptr, w_ptr, out_ptr, partials_ptr, counters_ptr, M, N, K,
                           GATED: tl.constexpr, PRECISION: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    """out [M, N] = x [M, K] @ w [N, K]^T for columns pid_n's tile and split `split` of the
    input channels; with GATED, x is silu(gate) * up of [M, 2K] rows [gate | up]."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    num_splits = tl.num_programs(1)
    k_per_split = tl.cdiv(tl.cdiv(K, num_splits), BLOCK_K) * BLOCK_K
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows[:, None] * (2 * K if GATED else K)
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K  # a vocabulary's head passes 2^31
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
        if GATED:
            x = silu_times(x, tl.load(x_rows + K + ks[None, :], mask=row_ok[:, None],
                                      other=0.0))
        w = tl.load(w_cols + ks[:, None], mask=col_ok[None, :], other=0.0)
        acc += tl.dot(x, w, input_precision=PRECISION)
    store_split_tile(acc, rows, cols, M, N, out_ptr, partials_ptr, counters_ptr + pid_n, split,
                     num_splits)


def _fitting_tiles(configs: list[triton.Config], named_args: dict, **kwargs: object
                   ) -> list[triton.Config]:
    """Tiles whose width divides the input's; under the interpreter, which has nothing to
    time, only the first."""
    fitting = [c for c in configs if named_args["K"] % c.kwargs["BLOCK_K"] == 0]
    return fitting if named_args["x_ptr"].is_cuda else fitting[:1]


# Compiled for an H100 as a launch specializes them, these tiles stream the weight through
# cp.async in 4 stages, at up to 118 registers a thread and no spills (gated or not); the
# GPU's first call of a shape times them all.
TILE_CONFIGS = [triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=4,
                              num_stages=4)
                for block_n in (32, 64, 128) for block_k in (MIN_BLOCK_K, 128, 256)
                if block_n * block_k <= 128 * 128]
_tuned = triton.autotune(
    TILE_CONFIGS, key=["N", "K", "GATED"],
    prune_configs_by={"early_config_prune": _fitting_tiles},
    do_bench=lambda call, quantiles: triton.testing.do_bench(call, warmup=5, rep=25,
                                                             quantiles=quantiles),
)(_split_k_linear_kernel)


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, num_programs: int,
                   gated: bool = False) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] (with `gated`, [M, 2K] rows [gate | up]) @ weight [N, K]^T, in
    x's dtype; K a multiple of MIN_BLOCK_K."""
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    n = weight.shape[0]
    assert m <= MAX_ROWS and k % MIN_BLOCK_K == 0 and weight.shape[1] == k
    assert x.is_contiguous() and weight.is_contiguous()
    check_split_groups(num_programs)  # split only while tiles are fewer than num_programs

    def splits(tile: dict) -> int:
        return splits_for_tiles(triton.cdiv(n, tile["BLOCK_N"]), k, tile["BLOCK_K"],
                                num_programs)

    most_splits = max(splits(c.kwargs) for c in TILE_CONFIGS)  # room for any tile
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partials = out if most_splits == 1 else torch.empty(most_splits, m, n, dtype=torch.float32,
                                                        device=x.device)
    _tuned[lambda tile: (triton.cdiv(n, tile["BLOCK_N"]), splits(tile))](
        x, weight, out, partials, split_counters(x.device), m, n, k, GATED=gated,
        PRECISION=dot_precision(x.dtype), BLOCK_M=MAX_ROWS)
    return out


def kernel_choice() -> str:
    return env_choice("KVSERVE_DENSE_KERNEL", CHOICES)


def split_k_runs(x: torch.Tensor, weight: torch.Tensor, num_programs: int,
                 gated: bool) -> bool:
    """Whether the split-K kernel runs `x` (rows, as for `split_k_linear`) through `weight`:
    by `KVSERVE_DENSE_KERNEL`, or where it timed faster than cuBLAS (with SiLU-and-mul's
    own launch before it, for `gated`) at the first call of the shape with as many rows
    (rounded up to a power of two). A call inside a CUDA graph capture, which cannot time,
    takes cuBLAS."""
    if len(x) > MAX_ROWS or weight.shape[1] % MIN_BLOCK_K or not x.is_contiguous():
        return False
    choice = kernel_choice()
    if choice == "cublas":
        return False
    if choice == "triton" or not x.is_cuda:
        return choice == "triton"
    key = ("dense split-K", tuple(weight.shape), gated, triton.next_power_of_2(len(x)),
           x.dtype, x.device)
    candidates = [lambda: split_k_linear(x, weight, num_programs, gated),
                  lambda: cublas_linear(x, weight, gated)]
    return fastest(key, candidates, untimed=1) == 0


def cublas_linear(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """What the split-K kernel stands in for: cuBLAS, after SiLU-and-mul's own launch for a
    `gated` input."""
    return F.linear(silu_and_mul(x) if gated else x, weight)
