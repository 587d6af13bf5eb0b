"""`kvserve bench kernels`: paged decode attention against the device's bandwidth floor.

Decode attention reads every cached key and value of the batch once, so its floor is those
bytes at the copy bandwidth, measured after each case and the median taken. Each kernel the
device has is timed on the same random paged cache: on CUDA the Triton split-K kernel with the
exact softmax merge (4 warps a program, the engine's, and 8, with half the registers a
thread), with FlashDecoding++'s unified maximum, and the varlen kernel that a graph-replayed
step with chunks runs its decodes in (one program per sequence and KV head, no split); on
CPU the C++ kernel; everywhere the plain-torch reference, which gathers the blocks first. On
CUDA the calls replay from a CUDA graph, as in a decode step, over enough copies of the cache
that none is read from the L2 cache; on CPU each call follows a read that empties the caches.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import numpy as np
import torch

from kvserve.arg_types import available_device, positive_int
from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.cpu_paged import CpuPagedAttention
from kvserve.attention.torch_ref import TorchPagedAttention
from kvserve.benchmarks.device import BandwidthSamples, copies_past_cache, device_seconds
from kvserve.benchmarks.report import print_table, save_json
from kvserve.config import resolve_dtype
from kvserve.cpp_extension import cpu_kernels

DecodeFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def decode_case(batch: int, context: int, args: argparse.Namespace, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Queries, a pool holding `batch` contexts in shuffled blocks, and their metadata."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // args.block_size)
    num_blocks = batch * per_seq
    cache = torch.randn(2, args.num_kv_heads, num_blocks, args.block_size, args.head_dim,
                        dtype=dtype, device=args.device)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_seq).to(args.device)
    q = torch.randn(batch, args.num_heads, args.head_dim, dtype=dtype, device=args.device)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long, device=args.device),
        query_start_loc=torch.arange(batch + 1, device=args.device),
        seq_lens=torch.full((batch,), context, device=args.device), block_tables=tables,
        num_decodes=batch, seq_lens_host=np.full(batch, context), prefills=[],
        sliding_window=None)
    return q, cache, meta


def decode_kernels(args: argparse.Namespace) -> dict[str, DecodeFn]:
    scale = args.head_dim ** -0.5
    kernels: dict[str, DecodeFn] = {}
    if torch.device(args.device).type == "cuda":
        from kvserve.attention.triton.decode import num_splits_for, paged_decode_attention
        from kvserve.attention.triton.varlen import paged_varlen_attention

        sms = torch.cuda.get_device_properties(args.device).multi_processor_count

        def triton_decode(unified_max: float | None, num_warps: int = 4) -> DecodeFn:
            def run(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
                    ) -> torch.Tensor:
                splits = num_splits_for(q.shape[0], cache.shape[1],
                                        int(meta.seq_lens_host.max()), 2 * sms)
                return paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens,
                                              scale, None, splits, unified_max=unified_max,
                                              num_warps=num_warps)
            return run

        kernels["triton, exact merge"] = triton_decode(None)
        kernels["triton, exact merge, 8 warps"] = triton_decode(None, num_warps=8)
        kernels[f"triton, unified max {args.unified_max:g}"] = triton_decode(args.unified_max)
        # A graph-replayed step with chunks runs its decodes here, unsplit.
        kernels["triton varlen, as in a mixed graph"] = lambda q, cache, meta: (
            paged_varlen_attention(q, cache, meta.block_tables, meta.query_start_loc,
                                   meta.seq_lens, scale, None, torch.empty_like(q), 2 * sms))
    elif cpu_kernels() is not None:
        cpu = CpuPagedAttention(cpu_kernels())
        kernels["cpu kernel"] = lambda q, cache, meta: cpu.decode(q, cache, meta, scale)
    kernels["torch gather"] = lambda q, cache, meta: TorchPagedAttention().decode(
        q, cache, meta, scale)
    return kernels


def run(args: argparse.Namespace) -> None:
    if args.num_heads % args.num_kv_heads:
        raise ValueError(f"--num-heads ({args.num_heads}) must be a multiple of "
                         f"--num-kv-heads ({args.num_kv_heads})")
    dtype = resolve_dtype(args.dtype, {}, args.device)
    bandwidth = BandwidthSamples(args.device)
    kernels = decode_kernels(args)
    rows: list[dict[str, object]] = []
    timings: list[tuple[int, float]] = []  # each row's KV bytes and seconds
    for context in args.contexts:
        for batch in args.batches:
            q, cache, meta = decode_case(batch, context, args, dtype)
            kv_bytes = cache.numel() * cache.element_size()
            cases = [(q, cache, meta)] + [decode_case(batch, context, args, dtype) for _ in
                                          range(copies_past_cache(kv_bytes, args.device) - 1)]
            for name, kernel in kernels.items():
                calls = [functools.partial(kernel, *case) for case in cases]
                seconds = device_seconds(calls, args.device, args.repeats)
                rows.append({"context": context, "batch": batch, "kernel": name,
                             "ms": round(seconds * 1e3, 3),
                             "GB/s": round(kv_bytes / seconds / 1e9, 1)})
                timings.append((kv_bytes, seconds))
            bandwidth.measure()
            print_table(rows[-len(kernels):])
    for row, (kv_bytes, seconds) in zip(rows, timings, strict=True):
        floor = kv_bytes / bandwidth.copy
        row |= {"floor ms": round(floor * 1e3, 3), "time / floor": round(seconds / floor, 2)}
    print_table(rows, title=(
        f"paged decode attention, {args.device}, {dtype}, {args.num_heads}/{args.num_kv_heads} "
        f"heads of {args.head_dim}, block {args.block_size}, medians of {args.repeats}; floor "
        f"= the batch's KV at the copy bandwidth, {bandwidth.describe()}"))
    save_json(args.json, {"benchmark": "kernels", "device": args.device, "dtype": str(dtype),
                          "copy_bandwidth": bandwidth.copy,
                          "bandwidth_samples": bandwidth.samples, "rows": rows})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernels", help="paged decode attention kernels against the KV "
                                       "bandwidth floor")
    p.add_argument("--device", type=available_device, default="cpu",
                   help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16",
                                                       "float16"],
                   help="auto: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--num-heads", type=positive_int, default=32, help="query heads (llama3-8b: 32)")
    p.add_argument("--num-kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--contexts", type=positive_int, nargs="+", default=[1024, 4096])
    p.add_argument("--unified-max", type=float, default=0.0,
                   help="the fixed softmax maximum of the unified-max variant")
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)
