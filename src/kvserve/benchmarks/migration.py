"""`kvserve bench migration`: live migration (Llumnix) on an imbalanced load.

Two replicas behind a round-robin router get long and short generations in turn, so every
long one lands on the first replica: it fills its `--max-num-seqs` slots and queues what
follows, while the second idles between short requests. The same Poisson arrivals run with
migration off and on (`--migration-threshold`): on, running requests move from the busier
replica to the idler one as they decode. Reported: TTFT and TPOT percentiles, migrations and
their downtime (the stall a moved request's client sees), medians of `--runs`.
"""

from __future__ import annotations

import argparse

from kvserve.arg_types import positive_float, positive_int
from kvserve.benchmarks.cluster import alternate_runs, measure_serving
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.workloads import alternating
from kvserve.config import ModelConfig
from kvserve.engine_args import add_engine_args


def run(args: argparse.Namespace) -> None:
    import ray

    model = ModelConfig.from_pretrained(args.model, args.dtype, args.device)
    work = alternating(args.num_prompts, args.prompt_len, args.long_output,
                       args.short_output, model.vocab_size, args.workload_seed)
    print(f"{work.name}, Poisson at {args.rate} req/s; 2 replicas, round-robin, "
          f"max_num_seqs {args.max_num_seqs}", flush=True)
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    configs = {label: lambda threshold=threshold: measure_serving(
        args, work, dict(data_parallel_size=2, router="round-robin",
                         migration_threshold=threshold), args.rate)
               for label, threshold in (("no migration", 0), (
                   f"migration (threshold {args.migration_threshold})",
                   args.migration_threshold))}
    results = alternate_runs(configs, args.runs, lambda r: f"TTFT p99 {r['TTFT p99 ms']:.0f} "
                                                           f"ms, {r['migrations']} migrations")
    ray.shutdown()
    rows = [{"config": label, **{k: round(v, 1) for k, v in median.items()}}
            for label, median in results.items()]
    print_table(rows, title=f"{work.name}, {args.model} (median of {args.runs})")
    off, on = results.values()
    ratios = {"TTFT p99, no migration / migration": round(
        off["TTFT p99 ms"] / on["TTFT p99 ms"], 2),
              "TTFT p50, no migration / migration": round(
        off["TTFT p50 ms"] / on["TTFT p50 ms"], 2),
              "downtime p50 / TPOT p50": round(on["downtime p50 ms"] / on["TPOT p50 ms"], 2)}
    print_table([ratios], title="ratios")
    save_json(args.json, {"benchmark": "migration", "model": args.model, "rows": rows,
                          "ratios": ratios})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("migration", help="live migration between two replicas (Ray) on an "
                                         "imbalanced load, against no migration")
    add_engine_args(p)
    p.set_defaults(max_num_seqs=4)
    p.add_argument("--num-prompts", type=positive_int, default=60)
    p.add_argument("--prompt-len", type=positive_int, default=64)
    p.add_argument("--long-output", type=positive_int, default=128)
    p.add_argument("--short-output", type=positive_int, default=16)
    p.add_argument("--rate", type=positive_float, default=2.0, help="arrivals per second (Poisson)")
    p.add_argument("--migration-threshold", type=positive_int, default=2)
    p.add_argument("--slo-ttft", type=positive_float, default=1.0, help="seconds, for goodput")
    p.add_argument("--slo-tpot", type=positive_float, default=0.1, help="seconds, for goodput")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--runs", type=positive_int, default=3,
                   help="runs per configuration; the median is reported")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=run)
