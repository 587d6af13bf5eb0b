"""`kvserve simulate`: routing, migration and disaggregation at fleet scale in simulated time,
and `kvserve bench simulator`: the simulator checked against a real run on this machine.

The step cost comes from `kvserve bench step --json` files (any device's), or, for a device
at hand in no file, from a roofline of its memory bandwidth and matmul rate
(`--device-spec`). `--model` is a checkpoint folder or a `make-model` preset name: only its
shapes are read.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvserve.arg_types import non_negative_int, positive_float, positive_int
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.serve import percentile
from kvserve.benchmarks.workloads import Workload, fixed, shared_prefix, variable
from kvserve.cluster.router import ROUTERS
from kvserve.cluster.simulator import (
    ClusterSpec,
    SimRequest,
    Simulation,
    StepCostModel,
    Timing,
    poisson_arrivals,
)
from kvserve.config import EngineConfig
from kvserve.engine_args import add_engine_args, engine_kwargs

# Roofline devices: memory bandwidth (bytes/s) and a dense bf16 matmul rate (FLOP/s) at 60 %
# of the datasheet's. The H100's bandwidth is the 2,960 GB/s copy rate measured on one.
DEVICE_SPECS = {"h100": (2.96e12, 0.6 * 989e12), "h200": (4.0e12, 0.6 * 989e12)}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config for `--model`, a folder or a preset (whose config.json is written to
    a temporary folder: the simulator needs shapes, not weights)."""
    from kvserve.tools.make_model import PRESETS, hf_config, write_json

    options = engine_kwargs(args)
    model = options.pop("model")
    if not Path(model).is_dir() and model in PRESETS:
        folder = Path(tempfile.mkdtemp(prefix=f"kvserve-{model}-"))
        write_json(folder / "config.json", hf_config(PRESETS[model]))
        model = str(folder)
    return EngineConfig.create(model, **options)


def roofline(config: EngineConfig, device: str) -> StepCostModel:
    """A step reads the weights once (of a mixture of experts, those one token uses), and
    each decode its context's KV, at the memory bandwidth; every token costs 2 x params
    FLOPs at the matmul rate."""
    bandwidth, flops = DEVICE_SPECS[device]
    mc = config.model
    attention = (mc.hidden_size * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
                 + mc.num_heads * mc.head_dim * mc.hidden_size)
    params = (mc.num_layers * attention + 3 * mc.hidden_size * mc.mlp_columns_per_token
              + 2 * mc.vocab_size * mc.hidden_size)
    element = mc.kv_bytes_per_token // (2 * mc.num_layers * mc.num_kv_heads * mc.head_dim)
    token = 2 * params / flops
    return StepCostModel(params * element / bandwidth, token, token,
                         mc.kv_bytes_per_token / bandwidth, source=f"{device} roofline")


def sim_requests(work: Workload, rate: float, seed: int) -> list[SimRequest]:
    arrivals = poisson_arrivals(len(work.prompts), rate, seed)
    return [SimRequest(t, p, n) for t, p, n in zip(arrivals, work.prompts, work.output_lens,
                                                   strict=True)]


def summarize(timings: list[Timing], slo_ttft: float, slo_tpot: float) -> dict[str, float]:
    ttft = [t.ttft for t in timings]
    tpot = [t.tpot for t in timings]
    end = max(t.finished or 0.0 for t in timings)
    good = sum(t.ttft <= slo_ttft and t.tpot <= slo_tpot for t in timings)
    return {"req/s": len(timings) / end, **latency_percentiles(ttft, tpot),
            "SLO met %": 100 * good / len(timings), "goodput req/s": good / end}


def latency_percentiles(ttft: list[float], tpot: list[float]) -> dict[str, float]:
    """p50 and p99 of TTFT and TPOT (seconds), in ms."""
    return {f"{name} p{q} ms": percentile(values, q) * 1e3
            for name, values in (("TTFT", ttft), ("TPOT", tpot)) for q in (50, 99)}


def simulate_one(spec: ClusterSpec, requests: list[SimRequest], args: argparse.Namespace
                 ) -> dict[str, Any]:
    start = time.perf_counter()
    sim = Simulation(spec)
    timings = list(sim.run(requests).values())
    stats = [r.scheduler.kv_cache for r in sim.replicas]
    queries = sum(kv.prefix_cache_queries for kv in stats)
    hits = sum(kv.prefix_cache_hits for kv in stats)
    row = summarize(timings, args.slo_ttft, args.slo_tpot)
    row["hit rate %"] = 100 * hits / queries if queries else 0.0
    row["migrations"] = sim.num_migrations
    row["downtime p50 ms"] = percentile(sim.downtimes, 50) * 1e3 if sim.downtimes else 0.0
    row["sim wall s"] = time.perf_counter() - start
    return {k: round(v, 3 if "req/s" in k else 1) for k, v in row.items()}


def layouts(value: str, replicas: int) -> list[int]:
    """Prefill replicas of each layout to try: 0 is co-located; `auto` tries co-located
    and up to six prefill:decode splits (DistServe's placement search, by simulation)."""
    if value != "auto":
        return [int(v) for v in value.split(",")]
    splits = sorted({max(1, min(replicas - 1, round(replicas * f / 8))) for f in range(1, 7)})
    return [0, *splits] if replicas > 1 else [0]


def workload(args: argparse.Namespace, vocab: int) -> Workload:
    if args.workload == "shared-prefix":
        if args.prefix_len >= args.prompt_len:
            raise ValueError(f"--prefix-len ({args.prefix_len}) must be below --prompt-len "
                             f"({args.prompt_len}): each prompt ends in a tail of its own")
        if args.groups > args.num_requests:
            raise ValueError(f"--groups ({args.groups}) must be <= --num-requests "
                             f"({args.num_requests})")
        return shared_prefix(args.groups, args.num_requests // args.groups, args.prefix_len,
                             args.prompt_len - args.prefix_len, args.output_len, vocab,
                             args.workload_seed)
    if args.workload == "variable":
        return variable(args.num_requests, (args.prompt_len // 4, args.prompt_len),
                        (args.output_len // 4, args.output_len), vocab, args.workload_seed)
    return fixed(args.num_requests, args.prompt_len, args.output_len, vocab, args.workload_seed)


def cost_model(args: argparse.Namespace, config: EngineConfig) -> StepCostModel:
    if args.cost_model:
        return StepCostModel.load(args.cost_model)
    if args.device_spec:
        return roofline(config, args.device_spec)
    raise ValueError("--cost-model FILE (from kvserve bench step --json) or --device-spec "
                     f"({', '.join(DEVICE_SPECS)}) is needed")


def run(args: argparse.Namespace) -> None:
    config = engine_config(args)
    cost = cost_model(args, config)
    work = workload(args, config.model.vocab_size)
    requests = sim_requests(work, args.rate, args.workload_seed)
    print(f"{work.name}, Poisson at {args.rate} req/s; step cost {cost}; SLOs TTFT <= "
          f"{args.slo_ttft} s, TPOT <= {args.slo_tpot * 1e3:.0f} ms", flush=True)
    rows = []
    for replicas in args.replicas:
        for num_prefill in layouts(args.layouts, replicas):
            for router in args.routers.split(","):
                for threshold in args.migration_thresholds:
                    spec = ClusterSpec(config, cost, replicas, num_prefill, router, threshold,
                                       args.link_gbps * 1e9 / 8)
                    layout = (f"{num_prefill}P+{replicas - num_prefill}D" if num_prefill
                              else "co-located")
                    row = {"replicas": replicas, "layout": layout, "router": router,
                           "migration": threshold or "off",
                           **simulate_one(spec, requests, args)}
                    rows.append(row)
                    print_table([row])
    print_table(rows, title=f"simulated: {work.name}, {Path(config.model.path).name}")
    for replicas in args.replicas:
        mine = [r for r in rows if r["replicas"] == replicas]
        best = max(mine, key=lambda r: r["goodput req/s"])
        co = max((r for r in mine if r["layout"] == "co-located"),
                 key=lambda r: r["goodput req/s"], default=None)
        if co is not None and best is not co and co["goodput req/s"]:
            print(f"{replicas} replicas: {best['layout']} has the best goodput, "
                  f"{best['goodput req/s'] / co['goodput req/s']:.2f}x co-located's")
    save_json(args.json, {"benchmark": "simulate", "cost": cost.__dict__, "rows": rows})


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=["fixed", "variable", "shared-prefix"],
                   default="fixed")
    p.add_argument("--num-requests", type=positive_int, default=2000)
    p.add_argument("--rate", type=positive_float, default=50.0,
                   help="arrivals per second (Poisson)")
    p.add_argument("--prompt-len", type=positive_int, default=512,
                   help="tokens (the most, for variable)")
    p.add_argument("--output-len", type=positive_int, default=64)
    p.add_argument("--groups", type=positive_int, default=64, help="shared-prefix: groups")
    p.add_argument("--prefix-len", type=non_negative_int, default=384,
                   help="shared-prefix: shared tokens")
    p.add_argument("--slo-ttft", type=positive_float, default=2.0, help="seconds, for goodput")
    p.add_argument("--slo-tpot", type=positive_float, default=0.1, help="seconds, for goodput")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this file")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="routing, migration and prefill/decode layouts over "
                                        "many replicas in simulated time (Vidur-style)")
    add_engine_args(p)
    add_workload_args(p)
    p.add_argument("--cost-model", nargs="+", default=None,
                   help="kvserve bench step --json files to fit the step cost to")
    p.add_argument("--device-spec", choices=sorted(DEVICE_SPECS), default=None,
                   help="a roofline step cost instead")
    p.add_argument("--replicas", type=positive_int, nargs="+", default=[16])
    p.add_argument("--layouts", default="0",
                   help="prefill replicas per layout, comma-separated (0: co-located); auto: "
                        "co-located and a search over prefill:decode splits")
    p.add_argument("--routers", default="least-loaded",
                   help=f"comma-separated, of {', '.join(ROUTERS)}")
    p.add_argument("--migration-thresholds", type=non_negative_int, nargs="+", default=[0],
                   help="0: no migration")
    p.add_argument("--link-gbps", type=positive_float, default=100.0,
                   help="the link KV moves over between replicas, in Gbit/s")
    p.set_defaults(func=run)


def measured_costs(args: argparse.Namespace, threads: int) -> StepCostModel:
    """Fits a step cost to steps timed on this machine with `threads` threads, as each
    replica of the real run has them."""
    import torch

    from kvserve import LLM
    from kvserve.benchmarks.step import SyntheticSteps

    torch.set_num_threads(threads)
    runs = []
    for context in (64, 512):
        core = LLM(**engine_kwargs(args)).engine.core
        steps = SyntheticSteps(core.runner, core.kv_cache, 16, 256, context)
        steps.run(16, 256)  # first-use costs
        rows = [{"decodes": d, "chunk": c,
                 "step ms": statistics.median(steps.run(d, c) for _ in range(5)) * 1e3}
                for d in (1, 4, 8, 16) for c in (0, 64, 256)]
        runs.append({"context": context, "device": f"cpu x{threads}", "rows": rows})
    overhead = engine_overhead(args)
    torch.set_num_threads(args.cpus)
    fitted = StepCostModel.fit(runs)
    return replace(fitted, fixed=fitted.fixed + overhead)


def engine_overhead(args: argparse.Namespace) -> float:
    """Seconds per step the engine spends outside the model runner (scheduling, output
    processing, detokenization), from a short real run."""
    from kvserve import LLM
    from kvserve.sampling_params import SamplingParams

    engine = LLM(**engine_kwargs(args)).engine
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i in range(8):
        engine.add_request({"prompt_token_ids": [3 + i] * 64}, params)
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    return (engine.step_seconds - engine.core.execute_seconds) / num_steps


def validate(args: argparse.Namespace) -> None:
    """Per replica count: a real run of the workload, beside simulations of it with the step
    cost fitted two ways: to steps timed alone (`kvserve bench step`'s way) and to the steps
    the replicas traced while serving a calibration run (another seed of the workload)."""
    import ray

    config = engine_config(args)
    work = workload(args, config.model.vocab_size)
    calibration = workload(replace_seed(args, args.workload_seed + 1), config.model.vocab_size)
    requests = sim_requests(work, args.rate, args.workload_seed)
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    rows, ratios = [], {}
    for replicas in args.replicas:
        isolated = measured_costs(args, max(1, args.cpus // replicas))
        traced, measured = measure_real(args, work, calibration, replicas)
        runs = {"measured": measured}
        for label, cost in (("simulated, steps alone", isolated),
                            ("simulated, traced steps", traced)):
            print(f"{replicas} replica(s), {label}: step cost {cost}", flush=True)
            spec = ClusterSpec(config, cost, replicas, router="least-loaded")
            runs[label] = summarize(list(Simulation(spec).run(requests).values()),
                                    args.slo_ttft, args.slo_tpot)
            for key in PERCENTILES:
                ratios.setdefault(key, {})[f"{replicas} replica(s), {label}"] = round(
                    runs[label][key] / measured[key], 2)
        rows += [{"replicas": replicas, "run": label, **{k: round(v[k], 1) for k in PERCENTILES}}
                 for label, v in runs.items()]
    ray.shutdown()
    print_table(rows, title=f"{work.name} at {args.rate} req/s, {args.model}")
    table = [{"simulation": name, **{k: ratios[k][name] for k in PERCENTILES}}
             for name in ratios[PERCENTILES[0]]]
    print_table(table, title="simulated / measured")
    save_json(args.json, {"benchmark": "simulator", "rows": rows, "ratios": table})


def replace_seed(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "workload_seed": seed})


PERCENTILES = ("TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms")


def measure_real(args: argparse.Namespace, work: Workload, calibration: Workload,
                 replicas: int) -> tuple[StepCostModel, dict[str, float]]:
    """Serves `calibration` on `replicas` replicas while they trace their steps, then `work`;
    returns the step cost fitted to the trace and `work`'s latency percentiles."""
    import asyncio

    from kvserve.benchmarks.cluster import drive
    from kvserve.cluster.cluster_llm import ClusterLLM

    llm = ClusterLLM(**engine_kwargs(args), data_parallel_size=replicas,
                     router="least-loaded")

    async def run_it() -> tuple[StepCostModel, dict[str, float]]:
        await llm.trace_steps(on=True)
        await drive(llm, calibration, rate=args.rate, seed=args.workload_seed + 1)
        trace = await llm.trace_steps(on=False)
        cost = StepCostModel.fit_trace(trace, f"{len(trace)} steps traced on {replicas} "
                                              "replica(s)")
        results, _ = await drive(llm, work, rate=args.rate, seed=args.workload_seed)
        return cost, latency_percentiles([r.ttft for r in results], [r.tpot for r in results])

    try:
        return asyncio.run(run_it())
    finally:
        llm.shutdown()


def add_validation_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulator", help="the simulator against a real run of 1 and 2 "
                                         "replicas on this machine")
    add_engine_args(p)
    add_workload_args(p)
    # The shared-prefix shape of `simulate` (3/4 of each prompt shared) at this scale.
    p.set_defaults(num_requests=100, rate=2.0, prompt_len=256, output_len=32, prefix_len=192,
                   groups=10)
    p.add_argument("--replicas", type=positive_int, nargs="+", default=[1, 2])
    p.add_argument("--cpus", type=positive_int, default=2, help="cores the replicas share")
    p.set_defaults(func=validate)
