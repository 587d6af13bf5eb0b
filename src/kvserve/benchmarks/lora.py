"""`kvserve bench lora`: output tokens/s of a batch whose requests run on several LoRA
adapters at once (request i on adapter i mod N), against the same batch on the base model,
in one process. The adapters are random ones in PEFT's format (`tools/make_lora.py`),
targeting every projection of every layer."""

from __future__ import annotations

import argparse
import statistics
import tempfile

from kvserve.arg_types import positive_int
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.structured import timed
from kvserve.benchmarks.workloads import fixed
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams
from kvserve.tools.make_lora import make_lora


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    with tempfile.TemporaryDirectory() as folder:
        names = [f"adapter-{i}" for i in range(args.num_adapters)]
        for i, name in enumerate(names):
            make_lora(args.model, f"{folder}/{name}", rank=args.rank, seed=i)
        options = engine_kwargs(args)
        options["lora_modules"] = {name: f"{folder}/{name}" for name in names}
        options["max_loras"] = max(options["max_loras"], args.num_adapters)
        llm = LLM(**options)
    cfg = llm.engine.config
    work = fixed(args.num_prompts, args.prompt_len, args.output_len, cfg.model.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    base = [{"prompt_token_ids": p} for p in work.prompts]
    mixed = [{**p, "lora_name": names[i % len(names)]} for i, p in enumerate(base)]
    num_tokens = len(base) * args.output_len
    timed(llm, base[:2], params)  # first-use costs
    timed(llm, mixed[:2], params)
    rows = []
    for i in range(args.runs):
        base_s, mixed_s = timed(llm, base, params)[0], timed(llm, mixed, params)[0]
        rows.append({"run": i + 1, "base tok/s": round(num_tokens / base_s, 1),
                     f"{len(names)} adapters tok/s": round(num_tokens / mixed_s, 1),
                     "ratio": round(base_s / mixed_s, 3)})
        print_table(rows[-1:])
    median = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "run"}
    print_table([median], title=(
        f"LoRA, {args.model}, {cfg.model.dtype}, {cfg.device}: {work.name}, greedy; "
        f"{len(names)} adapters of rank {args.rank} mixed in the batch against the base "
        f"model; median of {args.runs}"))
    save_json(args.json, {"benchmark": "lora", "model": args.model, "rank": args.rank,
                          "num_adapters": len(names), "rows": rows, "median": median})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lora", help="throughput with many LoRA adapters in one batch, "
                                    "against the base model")
    add_engine_args(p)
    p.add_argument("--num-adapters", type=positive_int, default=8)
    p.add_argument("--rank", type=positive_int, default=16)
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--prompt-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--runs", type=positive_int, default=3)
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=run)
