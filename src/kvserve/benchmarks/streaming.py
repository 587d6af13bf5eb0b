"""`kvserve bench streaming`: one endless stream with attention sinks and a sliding window.

A single greedy request generates `--num-tokens` tokens (100,000 by default, far past
`max_model_len`) through an engine with `--streaming-window` (and `--attention-sinks`). Every
`--report-every` tokens it reports the time per token and the KV blocks in use, which should
both stay flat. The same command then times the baseline StreamingLLM compares against, a
sliding window that recomputes: each token a prefill of the last window's tokens, with no
cache kept between tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from kvserve.arg_types import positive_int
from kvserve.benchmarks.device import timed
from kvserve.benchmarks.report import print_table, save_json
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams


def shift_seconds(engine: Any, num_blocks: int, num_positions: int) -> float:
    """What sliding the window by one block costs: shifting its other blocks' keys."""
    runner = engine.core.runner
    blocks = list(range(num_blocks))
    return statistics.median(timed(lambda: runner._shift_keys(blocks, num_positions),
                                   engine.config.device) for _ in range(20))


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    options = engine_kwargs(args)
    if not options["streaming_window"]:
        raise ValueError("bench streaming needs --streaming-window (and "
                         "--no-enable-prefix-caching)")
    llm = LLM(**options)
    engine = llm.engine
    window_tokens = (engine.config.sink_blocks + options["streaming_window"]) * args.block_size
    prompt = torch.randint(3, engine.config.model.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.num_tokens, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompt}, params, request_id="stream")
    rows, generated, peak_blocks, bucket_peak = [], 0, 0, 0
    start = bucket_start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated = len(out.outputs[0].token_ids)
        used = engine.core.kv_cache.num_used_blocks
        bucket_peak = max(bucket_peak, used)
        if generated and (generated % args.report_every == 0 or generated == args.num_tokens):
            now = time.perf_counter()
            done = rows[-1]["tokens"] if rows else 0
            rows.append({"tokens": generated,
                         "ms/token": round(1e3 * (now - bucket_start) / (generated - done), 3),
                         "peak KV blocks": bucket_peak})
            print(f"  {generated} tokens: {rows[-1]['ms/token']} ms/token, "
                  f"{bucket_peak} KV blocks", flush=True)
            peak_blocks = max(peak_blocks, bucket_peak)
            bucket_start, bucket_peak = now, 0
    wall = time.perf_counter() - start
    shift = shift_seconds(engine, options["streaming_window"] - 1, args.block_size)
    del llm, engine
    # The baseline: every token recomputes its window from scratch (no KV kept).
    dense = LLM(**{**options, "streaming_window": 0, "attention_sinks": None})
    context = prompt * (window_tokens // len(prompt) + 1)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(args.recompute_tokens):
        begin = time.perf_counter()
        dense.generate({"prompt_token_ids": context[i % len(prompt):][:window_tokens]}, one,
                       use_tqdm=False)
        times.append(time.perf_counter() - begin)
    recompute = statistics.median(times)
    per_token = wall / args.num_tokens
    print_table(rows, title=f"{args.model}: one stream of {args.num_tokens} tokens, a cache of "
                            f"{window_tokens} tokens (max_model_len {args.max_model_len})")
    first, last = rows[0]["ms/token"], rows[-1]["ms/token"]
    summary = {"ms/token": round(1e3 * per_token, 3), "last / first bucket": round(last / first, 3),
               "peak KV blocks": peak_blocks,
               "key shifts % of time": round(100 * shift / args.block_size / per_token, 2),
               "recompute ms/token": round(1e3 * recompute, 3),
               "recompute / streaming": round(recompute / per_token, 1)}
    print_table([summary], title="streaming against a sliding window that recomputes")
    save_json(args.json, {"benchmark": "streaming", "model": args.model,
                          "window_tokens": window_tokens, "rows": rows, "summary": summary})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("streaming", help="one endless stream with attention sinks: per-token "
                                         "time and KV blocks along 100,000 tokens")
    add_engine_args(p)
    p.add_argument("--num-tokens", type=positive_int, default=100_000)
    p.add_argument("--prompt-len", type=positive_int, default=16)
    p.add_argument("--report-every", type=positive_int, default=10_000)
    p.add_argument("--recompute-tokens", type=positive_int, default=20,
                   help="tokens timed for the recomputing baseline (median)")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)
