"""Registers, spills and weight-streaming of the split-K linear kernel's tiles, compiled
for an H100 (sm_90) with Triton's own ptxas: no GPU needed.

    python scripts/linear_sm90.py

A tile that spills keeps part of its accumulator in local memory; one without `LDGSTS`
(cp.async) loads each weight tile into registers and waits for it, where a pipelined loop
has the next tiles in flight. The GPU has the last word on speed.
"""

from __future__ import annotations

import torch
from sm90 import compile_for_h100, resources
from triton.tools.disasm import get_sass

from kvserve.layers import triton_linear
from kvserve.triton_precision import dot_precision

TYPES = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "partials_ptr": "*fp32",
         "counters_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32"}


def main() -> None:
    for config in triton_linear.TILE_CONFIGS:
        for gated in (False, True):
            constants = {"GATED": gated, "PRECISION": dot_precision(torch.bfloat16),
                         "BLOCK_M": triton_linear.MAX_ROWS, **config.kwargs}
            compiled = compile_for_h100(
                triton_linear._split_k_linear_kernel, TYPES, constants,
                {"num_warps": config.num_warps, "num_stages": config.num_stages},
                divisible=("N", "K"))
            usage = resources(compiled)
            async_copies = get_sass(compiled.asm["cubin"]).count("LDGSTS")
            print(f"tile {config.kwargs['BLOCK_N']}x{config.kwargs['BLOCK_K']}"
                  f"{', gated' if gated else ''}: {config.num_warps} warps, "
                  f"{usage['REG']} registers, {usage['STACK']} bytes spilled a thread, "
                  f"{async_copies} LDGSTS")


if __name__ == "__main__":
    main()
