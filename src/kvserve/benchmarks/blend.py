"""`kvserve bench blend`: CacheBlend on a RAG workload. A corpus of chunks (held-out text of
the project's corpus); each prompt is 4 to 8 of them in random order and a question. Every
prompt runs alone, as full prefill (prefix cache emptied first), blended at each recompute
ratio asked for, and blended with no recompute at all (the chunks' KV reused as it is), on
engines of the same process, with the chunk store warmed first. "cold TTFT" is a prompt's
whose chunks are all new: computed on their own, then blended.

Reported per mode: median TTFT and its ratio to full prefill's; the KL divergence of the
next-token distribution after the prompt from full prefill's (the logits the sampler
receives); and the greedy answer's agreement with full prefill's: the share of prompts whose
first answer token is the same, and the mean share of the answer before the first
difference."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from kvserve.arg_types import fraction, positive_int
from kvserve.benchmarks.device import on_one_gpu, synchronize
from kvserve.benchmarks.report import print_table, save_json
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.sampling_params import SamplingParams


class LogitsTap:
    """Keeps the logits the runner last computed for sampling (one row per request)."""

    def __init__(self, llm: Any) -> None:
        self.model = llm.engine.core.runner.model
        self.compute = self.model.compute_logits
        self.model.compute_logits = self
        self.last: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.last = self.compute(hidden)
        return self.last


def rag_prompts(tokenizer: Any, num_chunks: int, chunk_len: int, num_prompts: int,
                question_len: int, seed: int) -> list[list[list[int]]]:
    """Each prompt's segments: 4 to 8 distinct chunks in random order, then a question."""
    from kvserve.tools.corpus import heldout_windows

    windows = heldout_windows(tokenizer, chunk_len, num_chunks + num_prompts).tolist()
    if len(windows) < num_chunks + num_prompts:
        raise SystemExit(f"the held-out text holds {len(windows)} windows of {chunk_len} "
                         f"tokens, fewer than the {num_chunks + num_prompts} asked for")
    chunks, questions = windows[:num_chunks], windows[num_chunks:]
    rng = random.Random(seed)
    return [rng.sample(chunks, rng.randint(min(4, num_chunks), min(8, num_chunks)))
            + [question[:question_len]] for question in questions]


def first_token(llm: Any, prompt: dict[str, Any], params: SamplingParams
                ) -> tuple[float, list[int]]:
    """TTFT in seconds of the prompt alone, and its output tokens."""
    start = time.monotonic()
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    synchronize(llm.engine.config.device)
    return output.first_token_time - start, output.outputs[0].token_ids


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(reference || other) of the distributions the logits give, in nats."""
    log_p = torch.log_softmax(reference.float(), -1)
    log_q = torch.log_softmax(other.float(), -1)
    return float((log_p.exp() * (log_p - log_q)).sum())


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def run(args: argparse.Namespace) -> None:
    from kvserve import LLM

    modes = {f"blend {r:g}": r for r in args.ratios} | {"reuse, no recompute": 0.0}
    options = on_one_gpu(engine_kwargs(args), 1 + len(modes))
    full = LLM(**options)
    engines = {name: LLM(**{**options, "blend_recompute_ratio": ratio})
               for name, ratio in modes.items()}
    cfg = full.engine.config
    prompts = rag_prompts(full.engine.tokenizer, args.num_chunks, args.chunk_len,
                          args.num_prompts, args.question_len, args.seed)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    answer = SamplingParams(temperature=0.0, max_tokens=args.answer_len, ignore_eos=True)
    # The ranks' processes hold the model under tensor parallelism: no logits to compare.
    tapped = cfg.tensor_parallel_size == 1
    taps = {name: LogitsTap(llm) for name, llm in [("full prefill", full), *engines.items()]
            if tapped}

    def full_prefill(segments: list[list[int]], params: SamplingParams
                     ) -> tuple[float, list[int]]:
        full.reset_prefix_cache()
        return first_token(full, {"prompt_token_ids": sum(segments, [])}, params)

    full_prefill(prompts[0], one)  # first-use costs
    cold: dict[str, list[float]] = {name: [] for name in engines}
    for segments in prompts:  # every chunk computed first, then the store warmed for later
        for name, llm in engines.items():
            llm.reset_prefix_cache()
            cold[name].append(first_token(llm, {"segments": segments}, one)[0])
    for segments in prompts:
        for llm in engines.values():
            first_token(llm, {"segments": segments}, one)
    ttft: dict[str, list[float]] = {name: [] for name in ["full prefill", *engines]}
    kl: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.runs):
        for segments in prompts:
            ttft["full prefill"].append(full_prefill(segments, one)[0])
            for name, llm in engines.items():
                ttft[name].append(first_token(llm, {"segments": segments}, one)[0])
                if tapped:
                    kl[name].append(kl_divergence(taps["full prefill"].last[0],
                                                  taps[name].last[0]))
    answers = {"full prefill": [full_prefill(s, answer)[1] for s in prompts]}
    for name, llm in engines.items():
        answers[name] = [first_token(llm, {"segments": s}, answer)[1] for s in prompts]
    base = statistics.median(ttft["full prefill"])
    rows = []
    for name in ttft:
        median = statistics.median(ttft[name])
        pairs = list(zip(answers["full prefill"], answers[name], strict=True))
        rows.append({
            "mode": name, "TTFT ms": round(median * 1e3, 1),
            "speedup": round(base / median, 2),
            "cold TTFT ms": (round(statistics.median(cold[name]) * 1e3, 1)
                             if name in cold else ""),
            "KL nats": (round(statistics.mean(kl[name]), 4) if kl.get(name)
                        else 0.0 if tapped else None),
            "first token equal %": round(100 * statistics.mean(a[0] == b[0] for a, b in pairs)),
            "answer agreement %": round(100 * statistics.mean(
                common_prefix(a, b) / args.answer_len for a, b in pairs), 1)})
    num_tokens = statistics.mean(len(sum(s, [])) for s in prompts)
    print_table(rows, title=(
        f"CacheBlend, {args.model}, {cfg.model.dtype}, {cfg.device}: {args.num_prompts} "
        f"prompts of 4-8 chunks from {args.num_chunks} of {args.chunk_len} tokens and a "
        f"{args.question_len}-token question (mean {num_tokens:.0f} tokens); TTFT medians of "
        f"{args.runs} runs per prompt; agreement over {args.answer_len} greedy tokens"))
    save_json(args.json, {"benchmark": "blend", "model": args.model, "dtype": str(cfg.model.dtype),
                          "mean_prompt_tokens": num_tokens, "rows": rows})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("blend", help="CacheBlend on a RAG workload: TTFT and quality against "
                                     "full prefill and against reuse with no recompute")
    add_engine_args(p)
    p.add_argument("--ratios", type=fraction, nargs="+", default=[0.15],
                   help="recompute ratios to measure (default 0.15)")
    p.add_argument("--num-chunks", type=positive_int, default=16)
    p.add_argument("--chunk-len", type=positive_int, default=192)
    p.add_argument("--num-prompts", type=positive_int, default=16)
    p.add_argument("--question-len", type=positive_int, default=24)
    p.add_argument("--answer-len", type=positive_int, default=32)
    p.add_argument("--runs", type=positive_int, default=3)
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=run)
