"""Instructions per weight in the main loop of the Triton W4A16 kernels, compiled for an
H100 (sm_90) with Triton's own ptxas and cuobjdump: no GPU needed.

    python scripts/w4a16_sass.py [--kernel gemv|tensor-cores] [--tiles ROWS,N,K,WARPS ...]

An H100 issues about 5 thread-instructions per 4-bit weight at its memory bandwidth (132 SMs
x 128 lanes x 1.98 GHz against 3.35 TB/s), so a loop near that count can keep up with
memory, and one far over it cannot: the GEMV's tiles that ran 9-10 per weight measured
2.6-4.5x their floor there. A count says nothing of latency, occupancy or launches; the GPU
has the last word.
"""

from __future__ import annotations

import argparse
import collections
import re

import torch
import triton
from sm90 import compile_for_h100
from triton.tools.disasm import get_sass

from kvserve.quantization import triton_gemm
from kvserve.triton_precision import dot_precision

TYPES = {"x_ptr": "*bf16", "input_order_ptr": "*i32", "words_ptr": "*i32",
            "scales_ptr": "*bf16", "zeros_ptr": "*bf16", "table_ptr": "*bf16",
            "out_ptr": "*bf16", "partials_ptr": "*fp32", "counters_ptr": "*i32",
            "M": "i32", "N": "i32", "K": "i32"}


def compiled_sass(gemv: bool, rows: int, block_n: int, block_k: int, warps: int) -> str:
    """The kernel for 4-bit weights in groups of 128 and bfloat16 rows, as SASS."""
    kernel = (triton_gemm._weight_only_gemv_kernel if gemv
              else triton_gemm._weight_only_gemm_kernel)
    constants = {"GROUP_SIZE": 128, "BITS": 4, "LUT": False, "ORDERED": False,
                 "BLOCK_N": block_n, "BLOCK_K": block_k}
    if gemv:
        constants |= {"PAIRS": True, "BLOCK_M": triton.next_power_of_2(rows), "STAGES": 3}
    else:
        constants |= {"PRECISION": dot_precision(torch.bfloat16),
                      "BLOCK_M": 16 if rows <= 16 else 32 if rows <= 32 else 64}
    options = {"num_warps": warps, "num_stages": 1 if gemv else 3}
    return get_sass(compile_for_h100(kernel, TYPES, constants, options,
                                     divisible=("N", "K")).asm["cubin"])


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body: the loop over the input."""
    lines = sass.splitlines()
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\w+:", line)}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA (\w+);", line)) and labels.get(m.group(1), i) < i]
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return [line.split("\t", 1)[1] for line in lines[start + 1:end + 1] if "\t" in line]


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0].rstrip(";")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=["gemv", "tensor-cores"], default="gemv")
    parser.add_argument("--tiles", nargs="+", default=["1,256,128,4", "2,128,64,4"],
                        help="ROWS,BLOCK_N,BLOCK_K,WARPS per tile")
    args = parser.parse_args()
    for tile in args.tiles:
        rows, block_n, block_k, warps = map(int, tile.split(","))
        loop = main_loop(compiled_sass(args.kernel == "gemv", rows, block_n, block_k, warps))
        per_thread = block_n * block_k / (warps * 32)  # weights a thread takes per pass
        common = collections.Counter(map(opcode, loop)).most_common(8)
        print(f"{args.kernel} rows {rows}, tile {block_n}x{block_k}, {warps} warps: "
              f"{len(loop)} instructions a pass, {len(loop) / per_thread:.2f} per weight; "
              + ", ".join(f"{name} {count}" for name, count in common))


if __name__ == "__main__":
    main()
