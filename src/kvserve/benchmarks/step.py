"""`kvserve bench step`: what a prefill chunk costs when it rides in a decode step.

Stall-free chunked prefill (Sarathi-Serve) lowers time per output token only where a decode
step leaves the hardware idle, so prefill tokens added to it are nearly free: true of a GPU,
whose decode steps are bound by memory bandwidth. This times the model runner on synthetic
steps (B decodes at a given context, plus a prefill chunk of c tokens continuing a prompt of
the same context) and reports the ride-along ratio: the time a chunk adds to a decode step
over the time the same chunk takes in a step of its own. Near 0, chunking hides prefill work
inside decodes; near 1, it only moves that work around, and prefill-first (whole prompts, at
the per-token cost of the largest chunk alone) does as well on TPOT.

Where steps with chunks replay CUDA graphs, each such step is also timed eagerly (as with
`--max-graph-tokens 0`): the graphs' gain, in the same run.

Each decode-only step is also set against its roofline: the bytes it must read (every matmul
weight once, and each sequence's KV) at the device's copy bandwidth, measured after each
number of decodes' steps and the median taken (`BandwidthSamples`). Of a mixture-of-experts
layer it reads only the experts its rows pick, counted as if they routed uniformly at random:
the decodes have varied tokens, as a real batch has.
A prefill of `--prefill-tokens` from an empty cache is set against the device's GEMM peak
(the engine's own matmul path, measured in the same run): the share of it that the prefill's
matmul FLOPs reach.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvserve.arg_types import non_negative_int, positive_int
from kvserve.benchmarks.device import (
    BandwidthSamples,
    gemm_peak,
    gemm_size,
    matmul_params,
    synchronize,
    weight_bytes,
)
from kvserve.benchmarks.report import print_table, save_json
from kvserve.config import ModelConfig
from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.core.scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams
from kvserve.worker.model_runner import ModelRunner


class SyntheticSteps:
    """Builds steps over a fixed set of fake requests whose blocks are handed out once."""

    def __init__(self, runner: ModelRunner, kv_cache: KVCacheManager, max_decodes: int,
                 max_chunk: int, context: int) -> None:
        self.runner, self.context = runner, context
        self.vocab_size = runner.config.model.vocab_size
        per_decode = kv_cache.num_blocks_for(context + 1)
        needed = max_decodes * per_decode + kv_cache.num_blocks_for(context + max_chunk)
        if needed > kv_cache.pool.num_blocks:
            raise ValueError(f"--kv-cache-memory: the largest step needs {needed} KV blocks, "
                             f"the pool has {kv_cache.pool.num_blocks}")
        self.decode_blocks = [list(range(i * per_decode, (i + 1) * per_decode))
                              for i in range(max_decodes)]
        self.chunk_blocks = list(range(max_decodes * per_decode, needed))
        params = SamplingParams(temperature=0.0)
        self.pending = [NewRequestData(f"decode-{i}", [3] * context, params, ())
                        for i in range(max_decodes)]
        self.pending.append(NewRequestData("prefill", [3] * (context + max_chunk), params, ()))

    def run(self, num_decodes: int, chunk: int) -> float:
        """Seconds for one step of `num_decodes` decodes and a `chunk`-token prefill chunk."""
        sched = SchedulerOutput(new_requests=self.pending)
        self.pending = []
        # Varied ids, as a batch's and a prompt's: with one id repeated, every row of a layer
        # is alike, and a mixture-of-experts layer routes them all to the same experts.
        sched.scheduled = [ScheduledRequest(f"decode-{i}", [(i + 5) % self.vocab_size],
                                            self.context, self.decode_blocks[i], sample=True)
                           for i in range(num_decodes)]
        if chunk:  # a middle chunk: it samples nothing
            tokens = [t % self.vocab_size for t in range(chunk)]
            sched.scheduled.append(ScheduledRequest("prefill", tokens, self.context,
                                                    self.chunk_blocks, sample=False))
        start = time.perf_counter()
        self.runner.execute_model(sched)
        synchronize(self.runner.device)
        return time.perf_counter() - start


@contextmanager
def chunks_eager(runner: ModelRunner) -> Iterator[None]:
    """Inside, steps with chunks run eagerly, as under `max_graph_tokens=0`."""
    assert runner.graphs is not None
    mixed = runner.graphs.mixed
    sizes, mixed.sizes = mixed.sizes, []
    try:
        yield
    finally:
        mixed.sizes = sizes


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    if max(args.decodes) + 1 > args.max_num_seqs:
        raise ValueError(f"--max-num-seqs: a step of {max(args.decodes)} decodes and a chunk "
                         f"runs {max(args.decodes) + 1} sequences, more than {args.max_num_seqs}")
    if args.profile_chunk not in (0, *args.chunks):
        raise ValueError(f"--profile-chunk: {args.profile_chunk} is not one of --chunks "
                         f"({', '.join(map(str, args.chunks))}) or 0")
    llm = LLM(**engine_kwargs(args))  # type: ignore[arg-type]
    runner, kv_cache = llm.engine.core.runner, llm.engine.core.kv_cache
    chunks = sorted(set(args.chunks))
    limit = runner.config.scheduler.max_model_len
    if args.context + chunks[-1] > limit:
        raise ValueError(f"--context: {args.context} plus the largest chunk ({chunks[-1]}) "
                         f"exceeds the model's max length ({limit})")
    steps = SyntheticSteps(runner, kv_cache, max(args.decodes), max(chunks), args.context)
    steps.run(max(args.decodes), max(chunks))  # first-use costs (kernel build, allocator)

    def median_ms(num_decodes: int, chunk: int) -> float:
        return statistics.median(steps.run(num_decodes, chunk)
                                 for _ in range(args.repeats)) * 1e3

    alone = {c: median_ms(0, c) for c in chunks}
    graphed = runner.graphs is not None and bool(runner.graphs.mixed.sizes)
    bandwidth = BandwidthSamples(runner.device)
    kv_per_token = runner.config.model.kv_bytes_per_token
    rows: list[dict[str, object]] = []
    streamed: list[tuple[dict[str, object], int, float]] = []  # a decode row, its bytes, its ms
    for num_decodes in args.decodes:
        base = median_ms(num_decodes, 0)
        weights = weight_bytes(runner.model, num_decodes)
        rows.append({"decodes": num_decodes, "chunk": 0, "step ms": round(base, 1),
                     "weights MB": round(weights / 1e6)})
        streamed.append((rows[-1], weights + num_decodes * (args.context + 1) * kv_per_token,
                         base))
        for c in chunks:
            step = median_ms(num_decodes, c)
            rows.append({"decodes": num_decodes, "chunk": c, "step ms": round(step, 1),
                         "chunk adds ms": round(step - base, 1),
                         "riding ms/token": round((step - base) / c, 2),
                         "chunk alone ms": round(alone[c], 1),
                         "ride-along ratio": round((step - base) / alone[c], 2)})
            if graphed:
                with chunks_eager(runner):
                    eager = median_ms(num_decodes, c)
                rows[-1] |= {"eager step ms": round(eager, 1),
                             "graph speed-up": round(eager / step, 2)}
        bandwidth.measure()
        print_table(rows[-len(chunks) - 1:])
    for row, num_bytes, step_ms in streamed:
        floor = num_bytes / bandwidth.copy * 1e3
        row |= {"roofline ms": round(floor, 2), "step / roofline": round(step_ms / floor, 2)}
    print_table(rows, title=(
        f"step cost, {args.model}, {runner.config.model.dtype}, {runner.device}, context "
        f"{args.context}, medians of {args.repeats}; ride-along ratio = what a chunk adds to "
        f"a decode step / the same chunk in a step of its own; a {chunks[-1]}-token chunk "
        f"alone costs {alone[chunks[-1]] / chunks[-1]:.2f} ms/token; roofline = the weights "
        f"the decodes stream (of a mixture-of-experts layer, the experts as many rows routed "
        f"uniformly at random pick) + their KV at the copy bandwidth, {bandwidth.describe()}"))
    prefill = prefill_against_gemm_peak(runner, kv_cache, args)
    if args.profile:
        print_profile(steps, min(args.decodes), args.profile_chunk, args.profile,
                      next(r["step ms"] for r in rows if r["decodes"] == min(args.decodes)
                           and r["chunk"] == args.profile_chunk))
    save_json(args.json, {"benchmark": "step", "model": args.model, "device": runner.device,
                          "context": args.context, "copy_bandwidth": bandwidth.copy,
                          "bandwidth_samples": bandwidth.samples,
                          "rows": rows, "prefill": prefill})


def print_profile(steps: SyntheticSteps, num_decodes: int, chunk: int, num_steps: int,
                  step_ms: float) -> None:
    """The ops (on CUDA, the kernels, graph-replayed ones included) that take the most device
    time over `num_steps` steps of `num_decodes` decodes and a `chunk`-token chunk: where a
    step's time goes beyond its roofline. On CUDA, also the ops that take the most host time
    (an eager step's launches) and the share of the (unprofiled) step time the kernels fill:
    the rest is the device waiting on the host and on launches."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.device(steps.runner.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            steps.run(num_decodes, chunk)
    what = f"{num_steps} steps of {num_decodes} decodes" + (
        f" and a chunk of {chunk} tokens" if chunk else "")
    print(f"\n{what} under torch.profiler, by device time:")
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total" if on_cuda else "self_cpu_time_total",
                       row_limit=25))
    if on_cuda:
        print(f"\n{what}, by host time:")
        print(events.table(sort_by="cpu_time_total", row_limit=15))
        busy_ms = sum(e.self_device_time_total for e in events) / 1e3 / num_steps
        print(f"kernels: {busy_ms:.2f} ms per step, in a {step_ms:.2f} ms step "
              f"({busy_ms / step_ms:.0%} busy)")


def prefill_against_gemm_peak(runner: ModelRunner, kv_cache: KVCacheManager,
                              args: argparse.Namespace) -> dict[str, float]:
    sched = runner.config.scheduler
    tokens = min(args.prefill_tokens, sched.max_num_batched_tokens, sched.max_model_len)
    steps = SyntheticSteps(runner, kv_cache, 0, tokens, 0)
    steps.run(0, tokens)
    seconds = statistics.median(steps.run(0, tokens) for _ in range(args.repeats))
    weights = matmul_params(runner.model.layers)
    matmul, attention = 2 * weights * tokens, causal_attention_flops(runner.config.model, tokens)
    flops = matmul / seconds
    with_attention = flops + attention / seconds
    peak = gemm_peak(runner.device, runner.config.model.dtype)
    row = {"prefill tokens": tokens, "step ms": round(seconds * 1e3, 1),
           "tok/s": round(tokens / seconds, 1), "matmul GFLOP/s": round(flops / 1e9, 1),
           "GEMM peak GFLOP/s": round(peak / 1e9, 1), "% of peak": percent(flops / peak),
           "+ attention GFLOP/s": round(with_attention / 1e9, 1),
           "attention % of FLOPs": round(100 * attention / (matmul + attention), 1),
           "% of peak with attention": percent(with_attention / peak)}
    print_table([row], title=(
        f"prefill from an empty cache, {runner.config.model.dtype}: its matmul FLOPs (2 x "
        f"{weights / 1e6:.0f} M weights per token; then with attention's two products) "
        f"against a {gemm_size(runner.device)}^3 GEMM through the engine's linear layer"))
    return row


def percent(share: float) -> float:
    """`share` in percent, to 0.1 or to two significant digits where that is finer: a test
    model's prefill reaches well under 0.1 % of a CPU's GEMM peak, and a step slowed by a
    busy machine should not show it as none."""
    value = 100 * share
    return round(value, max(1, 1 - math.floor(math.log10(value)))) if value > 0 else value


def causal_attention_flops(cfg: ModelConfig, tokens: int) -> float:
    """Q.K^T and P.V of a causal prefill from an empty cache: 4 x head_dim FLOPs per query
    head and visible key, each query seeing the keys up to its own (within the window)."""
    visible = sum(min(i + 1, cfg.sliding_window or tokens) for i in range(tokens))
    return 4.0 * cfg.head_dim * cfg.num_heads * cfg.num_layers * visible


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("step", help="what a prefill chunk adds to a decode step, against "
                                    "the chunk in a step of its own")
    add_engine_args(p)
    p.add_argument("--decodes", type=positive_int, nargs="+", default=[1, 8, 32],
                   help="decode batch sizes to time")
    p.add_argument("--chunks", type=positive_int, nargs="+", default=[16, 64, 256],
                   help="prefill chunk sizes (tokens) to add to each decode batch")
    p.add_argument("--context", type=positive_int, default=256,
                   help="tokens already in the KV cache of every decode and of the chunk")
    p.add_argument("--prefill-tokens", type=positive_int, default=2048,
                   help="the prefill set against the GEMM peak (at most the step budget "
                        "and the model's length)")
    p.add_argument("--repeats", type=positive_int, default=7,
                   help="timed steps per cell; the median is reported")
    p.add_argument("--profile", type=non_negative_int, default=0, metavar="STEPS",
                   help="also profile this many decode-only steps of the smallest --decodes "
                        "batch and print the ops that take the most device time")
    p.add_argument("--profile-chunk", type=non_negative_int, default=0, metavar="TOKENS",
                   help="with --profile: the profiled steps carry a chunk of this many tokens, "
                        "one of --chunks (default 0: decode-only steps)")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)
