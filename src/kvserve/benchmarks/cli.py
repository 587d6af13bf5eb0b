"""`kvserve bench ...`: every benchmark prints a same-run baseline beside its numbers."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from kvserve.benchmarks import (
        blend,
        cluster,
        disagg,
        kernels,
        latency,
        lora,
        migration,
        offload,
        preemption,
        prefix,
        priority,
        quantized,
        serve,
        simulate,
        speculative,
        step,
        streaming,
        structured,
        throughput,
    )

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    throughput.add_parser(bench_sub)
    latency.add_parser(bench_sub)
    serve.add_parser(bench_sub)
    prefix.add_parser(bench_sub)
    step.add_parser(bench_sub)
    kernels.add_parser(bench_sub)
    quantized.add_parser(bench_sub)
    preemption.add_parser(bench_sub)
    priority.add_parser(bench_sub)
    offload.add_parser(bench_sub)
    streaming.add_parser(bench_sub)
    cluster.add_parser(bench_sub)
    migration.add_parser(bench_sub)
    disagg.add_parser(bench_sub)
    structured.add_parser(bench_sub)
    speculative.add_parser(bench_sub)
    lora.add_parser(bench_sub)
    blend.add_parser(bench_sub)
    simulate.add_validation_parser(bench_sub)
