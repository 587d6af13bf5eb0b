"""`kvserve bench disagg`: prefill and decode on separate replicas (DistServe) against the
same number of replicas doing both.

The same Poisson arrivals of fixed-length requests run, at each of `--rates`, through N
co-located replicas (least-loaded routing, chunked prefill beside decodes) and through P
prefill plus N - P decode replicas. Goodput counts the requests that meet both the TTFT and
the TPOT objective, per second: co-located replicas start prompts sooner, while decode
replicas that never run a prompt keep every step short. Medians of `--runs`.
"""

from __future__ import annotations

import argparse

from kvserve.arg_types import positive_float, positive_int
from kvserve.benchmarks.cluster import alternate_runs, measure_serving
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.workloads import fixed
from kvserve.config import ModelConfig
from kvserve.engine_args import add_engine_args


def run(args: argparse.Namespace) -> None:
    import ray

    total, prefill = args.replicas, args.prefill_replicas
    if not 1 <= prefill < total:
        raise ValueError(f"--prefill-replicas must be in [1, {total - 1}] for --replicas "
                         f"{total}, got {prefill}")
    model = ModelConfig.from_pretrained(args.model, args.dtype, args.device)
    work = fixed(args.num_prompts, args.prompt_len, args.output_len, model.vocab_size,
                 args.workload_seed)
    print(f"{work.name}; SLOs: TTFT <= {args.slo_ttft} s, TPOT <= {args.slo_tpot * 1e3:.0f} "
          "ms", flush=True)
    configs = {f"co-located, {total} replicas": dict(data_parallel_size=total,
                                                     router="least-loaded"),
               f"disaggregated, {prefill} prefill + {total - prefill} decode": dict(
                   prefill_replicas=prefill, decode_replicas=total - prefill)}
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    rows, ratios = [], {}
    for rate in args.rates:
        results = alternate_runs(
            {label: lambda cluster=cluster, rate=rate: measure_serving(args, work, cluster, rate)
             for label, cluster in configs.items()}, args.runs,
            lambda r, rate=rate: f"at {rate} req/s, goodput {r['goodput req/s']:.2f} req/s, "
                                 f"SLO met {r['SLO met %']:.0f} %")
        for label, median in results.items():
            rows.append({"rate": rate, "config": label,
                         **{k: round(v, 2 if "req/s" in k else 1) for k, v in median.items()
                            if k not in ("migrations", "downtime p99 ms")}})
        co, disagg = results.values()
        ratios[f"goodput at {rate} req/s, disaggregated / co-located"] = (
            round(disagg["goodput req/s"] / co["goodput req/s"], 2)
            if co["goodput req/s"] else "co-located met none")
    ray.shutdown()
    print_table(rows, title=f"{work.name}, {args.model} (median of {args.runs})")
    print_table([ratios], title="ratios")
    save_json(args.json, {"benchmark": "disagg", "model": args.model, "rows": rows,
                          "ratios": ratios})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("disagg", help="disaggregated prefill and decode replicas (Ray) "
                                      "against co-located ones: goodput under SLOs")
    add_engine_args(p)
    p.add_argument("--replicas", type=positive_int, default=2, help="replicas in both layouts")
    p.add_argument("--prefill-replicas", type=positive_int, default=1)
    p.add_argument("--num-prompts", type=positive_int, default=40)
    p.add_argument("--prompt-len", type=positive_int, default=512)
    p.add_argument("--output-len", type=positive_int, default=64)
    p.add_argument("--rates", type=positive_float, nargs="+", default=[0.5, 1.0, 1.5],
                   help="arrivals per second (Poisson)")
    p.add_argument("--slo-ttft", type=positive_float, default=2.0, help="seconds")
    p.add_argument("--slo-tpot", type=positive_float, default=0.06, help="seconds")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--runs", type=positive_int, default=1, help="runs per configuration and rate; "
                                                       "the median is reported")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=run)
