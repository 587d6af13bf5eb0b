"""Registers and spills of the Triton attention kernels as the engine launches them,
compiled for an H100 (sm_90) with Triton's own ptxas: no GPU needed.

    python scripts/attention_sm90.py [--head-dims 64 128 256] [--group 4]

A kernel that spills (STACK > 0) keeps part of its tiles in local memory, which every
key tile's pass then reads and writes again; the GPU has the last word on speed.
"""

from __future__ import annotations

import argparse

import torch
import triton
from sm90 import compile_for_h100, resources

from kvserve.attention.triton import decode, varlen
from kvserve.triton_precision import dot_precision

TYPES = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "block_tables_ptr": "*i64",
         "query_start_ptr": "*i64", "seq_lens_ptr": "*i64", "positions_ptr": "*i64",
         "out_ptr": "*bf16", "part_ptr": "*fp32", "lse_ptr": "*fp32", "counters_ptr": "*i32",
         "scale": "fp32", "unified_max": "fp32", "window": "i32", "num_seqs": "i32",
         "decode_count_ptr": "*i64", "split_target": "i32"}
BLOCK_SIZE = 16


def varlen_usage(head_dim: int, group: int, softcap: float = 0.0) -> dict[str, int]:
    """`softcap`: Gemma 2's capped scores (50), compiled in where it is above 0."""
    config = varlen.tile_config(head_dim, BLOCK_SIZE)
    constants = {"NUM_KV_HEADS": 8, "GROUP": group, "HEAD_DIM": head_dim,
                 "BLOCK_SIZE": BLOCK_SIZE,
                 "BLOCK_Q": varlen.queries_per_tile(group), "BLOCK_N": config["BLOCK_N"],
                 "BLOCK_M": max(varlen.TILE_ROWS, triton.next_power_of_2(group)),
                 "PRECISION": dot_precision(torch.bfloat16), "HAS_POSITIONS": False,
                 "SKIP_DECODES": True, "SOFTCAP": softcap}
    compiled = compile_for_h100(varlen._varlen_kernel, _with_strides(varlen._varlen_kernel),
                                constants, {"num_warps": config["num_warps"]},
                                _head_strides(varlen._varlen_kernel))
    return {"warps": config["num_warps"], "BLOCK_N": config["BLOCK_N"], **resources(compiled)}


def decode_usage(head_dim: int, group: int, counted: bool = False,
                 softcap: float = 0.0) -> dict[str, int]:
    """`counted`: as a mixed-step graph launches it, the decode count read on the device;
    `softcap` as in `varlen_usage`."""
    constants = {"GROUP": group, "BLOCK_G": max(16, triton.next_power_of_2(group)),
                 "HEAD_DIM": head_dim, "BLOCK_SIZE": BLOCK_SIZE, "BLOCK_N": decode.BLOCK_N,
                 "NUM_SPLITS": decode.MAX_SPLITS, "SPLITS_POW2": decode.MAX_SPLITS,
                 "MERGE_HEADS": decode.merge_heads(group, decode.MAX_SPLITS, head_dim),
                 "PRECISION": dot_precision(torch.bfloat16),
                 "UNIFIED": False, "UNIFIED_RANGE": 60.0, "COUNTED": counted,
                 "SOFTCAP": softcap}
    compiled = compile_for_h100(decode._decode_split_kernel,
                                _with_strides(decode._decode_split_kernel), constants,
                                {"num_warps": 4}, _head_strides(decode._decode_split_kernel))
    return {"warps": 4, "BLOCK_N": decode.BLOCK_N, **resources(compiled)}


def _with_strides(kernel: triton.JITFunction) -> dict[str, str]:
    return TYPES | {name: "i32" for name in kernel.arg_names if name.startswith("stride")}


def _head_strides(kernel: triton.JITFunction) -> tuple[str, ...]:
    """The strides a launch finds divisible by 16: whole heads. A block table's row is as
    long as the longest sequence's blocks, any number."""
    return tuple(name for name in kernel.arg_names
                 if name.startswith("stride") and name != "stride_bt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    args = parser.parse_args()
    for head_dim in args.head_dims:
        for name, usage in (("varlen", varlen_usage), ("decode", decode_usage),
                            ("counted decode", lambda *a: decode_usage(*a, counted=True)),
                            ("softcapped varlen", lambda *a: varlen_usage(*a, softcap=50.0)),
                            ("softcapped decode", lambda *a: decode_usage(*a, softcap=50.0))):
            row = usage(head_dim, args.group)
            print(f"{name} head_dim {head_dim}, group {args.group}: {row['warps']} warps, "
                  f"key tiles of {row['BLOCK_N']}: {row['REG']} registers, "
                  f"{row['STACK']} bytes spilled a thread")


if __name__ == "__main__":
    main()
