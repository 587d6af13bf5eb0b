"""`kvserve bench speculative`: batch-1 time per output token with speculative decoding
against the same engine without it, in one process, on the same prompts: held-out code from
the project's corpus (text that repeats itself, as code does) and random tokens (where drafts
are rare or wrong). Reported per workload and temperature: both TPOTs, their ratio, and the
share of drafted tokens the model accepted. Runs alternate between the two engines; the
table gives medians."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from kvserve.benchmarks.device import synchronize
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.workloads import fixed
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


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    options = engine_kwargs(args)
    options["speculative_model"] = args.speculative_model or "ngram"
    speculative = LLM(**options)
    plain = LLM(**{**options, "speculative_model": None})
    cfg = plain.engine.config
    rows = []
    for name, prompts in workloads(plain, args.num_prompts, args.prompt_len).items():
        for temperature in args.temperatures:
            params = [SamplingParams(temperature=temperature, max_tokens=args.output_len,
                                     ignore_eos=True, seed=i) for i in range(len(prompts))]
            tpot(plain, prompts[0], params[0])  # first-use costs
            tpot(speculative, prompts[0], params[0])
            drafted, accepted = acceptance(speculative)
            base, spec = [], []
            for _ in range(args.runs):
                for prompt, p in zip(prompts, params, strict=True):
                    base.append(tpot(plain, prompt, p))
                    spec.append(tpot(speculative, prompt, p))
            drafted_after, accepted_after = acceptance(speculative)
            drafted, accepted = drafted_after - drafted, accepted_after - accepted
            num_tokens = args.runs * len(prompts) * args.output_len
            base_s, spec_s = statistics.median(base), statistics.median(spec)
            rows.append({
                "prompts": name, "temperature": temperature,
                "TPOT ms": round(base_s * 1e3, 2), "speculative TPOT ms": round(spec_s * 1e3, 2),
                "speedup": round(base_s / spec_s, 2),
                "accepted %": round(100 * accepted / drafted, 1) if drafted else None,
                "drafts per token": round(drafted / num_tokens, 2)})
            print_table(rows[-1:])
    print_table(rows, title=(
        f"speculative decoding ({options['speculative_model']}, up to "
        f"{args.num_speculative_tokens} drafts), {args.model}, {cfg.model.dtype}, {cfg.device}:"
        f" batch 1, {args.num_prompts} prompts of {args.prompt_len} tokens, "
        f"{args.output_len} new tokens each; medians of {args.runs} runs per prompt"))
    save_json(args.json, {"benchmark": "speculative", "model": args.model,
                          "method": options["speculative_model"],
                          "num_speculative_tokens": args.num_speculative_tokens, "rows": rows})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("speculative", help="batch-1 TPOT with speculative decoding against "
                                           "without, and the drafts' acceptance rate")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=run)
