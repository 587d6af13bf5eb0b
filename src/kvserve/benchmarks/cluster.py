"""`kvserve bench cluster`: routing among engine replicas on a shared-prefix workload.

Groups of requests share a long head and interleave in arrival order. Closed-loop clients
(`--concurrency`, each sending its next request when the last one ends) drive, in turn, one
engine with all the KV memory and CPU threads of the cluster, and the cluster under each
router. Each replica's KV pool holds the heads of `--pool-groups` groups, fewer than all of
them: a router that spreads a group over every replica makes each recompute its head, while
the prefix-aware router keeps a group where its head is cached. Reported: throughput, mean
TTFT and the prefix-cache hit rate (over all replicas), medians of `--runs`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvserve.arg_types import non_negative_int, positive_int
from kvserve.benchmarks.prefix import medians, table_row
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.serve import RequestResult, percentile, send_all
from kvserve.benchmarks.workloads import Workload, shared_prefix
from kvserve.cluster.router import ROUTERS
from kvserve.config import ModelConfig
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.outputs import EngineStats
from kvserve.sampling_params import SamplingParams


async def one_request(llm: Any, prompt: list[int], output_len: int) -> RequestResult:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    result = RequestResult(ok=True)
    async for out in llm.generate({"prompt_token_ids": prompt}, params):
        if not result.ttft and out.outputs[0].token_ids:
            result.ttft = time.perf_counter() - start
    result.e2e = time.perf_counter() - start
    result.output_tokens = len(out.outputs[0].token_ids)
    return result


async def drive(llm: Any, work: Workload, concurrency: int | None = None,
                rate: float | None = None, seed: int = 0) -> tuple[list[RequestResult], float]:
    """Runs the workload through `llm` (an `AsyncLLM` or a `ClusterLLM`) with `concurrency`
    closed-loop clients, or arriving as a Poisson process at `rate` per second; returns each
    request's timings and the wall time."""
    return await send_all(work, lambda prompt, n: one_request(llm, prompt, n), rate,
                          concurrency, seed)


def alternate_runs(configs: dict[str, Callable[[], dict[str, float]]], num_runs: int,
                   show: Callable[[dict[str, float]], str]) -> dict[str, dict[str, float]]:
    """Measures every configuration `num_runs` times, alternating them so that drift hits
    them alike, printing `show(result)` after each; returns each one's medians."""
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in configs}
    for i in range(num_runs):
        for label, measure in configs.items():
            runs[label].append(measure())
            print(f"  run {i + 1}, {label}: {show(runs[label][-1])}", flush=True)
    return {label: medians(r) for label, r in runs.items()}


def measure_serving(args: argparse.Namespace, work: Workload, cluster: dict[str, Any],
                    rate: float) -> dict[str, float]:
    """Poisson arrivals at `rate` through a `ClusterLLM` with the engine flags and these
    cluster options: latency percentiles, goodput (requests within `args.slo_ttft` and
    `args.slo_tpot` per second) and migrations with their downtime."""
    from kvserve.cluster.cluster_llm import ClusterLLM

    llm = ClusterLLM(**engine_kwargs(args), **cluster)

    async def run() -> dict[str, float]:
        results, wall = await drive(llm, work, rate=rate, seed=args.workload_seed)
        ttft = [r.ttft for r in results]
        tpot = [r.tpot for r in results]
        good = sum(r.ttft <= args.slo_ttft and r.tpot <= args.slo_tpot for r in results)
        downtimes = list(llm.metrics.downtimes)
        ms = 1e3
        return {"wall s": wall, "TTFT p50 ms": percentile(ttft, 50) * ms,
                "TTFT p99 ms": percentile(ttft, 99) * ms,
                "TPOT p50 ms": percentile(tpot, 50) * ms,
                "TPOT p99 ms": percentile(tpot, 99) * ms,
                "SLO met %": 100 * good / len(results), "goodput req/s": good / wall,
                "migrations": len(downtimes),
                "downtime p50 ms": percentile(downtimes, 50) * ms if downtimes else 0.0,
                "downtime p99 ms": percentile(downtimes, 99) * ms if downtimes else 0.0}

    try:
        return asyncio.run(run())
    finally:
        llm.shutdown()


def summarize(work: Workload, results: list[RequestResult], wall: float,
              stats: list[EngineStats]) -> dict[str, float]:
    queries = sum(s.prefix_cache_queries for s in stats)
    hits = sum(s.prefix_cache_hits for s in stats)
    return {"wall s": wall, "req/s": len(work.prompts) / wall,
            "out tok/s": work.num_output_tokens / wall,
            "mean TTFT s": statistics.fmean(r.ttft for r in results),
            "hit rate %": 100 * hits / queries if queries else 0.0}


def single_run(args: argparse.Namespace, work: Workload, kv_bytes: int) -> dict[str, float]:
    from kvserve.entrypoints.async_llm import AsyncLLM

    llm = AsyncLLM(**{**engine_kwargs(args), "kv_cache_memory": kv_bytes})
    try:
        results, wall = asyncio.run(drive(llm, work, args.concurrency))
        return summarize(work, results, wall, [llm.engine.stats()])
    finally:
        llm.shutdown()


def cluster_run(args: argparse.Namespace, router: str, work: Workload, kv_bytes: int
                ) -> dict[str, float]:
    from kvserve.cluster.cluster_llm import ClusterLLM

    llm = ClusterLLM(**{**engine_kwargs(args), "kv_cache_memory": kv_bytes},
                     data_parallel_size=args.data_parallel_size, router=router)

    async def measure() -> dict[str, float]:
        results, wall = await drive(llm, work, args.concurrency)
        return summarize(work, results, wall, await llm.replica_stats())

    try:
        return asyncio.run(measure())
    finally:
        llm.shutdown()


def run(args: argparse.Namespace) -> None:
    import ray

    model = ModelConfig.from_pretrained(args.model, args.dtype, args.device)
    replicas = args.data_parallel_size
    prefix_blocks = args.prefix_len // args.block_size
    own_blocks = -(-(args.prefix_len + args.suffix_len + args.output_len)
                   // args.block_size) - prefix_blocks + 1
    pool_blocks = args.pool_groups * prefix_blocks + args.concurrency * own_blocks
    kv_bytes = pool_blocks * args.block_size * model.kv_bytes_per_token
    work = shared_prefix(args.groups, args.group_size, args.prefix_len, args.suffix_len,
                         args.output_len, model.vocab_size, args.workload_seed)
    print(f"{work.name}; {args.concurrency} clients; {replicas} replicas, each with a KV pool "
          f"of {pool_blocks} blocks ({kv_bytes / 2**20:.0f} MiB: the heads of "
          f"{args.pool_groups} groups); one engine with {replicas}x that as the baseline",
          flush=True)
    # One Ray session for every cluster run: each would otherwise start and stop its own.
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    configs: dict[str, Any] = {"one engine": lambda: single_run(args, work, replicas * kv_bytes)}
    for router in args.routers.split(","):
        if router not in ROUTERS:
            raise ValueError(f"--routers: {router!r} is not one of {', '.join(ROUTERS)}")
        configs[f"{replicas} replicas, {router}"] = (
            lambda router=router: cluster_run(args, router, work, kv_bytes))
    results = alternate_runs(configs, args.runs, lambda r: f"{r['wall s']:.1f} s, hit rate "
                                                           f"{r['hit rate %']:.1f} %")
    ray.shutdown()
    rows = [table_row(label, median) for label, median in results.items()]
    print_table(rows, title=f"{work.name}, {args.model} (median of {args.runs})")
    ratios = {}
    baseline = results.get(f"{replicas} replicas, round-robin")
    prefix_aware = results.get(f"{replicas} replicas, prefix-aware")
    if baseline is not None and prefix_aware is not None:
        ratios["throughput, prefix-aware / round-robin"] = round(
            prefix_aware["req/s"] / baseline["req/s"], 2)
    one = results.pop("one engine")
    for label, median in results.items():
        ratios[f"hit rate, {label.split(', ')[1]} / one engine"] = round(
            median["hit rate %"] / one["hit rate %"], 3)
    print_table([ratios], title="ratios")
    save_json(args.json, {"benchmark": "cluster", "model": args.model,
                          "pool_blocks": pool_blocks, "rows": rows, "ratios": ratios})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="routers among engine replicas (Ray) on a "
                                       "shared-prefix workload, against one engine")
    add_engine_args(p)
    p.add_argument("--data-parallel-size", type=positive_int, default=2)
    p.add_argument("--routers", default="round-robin,least-loaded,prefix-aware",
                   help="comma-separated routers to compare")
    p.add_argument("--groups", type=positive_int, default=12)
    p.add_argument("--group-size", type=positive_int, default=6)
    p.add_argument("--prefix-len", type=non_negative_int, default=256,
                   help="tokens shared by a group")
    p.add_argument("--suffix-len", type=non_negative_int, default=16,
                   help="tokens of each request's own")
    p.add_argument("--output-len", type=positive_int, default=8)
    p.add_argument("--pool-groups", type=positive_int, default=7,
                   help="size each replica's KV pool to hold this many groups' heads")
    p.add_argument("--concurrency", type=positive_int, default=8, help="closed-loop clients")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--runs", type=positive_int, default=3,
                   help="runs per configuration; the median is reported")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=run)
