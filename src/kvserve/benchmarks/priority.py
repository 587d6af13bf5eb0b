"""`kvserve bench priority`: tail latency of a favoured class under overload, per policy.

A stream of requests arrives as a Poisson process at `--overload` times the engine's
capacity (its offline request rate on the same workload, measured first); a random
`--high-fraction` of them form the favoured class. The same arrivals are replayed in
process against one engine per scheduling policy:
- fcfs: the baseline, which ignores classes;
- priority: the favoured class has priority 0, the rest 1;
- fair: the favoured class is one tenant and the rest another, so the light tenant's share
  of the budget is what protects it.
Per policy and class it reports TTFT percentiles and the longest queue time (arrival to
first step): the favoured class's p99 TTFT against FCFS's is the headline ratio, and the
other class's longest wait shows that nobody starves.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any

from kvserve.arg_types import fraction, positive_float, positive_int
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.serve import percentile
from kvserve.benchmarks.workloads import variable
from kvserve.config import ModelConfig
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams

POLICIES = ("fcfs", "priority", "fair")


@dataclass
class Timing:
    favoured: bool
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


def replay(llm: Any, prompts: list[list[int]], output_lens: list[int], offsets: list[float],
           favoured: list[bool]) -> list[Timing]:
    """Adds each request at its arrival offset and steps the engine until all finish."""
    engine = llm.engine
    timings = [Timing(f, 0.0) for f in favoured]
    order = sorted(range(len(prompts)), key=offsets.__getitem__)
    start = time.monotonic()
    next_index = 0
    while next_index < len(order) or engine.has_unfinished_requests():
        now = time.monotonic()
        while next_index < len(order) and start + offsets[order[next_index]] <= now:
            i = order[next_index]
            timings[i].arrival = start + offsets[i]
            prompt = {"prompt_token_ids": prompts[i], "priority": 0 if favoured[i] else 1,
                      "tenant": "light" if favoured[i] else "heavy"}
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=output_lens[i],
                                                      ignore_eos=True), request_id=str(i))
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + offsets[order[next_index]] - time.monotonic()))
            continue
        for out in engine.step():
            timing = timings[int(out.request_id)]
            timing.first_scheduled = out.first_scheduled_time
            timing.first_token = timing.first_token or out.first_token_time
            if out.finished:
                timing.finished = time.monotonic()
    return timings


def ttfts(timings: list[Timing]) -> list[float]:
    return [t.first_token - t.arrival for t in timings if t.first_token is not None]


def class_row(policy: str, label: str, timings: list[Timing]) -> dict[str, object]:
    ttft = ttfts(timings)
    queue = [t.first_scheduled - t.arrival for t in timings if t.first_scheduled is not None]
    e2e = [t.finished - t.arrival for t in timings if t.finished is not None]
    return {"policy": policy, "class": label, "requests": len(timings),
            "TTFT p50 s": round(percentile(ttft, 50), 2),
            "TTFT p99 s": round(percentile(ttft, 99), 2),
            "max queue s": round(max(queue, default=float("nan")), 2),
            "E2E p99 s": round(percentile(e2e, 99), 2)}


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    model = ModelConfig.from_pretrained(args.model)
    work = variable(args.num_requests, (args.prompt_len // 2, args.prompt_len),
                    (args.output_len // 2, args.output_len), model.vocab_size,
                    args.workload_seed)
    rng = random.Random(args.workload_seed)
    favoured = [rng.random() < args.high_fraction for _ in work.prompts]
    llm = LLM(**{**engine_kwargs(args), "scheduling_policy": "fcfs"})
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in work.output_lens]
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    capacity = len(prompts) / (time.perf_counter() - start)
    rate = args.overload * capacity
    offsets, clock = [], 0.0
    for _ in work.prompts:
        clock += rng.expovariate(rate)
        offsets.append(clock)
    print(f"{work.name}, {sum(favoured)} favoured: capacity {capacity:.2f} req/s offline; "
          f"arrivals at {rate:.2f} req/s ({args.overload}x) over {clock:.0f} s", flush=True)
    rows, p99 = [], {}
    for policy in args.policies:
        llm = LLM(**{**engine_kwargs(args), "scheduling_policy": policy})
        llm.generate(prompts[:2], params[:2], use_tqdm=False)
        llm.reset_prefix_cache()
        timings = replay(llm, work.prompts, work.output_lens, offsets, favoured)
        kv = llm.engine.core.kv_cache
        kv.check_integrity()
        assert kv.num_used_blocks == 0 and kv.num_used_host_blocks == 0
        for label, cls in (("favoured", True), ("other", False)):
            rows.append(class_row(policy, label, [t for t in timings if t.favoured == cls]))
        # unrounded: a favoured class served within milliseconds rounds to 0.0 in the table
        p99[policy] = percentile(ttfts([t for t in timings if t.favoured]), 99)
        print(f"  {policy}: favoured p99 TTFT {p99[policy]:.4f} s, other max queue "
              f"{rows[-1]['max queue s']} s", flush=True)
    print_table(rows, title=f"{args.model} on {args.device}: {args.high_fraction:.0%} favoured "
                            f"at {args.overload}x capacity")
    ratios = {f"favoured p99 TTFT, fcfs / {p}": round(p99["fcfs"] / p99[p], 2)
              for p in args.policies if p != "fcfs" and "fcfs" in p99}
    print_table([ratios], title="ratios")
    save_json(args.json, {"benchmark": "priority", "model": args.model, "device": args.device,
                          "capacity_req_s": capacity, "rate_req_s": rate, "rows": rows,
                          "ratios": ratios})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("priority", help="favoured-class tail TTFT under overload: fcfs "
                                        "against priority and fair scheduling")
    add_engine_args(p)
    p.add_argument("--num-requests", type=positive_int, default=200)
    p.add_argument("--prompt-len", type=positive_int, default=256,
                   help="prompts draw their length from [half of this, this]")
    p.add_argument("--output-len", type=positive_int, default=64,
                   help="outputs draw their length from [half of this, this]")
    p.add_argument("--high-fraction", type=fraction, default=0.2,
                   help="share of requests in the favoured class")
    p.add_argument("--overload", type=positive_float, default=1.5,
                   help="arrival rate as a multiple of the measured capacity")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=run)
