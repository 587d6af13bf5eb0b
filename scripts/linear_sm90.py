"""Registers, spills and weight-streaming of the split-K linear kernel's tiles, and of the
LoRA shrink and expand kernels, compiled for an H100 (sm_90) with Triton's own ptxas: no
GPU needed.

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
from kvserve.lora import triton_lora
from kvserve.triton_precision import dot_precision

TYPES = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "partials_ptr": "*fp32",
         "counters_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "a_ptr": "*bf16",
         "b_ptr": "*bf16", "t_ptr": "*bf16", "order_ptr": "*i64", "starts_ptr": "*i64",
         "num_rows": "i32", "in_features": "i32", "out_features": "i32", "width": "i32"}


def lora_usage() -> None:
    """The LoRA kernels at adapter widths of 16 and 64, as `add_lora` launches them."""
    for kernel in (triton_lora._shrink_kernel, triton_lora._expand_kernel):
        types = TYPES | {name: "i32" for name in kernel.arg_names if name.startswith("stride")}
        for width in (16, 64):
            constants = {"BLOCK_M": 16, "BLOCK_K": 64, "BLOCK_N": 64, "BLOCK_R": width,
                         "PRECISION": dot_precision(torch.bfloat16)}
            compiled = compile_for_h100(
                kernel, types, {k: v for k, v in constants.items() if k in kernel.arg_names},
                {"num_warps": 4, "num_stages": 3},
                divisible=("in_features", "out_features", "stride_x", "stride_a", "stride_b",
                           "stride_out"))
            usage = resources(compiled)
            print(f"lora {kernel.__name__.strip('_').split('_')[0]} width {width}: "
                  f"{usage['REG']} registers, {usage['STACK']} bytes spilled a thread")


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
    lora_usage()


if __name__ == "__main__":
    main()
