"""`kvserve bench quantized`: weight-only quantized GEMMs against the dense layer the engine
would run instead, on one model's linear shapes (llama3-8b's by default).

For each shape and number of rows, the dense layer as the engine runs it in `--dtype` (the
blocked GEMM or oneDNN on CPU, cuBLAS on CUDA) is the baseline; each quantized kernel the
device has (CPU: PyTorch's int4 and int8, our W4A8/W8A8 on VNNI and on AMX's int8 tiles, and
the same bytes dequantized into the blocked GEMM's tiles; CUDA: the Triton W4A16 and W8A16
GEMMs, and in bfloat16 PyTorch's int4 GEMM, tinygemm) is timed on the same random weight, RTN
quantized, with its speed-up over dense and its time over its own floor: its weight bytes at
the copy bandwidth, measured after each layer and batch and the median taken. On CUDA the
calls replay from a CUDA graph, as in a decode step, over enough copies of the weight that
none is read from the L2 cache; on CPU each call follows a read that empties the caches
(`device.device_seconds`). Triton's two kernels are timed apart, the GEMV up to the rows it
takes; each row names the tile its autotuner picked.

On CUDA the dense layer is timed twice up to 16 rows: cuBLAS (the baseline) and the split-K
kernel the engine picks instead where it times faster (`layers/triton_linear.py`); for `down`,
both also of a [gate | up] input, with SiLU-and-mul's own launch before cuBLAS and fused into
the split-K kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable

import torch

from kvserve.arg_types import available_device, positive_int
from kvserve.benchmarks.device import BandwidthSamples, device_seconds, past_cache_copies
from kvserve.benchmarks.report import print_table, save_json
from kvserve.config import resolve_dtype
from kvserve.layers.linear import Linear
from kvserve.quantization.cpu_kernels import (
    WxA8Weight,
    amx_int8_runs,
    cpu_candidates,
    dequantized_gemm_runs,
    integer_gemm_runs,
)
from kvserve.quantization.gptq import QuantizedWeight, rtn
from kvserve.quantization.kernels import num_programs
from kvserve.quantization.torch_int4 import int4_weight, int4_weight_fits

LLAMA3_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
             "down": (14336, 4096)}


@dataclasses.dataclass
class DenseOnCuda:
    """The dense layer on CUDA, run by cuBLAS or by the split-K kernel (`triton_linear`).
    `gated`: of a [gate | up] input, SiLU-and-mul's launch before cuBLAS, or fused into the
    split-K kernel's loads."""
    weight: torch.Tensor
    split_k: bool
    gated: bool
    num_programs: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from kvserve.layers import triton_linear

        if self.split_k:
            return triton_linear.split_k_linear(x, self.weight, self.num_programs, self.gated)
        return triton_linear.cublas_linear(x, self.weight, self.gated)


def _kernels(weight: torch.Tensor, layer: str, args: argparse.Namespace, dtype: torch.dtype
             ) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int, int]]:
    """name -> (matmul, weight bytes, input width) for the dense layer (on CUDA: cuBLAS
    first, then the split-K kernel, and for `down` both of a gated input) and every quantized
    kernel."""
    out_features, in_features = weight.shape
    with torch.device(args.device):
        dense = Linear(in_features, [out_features], False, dtype)
    dense.load("weight", 0, weight.to(args.device, dtype))
    dense.prepare()
    kernels = {}
    if dense.form != "out_major":  # CPU
        kernels["dense"] = (dense.forward, dense.weight_bytes, in_features)
    else:
        for gated in (False, True) if layer == "down" else (False,):
            for split_k in (False, True):
                name = (f"dense{' of gate, up' if gated else ''} "
                        f"({'Triton split-K' if split_k else 'cuBLAS'})")
                run = DenseOnCuda(dense.weight, split_k, gated, dense.num_programs)
                kernels[name] = (run.matmul, dense.weight_bytes, (1 + gated) * in_features)
    quantized: dict[str, QuantizedWeight] = {
        f"int4 g{args.group_size}": rtn(weight, 4, args.group_size, sym=True),
        "int8 per-channel": rtn(weight, 8, in_features, sym=True)}
    for name, q in quantized.items():
        if torch.device(args.device).type == "cuda":
            from kvserve.quantization.triton_gemm import GEMV, TENSOR_CORES, pack_for_triton

            device = torch.device(args.device)
            triton = pack_for_triton([q], dtype, device, num_programs(device))
            for kind in (GEMV, TENSOR_CORES):
                kernel = dataclasses.replace(triton, kernel=kind)
                kernels[f"{name} (Triton {kind})"] = (kernel.matmul, kernel.num_bytes,
                                                      in_features)
            if (triton.bits == 4 and dtype == torch.bfloat16
                    and int4_weight_fits(q.shape, args.group_size, device)):
                tinygemm = int4_weight(q.intweight, q.scales, q.zeros, args.group_size, None,
                                       device)
                kernels[f"{name} (torch int4)"] = (tinygemm.matmul, tinygemm.num_bytes,
                                                   in_features)
            continue
        for kernel in cpu_candidates([q]).packed():
            if kernel is not None:
                kernels[f"{name} ({type(kernel).__name__})"] = (kernel.matmul, kernel.num_bytes,
                                                                in_features)
            if isinstance(kernel, WxA8Weight) and integer_gemm_runs(kernel):
                gemm = dataclasses.replace(kernel, gemm_from=1)
                kernels[f"{name} (integer GEMM)"] = (gemm.matmul, kernel.num_bytes, in_features)
            if isinstance(kernel, WxA8Weight) and amx_int8_runs(kernel):
                amx = dataclasses.replace(kernel, amx_from=1)
                kernels[f"{name} (AMX int8 tiles)"] = (amx.matmul, kernel.num_bytes, in_features)
            if isinstance(kernel, WxA8Weight) and dequantized_gemm_runs(in_features, dtype):
                dequantized = dataclasses.replace(kernel, dequantized_from=1)
                kernels[f"{name} (dequantized GEMM)"] = (dequantized.matmul, kernel.num_bytes,
                                                         in_features)
    return kernels


def run(args: argparse.Namespace) -> None:
    dtype = resolve_dtype(args.dtype, {}, args.device)
    bandwidth = BandwidthSamples(args.device)
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, object]] = []
    timings: list[tuple[int, float]] = []  # each row's weight bytes and seconds
    for layer, (in_features, out_features) in LLAMA3_8B.items():
        if args.layers and layer not in args.layers:
            continue
        weight = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5
        kernels = _kernels(weight, layer, args, dtype)
        for batch in args.batches:
            x = torch.randn(batch, 2 * in_features, generator=gen).to(args.device, dtype)
            dense_seconds = 0.0
            first_row = len(rows)
            for name, (matmul, num_bytes, width) in kernels.items():
                if "Triton" in name:  # CUDA only, where Triton is installed
                    from kvserve.layers.triton_linear import MAX_ROWS
                    from kvserve.quantization.triton_gemm import GEMV_MAX_ROWS, chosen_tile
                    if ("GEMV" in name and batch > GEMV_MAX_ROWS
                            or "split-K" in name and batch > MAX_ROWS):
                        continue
                rows_in = x[:, :width].contiguous()
                calls = [functools.partial(m, rows_in)
                         for m in past_cache_copies(matmul, num_bytes, args.device)]
                seconds = device_seconds(calls, args.device, args.repeats)
                dense_seconds = dense_seconds or seconds
                rows.append({"layer": f"{layer} {in_features}->{out_features}", "rows": batch,
                             "kernel": name, "ms": round(seconds * 1e3, 3),
                             "speed-up vs dense": round(dense_seconds / seconds, 2)})
                timings.append((num_bytes, seconds))
                if "Triton" in name and "split-K" not in name:
                    rows[-1]["tile"] = chosen_tile(gemv="GEMV" in name)
            bandwidth.measure()
            print_table(rows[first_row:])
    for row, (num_bytes, seconds) in zip(rows, timings, strict=True):
        row["time / own floor"] = round(seconds * bandwidth.copy / num_bytes, 2)
    print_table(rows, title=(
        f"weight-only quantized GEMMs, {args.device}, activations {dtype}, llama3-8b shapes, "
        f"medians of {args.repeats}; floor = the kernel's weight bytes at the copy bandwidth, "
        f"{bandwidth.describe()}"))
    save_json(args.json, {"benchmark": "quantized", "device": args.device,
                          "dtype": str(dtype), "copy_bandwidth": bandwidth.copy,
                          "bandwidth_samples": bandwidth.samples, "rows": rows})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantized", help="quantized GEMM kernels against the dense layer")
    p.add_argument("--device", type=available_device, default="cpu",
                   help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16",
                                                       "float16"],
                   help="the dense layer's dtype (auto: as the engine picks it for a float32 "
                        "checkpoint on this device)")
    p.add_argument("--layers", nargs="+", choices=sorted(LLAMA3_8B), default=None)
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 4, 16, 32, 128])
    p.add_argument("--group-size", type=positive_int, default=128)
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)
