"""`kvserve bench structured`: the cost of a grammar. The same prompts run constrained to a
JSON schema, then free with each request's output length set to what the constrained run
wrote (EOS ignored), so both runs compute the same tokens and differ only by the grammar's
masks. Reported: the share of outputs that parse and validate against the schema, and
constrained output tok/s against free, medians of several runs."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from kvserve.arg_types import non_negative_float, positive_int
from kvserve.benchmarks.device import synchronize
from kvserve.benchmarks.report import print_table, save_json
from kvserve.benchmarks.workloads import fixed
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams, StructuredOutputParams

# An order line: every value bounded, so even a random model's output ends.
SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["id", "customer", "items", "express", "priority"],
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "customer": {"type": "string", "minLength": 1, "maxLength": 24},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 99}}}},
        "express": {"type": "boolean"},
        "priority": {"enum": ["low", "normal", "high"]}}}


def timed(llm: Any, prompts: list[dict[str, Any]], params: SamplingParams | list[SamplingParams]
          ) -> tuple[float, list[Any]]:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    synchronize(llm.engine.config.device)
    return time.perf_counter() - start, outputs


def valid(text: str) -> bool:
    from jsonschema import ValidationError, validate

    try:
        validate(json.loads(text), SCHEMA)
    except (ValueError, ValidationError):
        return False
    return True


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    llm = LLM(**engine_kwargs(args))
    cfg = llm.engine.config.model
    work = fixed(args.num_prompts, args.prompt_len, args.max_tokens, cfg.vocab_size,
                 args.workload_seed)
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    constrained = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                  seed=i, structured_output=StructuredOutputParams(json=SCHEMA))
                   for i in range(len(prompts))]
    timed(llm, prompts[:2], constrained[:2])  # warm-up: the grammar's tokenizer loads here
    rows = []
    for i in range(args.runs):
        seconds, outputs = timed(llm, prompts, constrained)
        lens = [len(o.outputs[0].token_ids) for o in outputs]
        free = [SamplingParams(temperature=args.temperature, max_tokens=n, seed=j,
                               ignore_eos=True) for j, n in enumerate(lens)]
        free_seconds, _ = timed(llm, prompts, free)
        texts = [o.outputs[0].text for o in outputs]
        rows.append({"run": i + 1, "out tokens": sum(lens),
                     "valid %": round(100 * sum(map(valid, texts)) / len(texts), 1),
                     "ended by grammar %": round(100 * sum(
                         o.outputs[0].finish_reason == "stop" for o in outputs) / len(texts), 1),
                     "constrained tok/s": round(sum(lens) / seconds, 1),
                     "free tok/s": round(sum(lens) / free_seconds, 1),
                     "constrained / free": round(free_seconds / seconds, 3)})
        print_table(rows[-1:])
    median = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "run"}
    print_table([median], title=(
        f"structured output, {args.model}, {cfg.dtype}, {llm.engine.config.device}: "
        f"{args.num_prompts} prompts of {args.prompt_len} tokens, a JSON schema, temperature "
        f"{args.temperature}; free = the same output lengths unconstrained; median of "
        f"{args.runs}"))
    save_json(args.json, {"benchmark": "structured", "model": args.model, "schema": SCHEMA,
                          "rows": rows, "median": median})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("structured", help="outputs held to a JSON schema: validity, and "
                                          "throughput against the same tokens unconstrained")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--prompt-len", type=positive_int, default=128)
    p.add_argument("--max-tokens", type=positive_int, default=256)
    p.add_argument("--temperature", type=non_negative_float, default=1.0)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--runs", type=positive_int, default=3)
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=run)
