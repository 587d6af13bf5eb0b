"""`kvserve bench speculative`: batch-1 time per output token with speculative decoding
against the same engine without it, in one process, on the same prompts: held-out code from
the project's corpus (text that repeats itself, as code does) and random tokens (where drafts
are rare or wrong). Reported per workload and temperature: both TPOTs, their ratio, and the
share of drafted tokens the model accepted. Runs alternate between the two engines, half of
them with each engine built first; the table gives medians."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.arg_types import non_negative_float, positive_int
from kvserve.benchmarks.device import on_one_gpu, synchronize
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.workloads import fixed
from kvserve.config import SPECULATIVE_TUNING
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams


def tpot(llm: Any, prompt: list[int], params: SamplingParams) -> float:
    """Seconds per output token after the first, of one request alone."""
    llm.reset_prefix_cache()
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    synchronize(llm.engine.config.device)
    end = time.monotonic()
    return (end - output.first_token_time) / (len(output.outputs[0].token_ids) - 1)


def acceptance(llm: Any) -> tuple[int, int]:
    scheduler = llm.engine.core.scheduler
    return scheduler.num_draft_tokens, scheduler.num_accepted_tokens


def workloads(llm: Any, num_prompts: int, prompt_len: int) -> dict[str, list[list[int]]]:
    from kvserve.tools.corpus import heldout_windows

    vocab_size = llm.engine.config.model.vocab_size
    code = heldout_windows(llm.engine.tokenizer, prompt_len, num_prompts).tolist()
    return {"code": code,
            "random tokens": fixed(num_prompts, prompt_len, 1, vocab_size).prompts}


@dataclass
class _Samples:
    """One workload and temperature's TPOTs without and with drafts, and the drafts' fate."""

    base: list[float] = field(default_factory=list)
    spec: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    options = on_one_gpu(engine_kwargs(args), 2)
    options["speculative_model"] = args.speculative_model or "ngram"
    samples: dict[tuple[str, float], _Samples] = {}
    # Two engines in one process decode at speeds up to 5 % apart by which was built first
    # (seen on a 2-core Xeon with the same engine twice), so the runs are split between
    # both build orders.
    for speculative_first in (True, False):
        runs = (args.runs + speculative_first) // 2
        if not runs:
            continue
        builds = [options, {**{k: v for k, v in options.items() if k not in SPECULATIVE_TUNING},
                            "speculative_model": None}]
        if speculative_first:
            speculative, plain = (LLM(**o) for o in builds)
        else:
            plain, speculative = (LLM(**o) for o in builds[::-1])
        cfg = plain.engine.config
        num_drafts = speculative.engine.config.num_speculative_tokens
        for name, prompts in workloads(plain, args.num_prompts, args.prompt_len).items():
            for temperature in args.temperatures:
                measure(plain, speculative, prompts, temperature, args.output_len, runs,
                        samples.setdefault((name, temperature), _Samples()))
                print(f"{name}, temperature {temperature}: {runs} runs with the "
                      f"{'speculative' if speculative_first else 'plain'} engine built first",
                      flush=True)
        del speculative, plain
        gc.collect()
    rows = []
    for (name, temperature), got in samples.items():
        base_s, spec_s = statistics.median(got.base), statistics.median(got.spec)
        rows.append({
            "prompts": name, "temperature": temperature,
            "TPOT ms": round(base_s * 1e3, 2), "speculative TPOT ms": round(spec_s * 1e3, 2),
            "speedup": round(base_s / spec_s, 2),
            "accepted %": round(100 * got.accepted / got.drafted, 1) if got.drafted else None,
            "drafts per token": round(got.drafted / (len(got.spec) * args.output_len), 2)})
    print_table(rows, title=(
        f"speculative decoding ({options['speculative_model']}, up to "
        f"{num_drafts} drafts), {args.model}, {cfg.model.dtype}, {cfg.device}:"
        f" batch 1, {args.num_prompts} prompts of {args.prompt_len} tokens, "
        f"{args.output_len} new tokens each; medians of {args.runs} runs per prompt, split "
        f"between the two engines' build orders"))
    save_json(args.json, {"benchmark": "speculative", "model": args.model,
                          "method": options["speculative_model"],
                          "num_speculative_tokens": num_drafts, "rows": rows})


def measure(plain: Any, speculative: Any, prompts: list[list[int]], temperature: float,
            output_len: int, runs: int, into: _Samples) -> None:
    """`runs` runs of each prompt on each engine in turn, after one of each to warm up."""
    params = [SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True,
                             seed=i) for i in range(len(prompts))]
    tpot(plain, prompts[0], params[0])  # first-use costs
    tpot(speculative, prompts[0], params[0])
    drafted, accepted = acceptance(speculative)
    for _ in range(runs):
        for prompt, p in zip(prompts, params, strict=True):
            into.base.append(tpot(plain, prompt, p))
            into.spec.append(tpot(speculative, prompt, p))
    drafted_after, accepted_after = acceptance(speculative)
    into.drafted += drafted_after - drafted
    into.accepted += accepted_after - accepted


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("speculative", help="batch-1 TPOT with speculative decoding against "
                                           "without, and the drafts' acceptance rate")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=positive_int, default=4)
    p.add_argument("--prompt-len", type=positive_int, default=256)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--temperatures", type=non_negative_float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--runs", type=positive_int, default=4)
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=run)
