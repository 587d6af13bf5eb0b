"""`kvserve bench preemption`: swap against recompute on a KV pool too small for the batch.

One engine runs the same batch under each preemption mode in turn (recompute, swap, auto,
interleaved over the runs, with the prefix cache reset between them); its pool holds only a
fraction of the KV the whole batch grows to, so running requests are preempted as their
decodes grow. Reported per mode: the median wall time and throughput, how many preemptions
swapped, the tokens recompute computed again, the blocks swapped and in how many copies
(runs of consecutive blocks), and what the engine's cost model (the measured copy and
prefill rates) says each mode spent on preemption.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from kvserve.arg_types import fraction, positive_int
from kvserve.benchmarks.device import synchronize
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.workloads import variable
from kvserve.config import ModelConfig
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams

MODES = ("recompute", "swap", "auto")


def timed_run(llm: Any, prompts: list[dict[str, Any]], params: list[SamplingParams],
              mode: str) -> dict[str, float]:
    engine = llm.engine
    # The scheduler reads the mode at each preemption: one engine serves all three runs.
    engine.config.scheduler.preemption_mode = mode
    llm.reset_prefix_cache()
    before = llm.get_stats()
    host = engine.core.runner.host_kv_cache
    blocks_before = host.num_blocks_copied if host is not None else 0
    copies_before = host.num_copies if host is not None else 0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    synchronize(engine.config.device)
    wall = time.perf_counter() - start
    after = llm.get_stats()
    costs = engine.core.scheduler.costs
    recomputed = after.num_recomputed_tokens - before.num_recomputed_tokens
    copied = (host.num_blocks_copied if host is not None else 0) - blocks_before
    copies = (host.num_copies if host is not None else 0) - copies_before
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "wall s": wall, "out tok/s": num_out / wall,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "swapped": after.num_swapped_preemptions - before.num_swapped_preemptions,
        "recomputed tokens": recomputed, "blocks copied": copied,
        "copies": copies,  # runs of consecutive blocks: one strided copy each
        "est. preemption s": (copied * costs.swap_seconds_per_block
                              + (costs.recompute_seconds(recomputed) or 0.0)),
    }


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    model = ModelConfig.from_pretrained(args.model, args.dtype, args.device)
    work = variable(args.num_prompts, (args.prompt_len // 2, args.prompt_len),
                    (args.output_len // 2, args.output_len), model.vocab_size,
                    args.workload_seed)
    block_size = args.block_size
    need = sum(-(-(len(p) + n) // block_size) for p, n in zip(work.prompts, work.output_lens,
                                                                strict=True))
    pool_blocks = max(int(need * args.pool_fraction), -(-(args.prompt_len + args.output_len)
                                                        // block_size))
    options = {**engine_kwargs(args), "preemption_mode": "swap",
               "kv_cache_memory": pool_blocks * block_size * model.kv_bytes_per_token}
    llm = LLM(**options)
    costs = llm.engine.core.scheduler.costs
    print(f"{work.name}: the batch grows to {need} KV blocks; the pool holds {pool_blocks} "
          f"({100 * pool_blocks / need:.0f}%). Host copy: "
          f"{costs.swap_seconds_per_block * 1e3:.3f} ms per block one way", flush=True)
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in work.output_lens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up, first prefill rates
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for i in range(args.runs):
        for mode in MODES:
            runs[mode].append(timed_run(llm, prompts, params, mode))
            print(f"  run {i + 1}, {mode}: {runs[mode][-1]['wall s']:.2f} s", flush=True)
    rows = []
    for mode, results in runs.items():
        median = {key: statistics.median(r[key] for r in results) for key in results[0]}
        rows.append({"mode": mode, **{key: round(v, 3) if isinstance(v, float) else v
                                      for key, v in median.items()}})
    walls = {row["mode"]: row["wall s"] for row in rows}
    best = min(walls["recompute"], walls["swap"])
    rate = costs.prefill_seconds_per_token
    print_table(rows, title=f"preemption modes, {args.model} on {args.device} "
                            f"(median of {args.runs})")
    ratios = {"recompute / swap wall": round(walls["recompute"] / walls["swap"], 2),
              "auto / best wall": round(walls["auto"] / best, 3)}
    print_table([ratios], title="ratios (auto is meant to be <= 1.0x the better mode)")
    if rate is not None:
        print(f"measured prefill: {rate * 1e3:.3f} ms per token; one block costs "
              f"{2 * costs.swap_seconds_per_block * 1e3:.3f} ms to swap out and in against "
              f"{rate * block_size * 1e3:.3f} ms to recompute")
    save_json(args.json, {"benchmark": "preemption", "model": args.model,
                          "device": args.device, "pool_blocks": pool_blocks,
                          "needed_blocks": need, "rows": rows, "ratios": ratios})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("preemption", help="swap against recompute preemption on a KV pool "
                                          "too small for the batch")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=positive_int, default=32)
    p.add_argument("--prompt-len", type=positive_int, default=512,
                   help="prompts draw their length from [half of this, this]")
    p.add_argument("--output-len", type=positive_int, default=128,
                   help="outputs draw their length from [half of this, this]")
    p.add_argument("--pool-fraction", type=fraction, default=0.5,
                   help="the KV pool holds this fraction of what the whole batch grows to")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--runs", type=positive_int, default=3,
                   help="runs per mode; the median is reported")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=run)
